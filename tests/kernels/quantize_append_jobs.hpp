#pragma once
// Test-side helpers of the quantize-append GPU test (host code only, no CUDA calls):
//  - FlushJobs: the kernel's job list built from CommitPlans (what a device backend's host side
//    does after BlockTable::plan_commit);
//  - CacheBytes: host copies of every byte a flush may write (pages of every pool, key-scale
//    records, second-level scales) taken from a CPU PagedKvCache;
//  - destination_ranges: the bytes a plan's commit writes, computed here from docs/design.md's
//    layout independently of the library's CacheLayout / CpuKvBackend offsets;
//  - build_flush_scenario: drives a CPU cache (random thought types, Gaussian / heavy-tailed /
//    all-zero / outlier / tiny / huge groups, evictions so that commits reuse evicted slots in
//    place, fresh streams whose s2 is still unset), brings a random subset of streams to a full
//    staging group, snapshots the cache, runs the CPU commits of exactly those groups (recording
//    the plans, in commit order) and snapshots again.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "thinkv/kernels/quantize_append.hpp"
#include "thinkv/paged_kv_cache.hpp"

namespace thinkv::test {

/// The kernel's job list: one job and g destination slot ids per commit plan.
struct FlushJobs {
  std::vector<kernels::QuantizeAppendJob> jobs;
  std::vector<std::uint32_t> dest_slots;  // [jobs, g] global slot id = block * B + slot

  void add(const CommitPlan& plan, int block_size) {
    kernels::QuantizeAppendJob j;
    j.stream = plan.stream;
    j.record = plan.record;
    j.precision = plan.precision;
    jobs.push_back(j);
    for (const SlotRef& s : plan.slots) {
      dest_slots.push_back(s.block * static_cast<std::uint32_t>(block_size) + s.slot);
    }
  }
  [[nodiscard]] int size() const { return static_cast<int>(jobs.size()); }
};

/// Host copies of the bytes a flush may write.
struct CacheBytes {
  std::array<std::vector<std::uint8_t>, kNumPrecisions> pages;  // pool p: [count, page_bytes]
  std::vector<std::uint8_t> records;                            // [records, D]
  std::vector<float> s2;                                        // [S, 2, P]

  static CacheBytes of(const PagedKvCache<CpuKvBackend>& cache) {
    const CacheConfig& cfg = cache.config();
    const PoolMap& pools = cache.table().pools();
    const CpuKvBackend& be = cache.backend();
    CacheBytes b;
    for (int p = 0; p < kNumPrecisions; ++p) {
      for (std::uint32_t i = 0; i < pools.count[p]; ++i) {
        const auto page = be.page(pools.base[p] + i);
        b.pages[static_cast<std::size_t>(p)].insert(b.pages[static_cast<std::size_t>(p)].end(), page.begin(),
                                                    page.end());
      }
    }
    const auto records = static_cast<std::uint32_t>(effective_record_capacity(cfg));
    for (std::uint32_t r = 0; r < records; ++r) {
      const auto s = be.record_scales(r);
      b.records.insert(b.records.end(), s.begin(), s.end());
    }
    for (int s = 0; s < cfg.num_streams; ++s) {
      for (int kv = 0; kv < 2; ++kv) {
        for (Precision p : kAllPrecisions) b.s2.push_back(be.stream_scale(s, kv, p));
      }
    }
    return b;
  }
};

/// A run of bytes in pool `pool`'s pages (pool >= 0) or in the key-scale records (pool == -1).
struct ByteRange {
  int pool = 0;
  std::size_t offset = 0;
  std::size_t size = 0;
  const char* what = "";
};

/// The bytes the commit of `plan` writes, from the layout of docs/design.md ("Memory accounting")
/// and cpu_backend.hpp's header comment, recomputed here on purpose (no CacheLayout, PoolMap or
/// backend offsets): pools are consecutive in precision order, a page is
/// [B x rb] K rows | [B x rb] V rows | [B x D/g] value scales, rb = D * bits / 8; a record is D
/// bytes. Records are written only for quantized precisions.
inline std::vector<ByteRange> destination_ranges(const CacheConfig& cfg, const CommitPlan& plan) {
  const int p = static_cast<int>(plan.precision);
  const int bits = p == 0 ? 16 : p == 1 ? 8 : p == 2 ? 4 : 2;
  const std::size_t d = static_cast<std::size_t>(cfg.head_dim);
  const std::size_t bs = static_cast<std::size_t>(cfg.block_size);
  const std::size_t rb = d * static_cast<std::size_t>(bits) / 8;
  const std::size_t vsb = p == 0 ? 0 : d / static_cast<std::size_t>(cfg.group_size);
  const std::size_t page = bs * (2 * rb + vsb);
  std::uint32_t base = 0;
  for (int q = 0; q < p; ++q) base += static_cast<std::uint32_t>(cfg.pool_blocks[static_cast<std::size_t>(q)]);
  std::vector<ByteRange> out;
  for (const SlotRef& s : plan.slots) {
    const std::size_t at = static_cast<std::size_t>(s.block - base) * page;
    out.push_back({p, at + s.slot * rb, rb, "K row"});
    out.push_back({p, at + (bs + s.slot) * rb, rb, "V row"});
    if (vsb > 0) out.push_back({p, at + 2 * bs * rb + s.slot * vsb, vsb, "value scales"});
  }
  if (p != 0) out.push_back({-1, static_cast<std::size_t>(plan.record) * d, d, "key-scale record"});
  return out;
}

/// Kinds of flushed groups (K and V drawn independently, same kind).
enum class GroupKind : int {
  kGaussian = 0,  ///< N(0, sigma^2), sigma log-uniform in [2^-4, 2^4]
  kHeavyTail,     ///< Student-t (3 dof) * sigma
  kZero,          ///< all zero, K and V
  kZeroKeys,      ///< K all zero, V Gaussian
  kOutlier,       ///< Gaussian with one element of K and one of V 10^4 times larger (sign random)
  kTiny,          ///< Gaussian * 1e-38 (float subnormals, BF16-rounded)
  kHuge,          ///< Gaussian * 1e15
  kCount
};
inline const char* to_string(GroupKind k) {
  static const char* const names[] = {"gaussian", "heavy-tail", "zero", "zero-keys", "outlier", "tiny", "huge"};
  return names[static_cast<int>(k)];
}

/// The g tokens (K and V, [g, D] each) of one group of kind `kind`.
inline void make_group(GroupKind kind, int g, int d, std::mt19937_64& rng, std::vector<float>& k,
                       std::vector<float>& v) {
  const auto n = static_cast<std::size_t>(g) * static_cast<std::size_t>(d);
  k.assign(n, 0.0f);
  v.assign(n, 0.0f);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::student_t_distribution<float> td(3.0f);
  const float sigma = std::exp2(std::uniform_real_distribution<float>(-4.0f, 4.0f)(rng));
  for (int kv = 0; kv < 2; ++kv) {
    std::vector<float>& x = kv == 0 ? k : v;
    switch (kind) {
      case GroupKind::kZero: break;
      case GroupKind::kZeroKeys:
        if (kv == 1) {
          for (auto& e : x) e = nd(rng) * sigma;
        }
        break;
      case GroupKind::kHeavyTail:
        for (auto& e : x) e = std::clamp(td(rng), -1e6f, 1e6f) * sigma;
        break;
      case GroupKind::kOutlier:
        for (auto& e : x) e = nd(rng) * sigma;
        // At a random element, or at the first or last one (loop-bound mistakes show there).
        x[rng() % 3 == 0   ? 0
          : rng() % 2 == 0 ? n - 1
                           : std::uniform_int_distribution<std::size_t>(0, n - 1)(rng)] =
            1e4f * sigma * (rng() % 2 ? 1.0f : -1.0f);
        break;
      case GroupKind::kTiny:
        for (auto& e : x) e = nd(rng) * 1e-38f;
        break;
      case GroupKind::kHuge:
        for (auto& e : x) e = nd(rng) * 1e15f;
        break;
      default:
        for (auto& e : x) e = nd(rng) * sigma;
        break;
    }
  }
}

struct ScenarioSpec {
  const char* name = "";
  int streams = 8;
  int head_dim = 128;
  int group_size = 16;
  int block_size = 16;
  PrecisionMap map{};
  int max_warmup_tokens = 200;  ///< per stream, before the first eviction
  double flush_share = 0.75;    ///< share of streams with a full group at the flush
};

/// Everything the GPU test compares: the cache before and after the CPU commits of the flush,
/// the device staging contents, and the job list.
struct FlushScenario {
  CacheConfig config;
  std::unique_ptr<PagedKvCache<CpuKvBackend>> cache;  // after the flush
  CacheBytes before, after;
  /// [S, 2, g, D] BF16 as the device staging holds it at the flush: the full groups of the
  /// flushed streams; every other row (streams not flushed) is the BF16 NaN 0x7FC0, so that a
  /// read of a wrong row shows.
  std::vector<std::uint16_t> staging;
  std::vector<CommitPlan> plans;  // in CPU commit order
  FlushJobs jobs;                 // jobs[i] = plans[i]
  std::vector<GroupKind> kinds;   // kind of jobs[i]'s group
  std::vector<int> unflushed_streams;
  std::int64_t saturations = 0;  // CPU scale_saturations of the flush
  int reused_slots = 0;          // flush slots that reuse evicted slots
  int multi_block_jobs = 0;      // jobs whose slots span more than one block
  int unset_s2 = 0;              // (job, K/V) whose s2 was unset before the flush
  std::string error;             // non-empty: the scenario could not be built (a CPU error)
};

namespace detail {

inline ThoughtType random_thought(std::mt19937_64& rng) {
  return static_cast<ThoughtType>(std::uniform_int_distribution<int>(0, 2)(rng));
}

/// Appends n tokens (group kinds random, thought types changing only at group boundaries).
inline Status append_tokens(PagedKvCache<CpuKvBackend>& cache, int stream, int n, std::mt19937_64& rng) {
  const int d = cache.config().head_dim;
  const int g = cache.config().group_size;
  std::vector<float> k, v;
  ThoughtType t = cache.table().staged_count(stream) > 0 ? cache.table().staged_thought(stream) : random_thought(rng);
  for (int i = 0; i < n; ++i) {
    const int row = cache.table().staged_count(stream);
    if (row == 0) {
      if (rng() % 3 == 0) t = random_thought(rng);
      // Mostly ordinary groups; now and then an all-zero one (s2 stays unset when all are).
      const int r = static_cast<int>(rng() % 10);
      const GroupKind kind = r < 5 ? GroupKind::kGaussian : r < 8 ? GroupKind::kHeavyTail : GroupKind::kZero;
      make_group(kind, g, d, rng, k, v);
    } else if (k.empty()) {  // the group started before this call
      make_group(GroupKind::kGaussian, g, d, rng, k, v);
    }
    const auto off = static_cast<std::size_t>(row) * static_cast<std::size_t>(d);
    THINKV_RETURN_IF_ERROR(cache.append(stream, std::span<const float>(k.data() + off, static_cast<std::size_t>(d)),
                                        std::span<const float>(v.data() + off, static_cast<std::size_t>(d)), t));
  }
  return Status::ok();
}

inline Status evict_share(PagedKvCache<CpuKvBackend>& cache, int stream, double share, std::mt19937_64& rng) {
  auto live = cache.table().live_slot_list(stream);
  std::shuffle(live.begin(), live.end(), rng);
  live.resize(static_cast<std::size_t>(static_cast<double>(live.size()) * share));
  return cache.evict(stream, live);
}

}  // namespace detail

inline FlushScenario build_flush_scenario(const ScenarioSpec& spec, std::mt19937_64& rng) {
  FlushScenario sc;
  CacheConfig& cfg = sc.config;
  const int g = spec.group_size;
  const int d = spec.head_dim;
  const int bs = spec.block_size;
  cfg.num_streams = spec.streams;
  cfg.head_dim = d;
  cfg.group_size = g;
  cfg.block_size = bs;
  cfg.precision = spec.map;
  // Generous pools: every stream may hold all its tokens in one precision, plus partly filled
  // blocks of each thought type.
  const int per_stream = (2 * spec.max_warmup_tokens + 4 * g) / bs + 8;
  for (Precision p : kAllPrecisions) {
    cfg.pool_blocks[static_cast<std::size_t>(p)] = spec.map.uses(p) ? spec.streams * per_stream : 0;
  }
  sc.cache = std::make_unique<PagedKvCache<CpuKvBackend>>(cfg);
  PagedKvCache<CpuKvBackend>& cache = *sc.cache;
  auto fail = [&](const std::string& where, const Status& s) {
    sc.error = where + ": " + s.to_string();
    return std::move(sc);  // sc is captured by reference: move it out explicitly
  };

  // Warm-up: most streams fill, evict a large share, refill (reusing holes), evict a little.
  // About one stream in eight stays fresh: its flush fixes its s2.
  std::uniform_int_distribution<int> ntok(0, spec.max_warmup_tokens);
  for (int s = 0; s < spec.streams; ++s) {
    if (rng() % 8 == 0) continue;
    if (Status st = detail::append_tokens(cache, s, ntok(rng), rng); !st.is_ok()) return fail("warm-up", st);
    if (Status st = detail::evict_share(cache, s, 0.3 + 0.4 * std::uniform_real_distribution<double>(0, 1)(rng), rng);
        !st.is_ok())
      return fail("evict", st);
    if (Status st = detail::append_tokens(cache, s, ntok(rng) / 2, rng); !st.is_ok()) return fail("refill", st);
    // Complete the open group, then leave holes for the flush to reuse.
    const int staged = cache.table().staged_count(s);
    if (Status st = detail::append_tokens(cache, s, (g - staged) % g, rng); !st.is_ok()) return fail("align", st);
    if (Status st = detail::evict_share(cache, s, 0.5 * std::uniform_real_distribution<double>(0, 1)(rng), rng);
        !st.is_ok())
      return fail("evict", st);
  }

  // The flush: a random subset of streams gets a full group (g - 1 tokens appended now, the last
  // one appended after the snapshot, which commits); the others keep 0..g-1 staged tokens.
  const auto S = static_cast<std::size_t>(spec.streams);
  const std::size_t row_elems = static_cast<std::size_t>(g) * static_cast<std::size_t>(d);
  sc.staging.assign(S * 2 * row_elems, 0x7FC0);
  std::vector<int> order(S);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  const auto n_flush = std::max<std::size_t>(1, static_cast<std::size_t>(static_cast<double>(S) * spec.flush_share));
  struct Pending {
    int stream;
    ThoughtType thought;
    GroupKind kind;
    std::vector<float> k, v;
  };
  std::vector<Pending> pending;
  for (std::size_t n = 0; n < S; ++n) {
    const int s = order[n];
    if (n >= n_flush) {
      sc.unflushed_streams.push_back(s);
      if (Status st = detail::append_tokens(cache, s, static_cast<int>(rng() % static_cast<unsigned>(g)), rng);
          !st.is_ok())
        return fail("partial", st);
      continue;
    }
    Pending pd;
    pd.stream = s;
    pd.thought = detail::random_thought(rng);
    pd.kind = static_cast<GroupKind>(rng() % static_cast<unsigned>(GroupKind::kCount));
    make_group(pd.kind, g, d, rng, pd.k, pd.v);
    for (int i = 0; i + 1 < g; ++i) {
      const auto off = static_cast<std::size_t>(i) * static_cast<std::size_t>(d);
      if (Status st = cache.append(s, std::span<const float>(pd.k.data() + off, static_cast<std::size_t>(d)),
                                   std::span<const float>(pd.v.data() + off, static_cast<std::size_t>(d)), pd.thought);
          !st.is_ok()) {
        return fail("stage", st);
      }
    }
    // The device staging of the stream: what CpuKvBackend::stage stores (encode_bf16).
    for (std::size_t e = 0; e < row_elems; ++e) {
      sc.staging[(static_cast<std::size_t>(s) * 2 + 0) * row_elems + e] = encode_bf16(pd.k[e]);
      sc.staging[(static_cast<std::size_t>(s) * 2 + 1) * row_elems + e] = encode_bf16(pd.v[e]);
    }
    // Cross-check against the CPU backend's own staging rows 0..g-2.
    std::vector<float> kr(static_cast<std::size_t>(d)), vr(kr.size());
    for (int i = 0; i + 1 < g; ++i) {
      if (Status st = cache.backend().read_staged(s, i, kr.data(), vr.data()); !st.is_ok())
        return fail("read_staged", st);
      for (int c = 0; c < d; ++c) {
        const std::size_t e = static_cast<std::size_t>(i) * static_cast<std::size_t>(d) + static_cast<std::size_t>(c);
        if (encode_bf16(kr[static_cast<std::size_t>(c)]) !=
                sc.staging[(static_cast<std::size_t>(s) * 2 + 0) * row_elems + e] ||
            encode_bf16(vr[static_cast<std::size_t>(c)]) !=
                sc.staging[(static_cast<std::size_t>(s) * 2 + 1) * row_elems + e]) {
          sc.error = "staging row " + std::to_string(i) + " of stream " + std::to_string(s) +
                     " differs from the CPU backend's";
          return sc;
        }
      }
    }
    pending.push_back(std::move(pd));
  }

  sc.before = CacheBytes::of(cache);
  const std::int64_t sat0 = cache.backend().stats().scale_saturations;
  std::shuffle(pending.begin(), pending.end(), rng);  // commit order: not stream order
  for (const Pending& pd : pending) {
    CommitPlan plan;
    if (Status st = cache.table().plan_commit(pd.stream, pd.thought, plan); !st.is_ok()) return fail("plan_commit", st);
    const Precision p = plan.precision;
    if (p != Precision::kBf16) {
      for (int kv = 0; kv < 2; ++kv) { sc.unset_s2 += cache.backend().stream_scale(pd.stream, kv, p) == 0.0f; }
    }
    const auto off = static_cast<std::size_t>(g - 1) * static_cast<std::size_t>(d);
    if (Status st = cache.append(pd.stream, std::span<const float>(pd.k.data() + off, static_cast<std::size_t>(d)),
                                 std::span<const float>(pd.v.data() + off, static_cast<std::size_t>(d)), pd.thought);
        !st.is_ok()) {
      return fail("commit", st);
    }
    // The append committed exactly this plan (plan_commit is a pure function of the table).
    if (cache.table().staged_count(pd.stream) != 0) {
      sc.error = "stream " + std::to_string(pd.stream) + " did not commit";
      return sc;
    }
    for (const SlotRef& r : plan.slots) {
      if (!cache.table().is_live(r) || cache.table().slot_record(r) != plan.record ||
          cache.table().block_owner(r.block) != pd.stream) {
        sc.error = "stream " + std::to_string(pd.stream) + ": the commit did not follow the plan";
        return sc;
      }
    }
    sc.reused_slots += plan.reused_slots;
    bool multi = false;
    for (const SlotRef& r : plan.slots) multi = multi || r.block != plan.slots.front().block;
    sc.multi_block_jobs += multi;
    sc.jobs.add(plan, bs);
    sc.kinds.push_back(pd.kind);
    sc.plans.push_back(std::move(plan));
  }
  sc.saturations = cache.backend().stats().scale_saturations - sat0;
  sc.after = CacheBytes::of(cache);
  return sc;
}

/// Checks that every byte the CPU commits changed lies in the plans' destination ranges (so the
/// ranges computed above, which the GPU test poisons, are right). Returns the count of changed
/// bytes outside them.
inline std::size_t bytes_changed_outside(const FlushScenario& sc) {
  std::array<std::vector<char>, kNumPrecisions> in_page;
  for (int p = 0; p < kNumPrecisions; ++p)
    in_page[static_cast<std::size_t>(p)].assign(sc.before.pages[static_cast<std::size_t>(p)].size(), 0);
  std::vector<char> in_rec(sc.before.records.size(), 0);
  for (const CommitPlan& plan : sc.plans) {
    for (const ByteRange& r : destination_ranges(sc.config, plan)) {
      std::vector<char>& m = r.pool < 0 ? in_rec : in_page[static_cast<std::size_t>(r.pool)];
      for (std::size_t i = 0; i < r.size; ++i) m.at(r.offset + i) = 1;
    }
  }
  std::size_t outside = 0;
  for (int p = 0; p < kNumPrecisions; ++p) {
    const auto& a = sc.before.pages[static_cast<std::size_t>(p)];
    const auto& b = sc.after.pages[static_cast<std::size_t>(p)];
    for (std::size_t i = 0; i < a.size(); ++i) outside += a[i] != b[i] && !in_page[static_cast<std::size_t>(p)][i];
  }
  for (std::size_t i = 0; i < sc.before.records.size(); ++i) {
    outside += sc.before.records[i] != sc.after.records[i] && !in_rec[i];
  }
  return outside;
}

/// `before` with every destination byte of the flush set to `poison` (what the device gets).
inline CacheBytes poisoned_before(const FlushScenario& sc, std::uint8_t poison) {
  CacheBytes b = sc.before;
  for (const CommitPlan& plan : sc.plans) {
    for (const ByteRange& r : destination_ranges(sc.config, plan)) {
      std::vector<std::uint8_t>& m = r.pool < 0 ? b.records : b.pages[static_cast<std::size_t>(r.pool)];
      std::fill_n(m.begin() + static_cast<std::ptrdiff_t>(r.offset), r.size, poison);
    }
  }
  return b;
}

/// Compares `got` with the expected bytes; returns the number of differing bytes (pages, records)
/// and differing s2 bit patterns, and describes the first few in `report`.
inline std::size_t compare_bytes(const FlushScenario& sc, const CacheBytes& want, const CacheBytes& got,
                                 std::string& report) {
  std::size_t bad = 0;
  const CacheConfig& cfg = sc.config;
  const std::size_t d = static_cast<std::size_t>(cfg.head_dim);
  auto note = [&](const std::string& s) {
    if (bad <= 12) report += s + "\n";
  };
  for (int p = 0; p < kNumPrecisions; ++p) {
    const auto& w = want.pages[static_cast<std::size_t>(p)];
    const auto& h = got.pages[static_cast<std::size_t>(p)];
    if (w.size() != h.size()) {
      ++bad;
      note("pool " + std::to_string(p) + ": sizes differ");
      continue;
    }
    const int bits = p == 0 ? 16 : p == 1 ? 8 : p == 2 ? 4 : 2;
    const std::size_t rb = d * static_cast<std::size_t>(bits) / 8;
    const std::size_t vsb = p == 0 ? 0 : d / static_cast<std::size_t>(cfg.group_size);
    const std::size_t bs = static_cast<std::size_t>(cfg.block_size);
    const std::size_t page = bs * (2 * rb + vsb);
    for (std::size_t i = 0; i < w.size(); ++i) {
      if (w[i] == h[i]) continue;
      ++bad;
      const std::size_t in = i % page;
      std::string where;
      if (in < bs * rb) {
        where = "K row of slot " + std::to_string(in / rb) + ", byte " + std::to_string(in % rb);
      } else if (in < 2 * bs * rb) {
        where =
            "V row of slot " + std::to_string((in - bs * rb) / rb) + ", byte " + std::to_string((in - bs * rb) % rb);
      } else {
        where = "value scale " + std::to_string((in - 2 * bs * rb) % vsb) + " of slot " +
                std::to_string((in - 2 * bs * rb) / vsb);
      }
      char buf[64];
      std::snprintf(buf, sizeof buf, ": want 0x%02X got 0x%02X", w[i], h[i]);
      note("pool " + std::string(to_string(static_cast<Precision>(p))) + " page " + std::to_string(i / page) + " " +
           where + buf);
    }
  }
  for (std::size_t i = 0; i < want.records.size() && i < got.records.size(); ++i) {
    if (want.records[i] == got.records[i]) continue;
    ++bad;
    char buf[64];
    std::snprintf(buf, sizeof buf, ": want 0x%02X got 0x%02X", want.records[i], got.records[i]);
    note("record " + std::to_string(i / d) + " channel " + std::to_string(i % d) + buf);
  }
  for (std::size_t i = 0; i < want.s2.size() && i < got.s2.size(); ++i) {
    std::uint32_t a = 0, b = 0;
    std::memcpy(&a, &want.s2[i], 4);
    std::memcpy(&b, &got.s2[i], 4);
    if (a == b) continue;
    ++bad;
    char buf[96];
    std::snprintf(buf, sizeof buf, "s2 of stream %zu %s precision %zu: want %a got %a", i / (2 * kNumPrecisions),
                  (i / kNumPrecisions) % 2 ? "V" : "K", i % kNumPrecisions, static_cast<double>(want.s2[i]),
                  static_cast<double>(got.s2[i]));
    note(buf);
  }
  if (want.records.size() != got.records.size() || want.s2.size() != got.s2.size()) {
    ++bad;
    note("record or s2 array sizes differ");
  }
  return bad;
}

}  // namespace thinkv::test
