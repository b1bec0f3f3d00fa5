#pragma once
/// \file test_util.hpp
/// Shared helpers of the cache unit tests:
///  - seeded randomness (a fresh seed per run, printed; THINKV_TEST_SEED pins it);
///  - Diff, a cheap collector of mismatches (one Catch assertion per check, not one per value);
///  - CtModel, an independent model of the CT cache: which (stream, position) each slot holds, the
///    placement rule of docs/design.md, block/record ownership, and the values each stored token
///    must dequantize to (quantized by the model itself, group by group, with the format
///    functions of thinkv/formats as the format oracle; no layout, packing or record code of the
///    library is used);
///  - check_table / check_cache: compare a BlockTable / PagedKvCache with the model;
///  - snapshot_table / snapshot_cache: every observable piece of state, for "an error changes
///    nothing" tests.

#include <catch2/catch.hpp>

#include <algorithm>
#include <functional>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "thinkv/thinkv.hpp"

namespace tt {

using namespace thinkv;

// ---- seeds ------------------------------------------------------------------------------------

/// The run's base seed: THINKV_TEST_SEED when set, otherwise fresh from std::random_device.
/// Printed once to stderr so that a failing run can be reproduced.
inline std::uint64_t base_seed() {
  static const std::uint64_t seed = [] {
    std::uint64_t s = 0;
    if (const char* e = std::getenv("THINKV_TEST_SEED"); e != nullptr && *e != '\0') {
      s = std::strtoull(e, nullptr, 0);
    } else {
      std::random_device rd;
      s = (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
    }
    std::fprintf(stderr, "THINKV_TEST_SEED=%llu\n", static_cast<unsigned long long>(s));
    return s;
  }();
  return seed;
}

/// THINKV_TEST_SMALL (bench/run_gpu_suite.sh sets it under compute-sanitizer): a test shrinks its
/// runs so the sanitizers finish.
inline bool small_run() { return std::getenv("THINKV_TEST_SMALL") != nullptr; }

/// A generator for one test case: the base seed mixed with the test's name (so test cases draw
/// independent streams, and each stays reproducible when run alone).
inline std::mt19937_64 make_rng(std::string_view name) {
  std::uint64_t h = 1469598103934665603ull;
  for (char c : name) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return std::mt19937_64(base_seed() ^ h);
}

/// Declares `rng` for the current test case and attaches the seed to every failure message.
#define TT_SEEDED_RNG()                                                                       \
  [[maybe_unused]] auto rng = ::tt::make_rng(Catch::getResultCapture().getCurrentTestName()); \
  INFO("rerun with THINKV_TEST_SEED=" << ::tt::base_seed())

inline int uniform_int(std::mt19937_64& rng, int lo, int hi) {  // [lo, hi]
  return std::uniform_int_distribution<int>(lo, hi)(rng);
}
inline double uniform01(std::mt19937_64& rng) { return std::uniform_real_distribution<double>(0.0, 1.0)(rng); }
inline bool chance(std::mt19937_64& rng, double p) { return uniform01(rng) < p; }

/// A random K or V row: normal values times a log-uniform magnitude in [2^-3, 2^3] (or the given
/// magnitude), with a few outlier channels (x8) unless outliers is false; never all zero.
inline std::vector<float> random_row(std::mt19937_64& rng, int d, double magnitude = 0.0, bool outliers = true) {
  std::normal_distribution<double> n01(0.0, 1.0);
  if (magnitude <= 0.0) magnitude = std::exp2(std::uniform_real_distribution<double>(-3, 3)(rng));
  std::vector<float> x(static_cast<std::size_t>(d));
  bool nonzero = false;
  for (auto& v : x) {
    double a = n01(rng) * magnitude;
    if (outliers && chance(rng, 0.05)) a *= 8.0;
    v = static_cast<float>(a);
    nonzero = nonzero || v != 0.0f;
  }
  if (!nonzero) x[0] = 1.0f;
  return x;
}

// ---- an independent group quantizer (docs/formats.md section 4) ------------------------------
// The CT model below quantizes with this, not with the library's quantize_group /
// choose_stream_scale / dequantize, so a change to the library's group rules (the scale bump, the
// ternary threshold, the stream scale) makes the model disagree. Only the element codecs
// (encode/decode of E4M3 and E2M1, checked bit for bit against NVIDIA's cuda_fp8.h/cuda_fp4.h in
// tests/oracle/) are shared.

/// Q_P: the largest element magnitude in units of the group scale.
inline float model_qmax(Precision p) {
  switch (p) {
    case Precision::kFp8E4M3: return 448.0f;
    case Precision::kNvfp4: return 6.0f;
    case Precision::kTernary: return 1.0f;
    default: return 0.0f;
  }
}

/// The stream scale by exhaustive search: the power of two 2^e (e in -126..127) for which
/// d = amax / (Q * 2^e), in float, lies in [8, 16); 1 for amax 0, subnormal, NaN or Inf.
inline float model_stream_scale(Precision p, float amax) {
  const float q = model_qmax(p);
  if (!(amax >= std::ldexp(1.0f, -126)) || !std::isfinite(amax)) return 1.0f;
  for (int e = -126; e <= 127; ++e) {
    const float d = amax / (q * std::ldexp(1.0f, e));
    if (d >= 8.0f && d < 16.0f) return std::ldexp(1.0f, e);
  }
  return std::ldexp(1.0f, std::clamp(static_cast<int>(std::floor(std::log2(amax / q))) - 3, -126, 127));
}

/// One group x[0..n) at stream scale s2: the dequantized values (decode(code) * (scale * s2)).
inline std::vector<float> model_quantize_group(Precision p, const std::vector<float>& x, float s2) {
  const std::size_t n = x.size();
  std::vector<float> out(n, 0.0f);
  float amax = 0.0f;
  for (float v : x) amax = std::max(amax, std::fabs(v));
  if (amax == 0.0f) return out;  // scale code 0, codes 0
  if (p == Precision::kTernary) {
    std::vector<float> mag(n);
    for (std::size_t i = 0; i < n; ++i) mag[i] = std::fabs(x[i]);
    std::sort(mag.begin(), mag.end(), std::greater<float>());
    float run = 0.0f, best_sum = 0.0f, best_obj = -1.0f;
    std::size_t best_k = 1;
    for (std::size_t k = 1; k <= n; ++k) {
      run += mag[k - 1];
      const float obj = run * run / static_cast<float>(k);
      if (obj > best_obj) {
        best_obj = obj;
        best_sum = run;
        best_k = k;
      }
    }
    const float alpha = best_sum / static_cast<float>(best_k);
    const float a = decode_e4m3(encode_e4m3(alpha / s2)) * s2;
    for (std::size_t i = 0; i < n; ++i) {
      if (a > 0.0f && std::fabs(x[i]) > 0.5f * a) out[i] = x[i] > 0.0f ? a : -a;
    }
    return out;
  }
  const float q = model_qmax(p);
  std::uint8_t sc = encode_e4m3(amax / (q * s2));
  if (decode_e4m3(sc) * s2 * q < amax && sc < 0x7E) ++sc;  // an E4M3 ceiling
  const float scale = decode_e4m3(sc) * s2;
  for (std::size_t i = 0; i < n; ++i) {
    const float e =
        p == Precision::kFp8E4M3 ? decode_e4m3(encode_e4m3(x[i] / scale)) : decode_e2m1(encode_e2m1(x[i] / scale));
    out[i] = e * scale;
  }
  return out;
}

// ---- small independent helpers -------------------------------------------------------------

inline std::uint32_t fbits(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
inline float from_bits(std::uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}
/// Round a finite float to BF16 (nearest, ties to even), written here independently of formats.
inline float bf16_round(float x) {
  std::uint32_t u = fbits(x);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return from_bits(u & 0xFFFF0000u);
}
inline bool same_bits(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}
inline int bits_of_precision(Precision p) {  // independent of types.hpp's bits_of
  switch (p) {
    case Precision::kBf16: return 16;
    case Precision::kFp8E4M3: return 8;
    case Precision::kNvfp4: return 4;
    case Precision::kTernary: return 2;
  }
  return -1;
}

/// Collects mismatches; one REQUIRE per check instead of one per compared value.
struct Diff {
  std::string msg;
  int count = 0;
  template <class... A>
  void fail(const A&... a) {
    if (count++ < 10) {
      std::ostringstream os;
      (os << ... << a);
      msg += os.str();
      msg += '\n';
    }
  }
  [[nodiscard]] bool ok() const { return count == 0; }
  void merge(const Diff& o) {
    if (count < 10) msg += o.msg;
    count += o.count;
  }
};
#define TT_REQUIRE_OK_DIFF(diff_expr)     \
  do {                                    \
    const ::tt::Diff tt_d_ = (diff_expr); \
    INFO(tt_d_.msg);                      \
    REQUIRE(tt_d_.count == 0);            \
  } while (0)

// ---- the model ------------------------------------------------------------------------------

struct MSlot {
  std::int32_t pos = -1;
  std::uint32_t seg = 0;
  int group = -1;
  bool evicted = false;
  std::vector<float> k, v;  // expected dequantized values (empty in data-less tests)
};
struct MBlock {
  ThoughtType thought{};
  std::uint32_t real = kNoBlock;
  int fill = 0;
  int live = 0;
  std::vector<MSlot> slots;
};
struct MStaged {
  std::vector<float> k, v;  // BF16-rounded
  std::uint32_t seg = 0;
  std::int32_t pos = 0;
};
struct MStream {
  std::vector<MBlock> blocks;  // allocation order
  std::vector<MStaged> staged;
  ThoughtType staged_thought{};
  std::int32_t next_pos = 0;
  std::array<float, 4> s2k{}, s2v{};
};
struct MGroup {
  int stream = 0;
  Precision p{};
  int live = 0;
  std::uint32_t record = kNoRecord;
};
/// One destination: block index into the stream's block list (>= its size: the (index - size)-th
/// fresh block), slot inside the block.
struct MPlacement {
  int block = 0;
  int slot = 0;
  bool reused = false;
};
struct MStats {
  std::int64_t commits = 0, slots_written = 0, slots_reused = 0, slots_evicted = 0, blocks_allocated = 0,
               blocks_freed = 0, records_allocated = 0, records_freed = 0;
};

/// Model of the CT cache. Placement follows docs/design.md ("Commit placement"); fresh block ids
/// are learned from the implementation (any free block of the right pool is accepted, and
/// checked to be one).
class CtModel {
 public:
  explicit CtModel(const CacheConfig& c)
      : cfg(c), D(c.head_dim), g(c.group_size), bs(c.block_size), streams(static_cast<std::size_t>(c.num_streams)) {}

  CacheConfig cfg;
  int D, g, bs;
  std::vector<MStream> streams;
  std::map<int, MGroup> groups;
  int next_group = 0;
  MStats st;
  /// When true (design.md, "Commit placement": lowest free id first), a fresh block must be the
  /// lowest free id of its pool; when false any free block of the pool is accepted.
  bool require_lowest_free_id = true;

  MStream& S(int s) { return streams[static_cast<std::size_t>(s)]; }
  const MStream& S(int s) const { return streams[static_cast<std::size_t>(s)]; }

  [[nodiscard]] Precision prec(ThoughtType t) const { return cfg.precision.precision_of(t); }
  [[nodiscard]] std::uint32_t pool_base(Precision p) const {
    std::uint32_t b = 0;
    for (int q = 0; q < static_cast<int>(p); ++q) b += static_cast<std::uint32_t>(cfg.pool_blocks[q]);
    return b;
  }
  [[nodiscard]] std::uint32_t pool_count(Precision p) const {
    return static_cast<std::uint32_t>(cfg.pool_blocks[static_cast<int>(p)]);
  }
  [[nodiscard]] std::uint32_t total_blocks() const {
    std::uint32_t n = 0;
    for (int v : cfg.pool_blocks) n += static_cast<std::uint32_t>(v);
    return n;
  }
  [[nodiscard]] bool in_pool(std::uint32_t b, Precision p) const {
    return b >= pool_base(p) && b < pool_base(p) + pool_count(p);
  }
  [[nodiscard]] std::int64_t record_capacity() const {
    if (cfg.record_capacity > 0) return cfg.record_capacity;
    std::int64_t n = 0;
    for (Precision p : kAllPrecisions) {
      if (p != Precision::kBf16) n += std::int64_t{cfg.pool_blocks[static_cast<int>(p)]} * bs;
    }
    return n;
  }
  [[nodiscard]] int held_blocks(Precision p) const {
    int n = 0;
    for (const auto& s : streams)
      for (const auto& b : s.blocks) n += prec(b.thought) == p;
    return n;
  }
  [[nodiscard]] int held_records() const {
    int n = 0;
    for (const auto& [id, gr] : groups) n += gr.record != kNoRecord;
    return n;
  }
  [[nodiscard]] bool block_held(std::uint32_t real) const {
    for (const auto& s : streams)
      for (const auto& b : s.blocks)
        if (b.real == real) return true;
    return false;
  }
  [[nodiscard]] std::uint32_t lowest_free(Precision p) const {
    for (std::uint32_t b = pool_base(p); b < pool_base(p) + pool_count(p); ++b)
      if (!block_held(b)) return b;
    return kNoBlock;
  }

  /// The g destinations of the stream's next commit of thought t (design.md order).
  [[nodiscard]] std::vector<MPlacement> plan(int s, ThoughtType t, int* new_blocks = nullptr) const {
    const MStream& m = S(s);
    std::vector<MPlacement> out;
    for (int b = 0; b < static_cast<int>(m.blocks.size()); ++b) {
      if (m.blocks[b].thought != t) continue;
      for (int i = 0; i < m.blocks[b].fill && static_cast<int>(out.size()) < g; ++i)
        if (m.blocks[b].slots[i].evicted) out.push_back({b, i, true});
    }
    for (int b = 0; b < static_cast<int>(m.blocks.size()); ++b) {
      if (m.blocks[b].thought != t) continue;
      for (int i = m.blocks[b].fill; i < bs && static_cast<int>(out.size()) < g; ++i) out.push_back({b, i, false});
    }
    int fresh = 0;
    while (static_cast<int>(out.size()) < g) {
      for (int i = 0; i < bs && static_cast<int>(out.size()) < g; ++i)
        out.push_back({static_cast<int>(m.blocks.size()) + fresh, i, false});
      ++fresh;
    }
    if (new_blocks) *new_blocks = fresh;
    return out;
  }
  /// kOk when the stream's next commit of t fits the pools, else kPoolExhausted.
  [[nodiscard]] StatusCode fit(int s, ThoughtType t) const {
    int fresh = 0;
    (void)plan(s, t, &fresh);
    const Precision p = prec(t);
    if (fresh > static_cast<int>(pool_count(p)) - held_blocks(p)) return StatusCode::kPoolExhausted;
    if (p != Precision::kBf16 && held_records() >= record_capacity()) return StatusCode::kPoolExhausted;
    return StatusCode::kOk;
  }

  void stage(int s, ThoughtType t, std::uint32_t seg, std::span<const float> k = {}, std::span<const float> v = {}) {
    MStream& m = S(s);
    MStaged x;
    for (float f : k) x.k.push_back(bf16_round(f));
    for (float f : v) x.v.push_back(bf16_round(f));
    x.seg = seg;
    x.pos = m.next_pos++;
    m.staged_thought = t;
    m.staged.push_back(std::move(x));
  }
  void unstage(int s) {
    S(s).staged.pop_back();
    --S(s).next_pos;
  }

  /// The model's own group quantization of the staged group: fills k/v of `out` (g tokens).
  void quantize_staged(int s, Precision p, std::vector<std::vector<float>>& ko, std::vector<std::vector<float>>& vo) {
    MStream& m = S(s);
    ko.assign(static_cast<std::size_t>(g), {});
    vo.assign(static_cast<std::size_t>(g), {});
    if (m.staged[0].k.empty()) return;
    if (p == Precision::kBf16) {
      for (int i = 0; i < g; ++i) {
        ko[i] = m.staged[i].k;
        vo[i] = m.staged[i].v;
      }
      return;
    }
    const int pi = static_cast<int>(p);
    if (m.s2k[pi] == 0.0f || m.s2v[pi] == 0.0f) {
      float ak = 0.0f, av = 0.0f;
      for (const auto& x : m.staged)
        for (int c = 0; c < D; ++c) {
          ak = std::max(ak, std::fabs(x.k[c]));
          av = std::max(av, std::fabs(x.v[c]));
        }
      // s2 is fixed by the stream's first nonzero group of the precision (an all-zero group
      // quantizes to zeros whatever s2 is, with s2 = 1 standing in).
      if (m.s2k[pi] == 0.0f && ak > 0.0f) m.s2k[pi] = model_stream_scale(p, ak);
      if (m.s2v[pi] == 0.0f && av > 0.0f) m.s2v[pi] = model_stream_scale(p, av);
    }
    const float s2k = m.s2k[pi] > 0.0f ? m.s2k[pi] : 1.0f, s2v = m.s2v[pi] > 0.0f ? m.s2v[pi] : 1.0f;
    for (int i = 0; i < g; ++i) {
      ko[i].resize(static_cast<std::size_t>(D));
      vo[i].resize(static_cast<std::size_t>(D));
    }
    std::vector<float> col(static_cast<std::size_t>(g));
    for (int c = 0; c < D; ++c) {  // keys: per channel over the g tokens
      for (int i = 0; i < g; ++i) col[i] = m.staged[i].k[c];
      const std::vector<float> q = model_quantize_group(p, col, s2k);
      for (int i = 0; i < g; ++i) ko[i][c] = q[static_cast<std::size_t>(i)];
    }
    for (int i = 0; i < g; ++i) {  // values: per token, g consecutive channels
      for (int j = 0; j < D / g; ++j) {
        const std::vector<float> grp(m.staged[i].v.begin() + j * g, m.staged[i].v.begin() + (j + 1) * g);
        const std::vector<float> q = model_quantize_group(p, grp, s2v);
        for (int t = 0; t < g; ++t) vo[i][j * g + t] = q[static_cast<std::size_t>(t)];
      }
    }
  }

  /// Commits the staged group to where the implementation put it (`real` slots, `record`),
  /// checking that this agrees with the model's placement. Appends mismatches to `d`.
  void commit(int s, std::span<const SlotRef> real, std::uint32_t record, Diff& d) {
    MStream& m = S(s);
    const ThoughtType t = m.staged_thought;
    const Precision p = prec(t);
    if (static_cast<int>(m.staged.size()) != g) d.fail("model: commit without a full group");
    if (static_cast<int>(real.size()) != g) {
      d.fail("commit of stream ", s, ": ", real.size(), " slots, expected ", g);
      return;
    }
    int fresh = 0;
    const auto pl = plan(s, t, &fresh);
    const int old_nb = static_cast<int>(m.blocks.size());
    for (int f = 0; f < fresh; ++f) {
      MBlock nb;
      nb.thought = t;
      nb.slots.resize(static_cast<std::size_t>(bs));
      m.blocks.push_back(std::move(nb));
    }
    for (int i = 0; i < g; ++i) {
      const MPlacement& x = pl[i];
      MBlock& b = m.blocks[x.block];
      if (x.block >= old_nb && b.real == kNoBlock) {  // first slot of a fresh block: learn its id
        const std::uint32_t id = real[i].block;
        if (!in_pool(id, p)) d.fail("stream ", s, ": fresh block ", id, " is not in the ", to_string(p), " pool");
        if (block_held(id)) d.fail("stream ", s, ": fresh block ", id, " is already held");
        if (require_lowest_free_id && id != lowest_free(p))
          d.fail("stream ", s, ": fresh block ", id, " is not the lowest free id ", lowest_free(p), " of the pool");
        b.real = id;
      }
      if (real[i].block != b.real || static_cast<int>(real[i].slot) != x.slot) {
        d.fail("stream ", s, " token ", i, " of the group went to {", real[i].block, ",", real[i].slot,
               "}, the model expects {", b.real, ",", x.slot, "}", x.reused ? " (a hole)" : "");
      }
    }
    std::vector<std::vector<float>> ko, vo;
    quantize_staged(s, p, ko, vo);
    const int gid = next_group++;
    MGroup gr;
    gr.stream = s;
    gr.p = p;
    gr.live = g;
    if (p != Precision::kBf16) {
      if (record == kNoRecord) d.fail("stream ", s, ": quantized group got no key-scale record");
      if (record != kNoRecord && record >= record_capacity()) d.fail("record ", record, " out of range");
      for (const auto& [id, o] : groups)
        if (o.record == record && record != kNoRecord) d.fail("record ", record, " is already held by a live group");
      gr.record = record;
      ++st.records_allocated;
    } else if (record != kNoRecord) {
      d.fail("stream ", s, ": BF16 group got record ", record);
    }
    groups[gid] = gr;
    int reused = 0;
    for (int i = 0; i < g; ++i) {
      const MPlacement& x = pl[i];
      MBlock& b = m.blocks[x.block];
      MSlot& sl = b.slots[x.slot];
      if (x.reused) {
        ++reused;
        sl.evicted = false;
      } else {
        b.fill = std::max(b.fill, x.slot + 1);
      }
      sl.pos = m.staged[i].pos;
      sl.seg = m.staged[i].seg;
      sl.group = gid;
      sl.k = std::move(ko[i]);
      sl.v = std::move(vo[i]);
      ++b.live;
    }
    m.staged.clear();
    ++st.commits;
    st.slots_written += g;
    st.slots_reused += reused;
    st.blocks_allocated += fresh;
  }

  MSlot* find(int s, SlotRef r, MBlock** blk = nullptr) {
    for (auto& b : S(s).blocks)
      if (b.real == r.block && static_cast<int>(r.slot) < bs) {
        if (blk) *blk = &b;
        return &b.slots[r.slot];
      }
    return nullptr;
  }
  [[nodiscard]] bool is_live(int s, SlotRef r) const {
    if (s < 0 || s >= cfg.num_streams) return false;
    for (const auto& b : S(s).blocks)
      if (b.real == r.block) return static_cast<int>(r.slot) < b.fill && !b.slots[r.slot].evicted;
    return false;
  }

  /// Evicts a batch of live slots of stream s (the caller checked validity).
  void evict(int s, std::span<const SlotRef> slots) {
    MStream& m = S(s);
    for (SlotRef r : slots) {
      MBlock* b = nullptr;
      MSlot* sl = find(s, r, &b);
      sl->evicted = true;
      --b->live;
      ++st.slots_evicted;
      MGroup& gr = groups.at(sl->group);
      if (--gr.live == 0) {
        if (gr.record != kNoRecord) ++st.records_freed;
        groups.erase(sl->group);
      }
    }
    for (std::size_t i = 0; i < m.blocks.size();) {
      if (m.blocks[i].live == 0) {
        m.blocks.erase(m.blocks.begin() + static_cast<std::ptrdiff_t>(i));
        ++st.blocks_freed;
      } else {
        ++i;
      }
    }
  }
  void reset(int s) {
    MStream& m = S(s);
    st.blocks_freed += static_cast<std::int64_t>(m.blocks.size());
    for (auto it = groups.begin(); it != groups.end();) {
      if (it->second.stream == s) {
        if (it->second.record != kNoRecord) ++st.records_freed;
        it = groups.erase(it);
      } else {
        ++it;
      }
    }
    m = MStream{};
  }

  [[nodiscard]] std::vector<SlotRef> live_slots(int s) const {
    std::vector<SlotRef> out;
    for (const auto& b : S(s).blocks)
      for (int i = 0; i < b.fill; ++i)
        if (!b.slots[i].evicted) out.push_back({b.real, static_cast<std::uint32_t>(i)});
    return out;
  }
  [[nodiscard]] std::int64_t live_count(int s) const {
    std::int64_t n = 0;
    for (const auto& b : S(s).blocks) n += b.live;
    return n;
  }
  [[nodiscard]] std::int64_t hole_count(int s) const {
    std::int64_t n = 0;
    for (const auto& b : S(s).blocks)
      for (int i = 0; i < b.fill; ++i) n += b.slots[i].evicted;
    return n;
  }
  [[nodiscard]] std::int64_t records_of(int s) const {
    std::int64_t n = 0;
    for (const auto& [id, gr] : groups) n += gr.stream == s && gr.record != kNoRecord;
    return n;
  }

  /// The stream's memory as docs/design.md's table defines it, from the model's own state.
  [[nodiscard]] MemoryUsage memory(int s) const {
    const MStream& m = S(s);
    MemoryUsage u;
    u.staged_tokens = static_cast<std::int64_t>(m.staged.size());
    u.live_tokens = live_count(s) + u.staged_tokens;
    u.hole_slots = hole_count(s);
    u.blocks_held = static_cast<std::int64_t>(m.blocks.size());
    u.records_held = records_of(s);
    for (const auto& b : m.blocks) {
      const Precision p = prec(b.thought);
      const std::int64_t row = (std::int64_t{D} * bits_of_precision(p) + 7) / 8;
      const std::int64_t vsc = p == Precision::kBf16 ? 0 : D / g;
      u.page_bytes += std::int64_t{bs} * (2 * row + vsc);
    }
    u.metadata_bytes = u.blocks_held * (16 + 8 * ((bs + 63) / 64) + 12 * std::int64_t{bs} + 4) + 40;
    u.scale_record_bytes = u.records_held * (D + 8);
    u.staging_bytes = 2 * std::int64_t{g} * D * 2;
    u.fullkv_fp16_bytes = u.live_tokens * 2 * D * 2;
    return u;
  }

  /// K and V ([n, D] each) of every token attention must see: live slots, then staged tokens.
  void attention_tokens(int s, std::vector<float>& k, std::vector<float>& v) const {
    k.clear();
    v.clear();
    for (const auto& b : S(s).blocks)
      for (int i = 0; i < b.fill; ++i)
        if (!b.slots[i].evicted) {
          k.insert(k.end(), b.slots[i].k.begin(), b.slots[i].k.end());
          v.insert(v.end(), b.slots[i].v.begin(), b.slots[i].v.end());
        }
    for (const auto& x : S(s).staged) {
      k.insert(k.end(), x.k.begin(), x.k.end());
      v.insert(v.end(), x.v.begin(), x.v.end());
    }
  }
};

inline std::string describe(const MemoryUsage& m) {
  std::ostringstream os;
  os << "{live " << m.live_tokens << ", staged " << m.staged_tokens << ", holes " << m.hole_slots << ", blocks "
     << m.blocks_held << ", shared " << m.blocks_shared << ", records " << m.records_held << ", pages " << m.page_bytes
     << ", meta " << m.metadata_bytes << ", rec " << m.scale_record_bytes << ", staging " << m.staging_bytes
     << ", fullkv " << m.fullkv_fp16_bytes << "}";
  return os.str();
}

/// Everything a BlockTable shows, compared with the model.
inline Diff check_table(const BlockTable& t, const CtModel& m) {
  Diff d;
  const BlockTableStats& ts = t.stats();
  const MStats& ms = m.st;
  if (ts.commits != ms.commits || ts.slots_written != ms.slots_written || ts.slots_reused != ms.slots_reused ||
      ts.slots_evicted != ms.slots_evicted || ts.blocks_allocated != ms.blocks_allocated ||
      ts.blocks_freed != ms.blocks_freed || ts.records_allocated != ms.records_allocated ||
      ts.records_freed != ms.records_freed) {
    d.fail("stats differ: table commits/written/reused/evicted/balloc/bfree/ralloc/rfree = ", ts.commits, "/",
           ts.slots_written, "/", ts.slots_reused, "/", ts.slots_evicted, "/", ts.blocks_allocated, "/",
           ts.blocks_freed, "/", ts.records_allocated, "/", ts.records_freed, " model ", ms.commits, "/",
           ms.slots_written, "/", ms.slots_reused, "/", ms.slots_evicted, "/", ms.blocks_allocated, "/",
           ms.blocks_freed, "/", ms.records_allocated, "/", ms.records_freed);
  }
  // pools: free + held = capacity
  for (Precision p : kAllPrecisions) {
    const std::size_t want = m.pool_count(p) - static_cast<std::uint32_t>(m.held_blocks(p));
    if (t.free_blocks(p) != want) d.fail("free_blocks(", to_string(p), ") = ", t.free_blocks(p), ", model ", want);
  }
  if (t.record_capacity() != m.record_capacity())
    d.fail("record_capacity ", t.record_capacity(), ", model ", m.record_capacity());
  if (static_cast<std::int64_t>(t.free_records()) != m.record_capacity() - m.held_records())
    d.fail("free_records ", t.free_records(), ", model ", m.record_capacity() - m.held_records());
  // blocks: every held block in exactly one stream's list
  std::map<std::uint32_t, std::pair<int, int>> held;  // real id -> (stream, index)
  for (int s = 0; s < m.cfg.num_streams; ++s) {
    const MStream& ms_ = m.S(s);
    const auto tb = t.blocks(s);
    std::vector<std::uint32_t> want;
    for (const auto& b : ms_.blocks) want.push_back(b.real);
    if (!std::equal(tb.begin(), tb.end(), want.begin(), want.end())) {
      std::ostringstream os;
      for (auto b : tb) os << b << " ";
      os << "| model ";
      for (auto b : want) os << b << " ";
      d.fail("stream ", s, " block list: ", os.str());
    }
    for (int i = 0; i < static_cast<int>(want.size()); ++i) {
      if (!held.emplace(want[i], std::pair{s, i}).second) d.fail("block ", want[i], " held twice");
    }
    if (t.live_slots(s) != m.live_count(s))
      d.fail("stream ", s, " live ", t.live_slots(s), ", model ", m.live_count(s));
    if (t.hole_slots(s) != m.hole_count(s))
      d.fail("stream ", s, " holes ", t.hole_slots(s), ", model ", m.hole_count(s));
    if (t.records_held(s) != m.records_of(s))
      d.fail("stream ", s, " records ", t.records_held(s), ", model ", m.records_of(s));
    if (t.staged_count(s) != static_cast<int>(ms_.staged.size()))
      d.fail("stream ", s, " staged ", t.staged_count(s), ", model ", ms_.staged.size());
    if (!ms_.staged.empty() && t.staged_thought(s) != ms_.staged_thought)
      d.fail("stream ", s, " staged thought ", t.staged_thought(s), ", model ", ms_.staged_thought);
    for (int r = 0; r < static_cast<int>(ms_.staged.size()) && r < t.staged_count(s); ++r) {
      if (t.staged_position(s, r) != ms_.staged[r].pos || t.staged_segment(s, r) != ms_.staged[r].seg)
        d.fail("stream ", s, " staged row ", r, " pos/seg ", t.staged_position(s, r), "/", t.staged_segment(s, r),
               ", model ", ms_.staged[r].pos, "/", ms_.staged[r].seg);
    }
    if (t.next_position(s) != ms_.next_pos)
      d.fail("stream ", s, " next_position ", t.next_position(s), ", model ", ms_.next_pos);
    const auto tl = t.live_slot_list(s);
    const auto ml = m.live_slots(s);
    if (tl != ml) d.fail("stream ", s, " live_slot_list differs (", tl.size(), " vs model ", ml.size(), ")");
  }
  const std::uint32_t total = m.total_blocks();
  if (t.pools().total != total) d.fail("pools().total ", t.pools().total, ", model ", total);
  const int words = (m.bs + 63) / 64;
  for (std::uint32_t b = 0; b < total; ++b) {
    auto it = held.find(b);
    if (it == held.end()) {
      if (t.block_owner(b) != kNoStream || t.block_live(b) != 0 || t.block_fill(b) != 0)
        d.fail("free block ", b, " has owner ", t.block_owner(b), " live ", t.block_live(b), " fill ", t.block_fill(b));
      continue;
    }
    const int s = it->second.first;
    const MBlock& mb = m.S(s).blocks[it->second.second];
    const Precision p = m.prec(mb.thought);
    if (t.block_owner(b) != s) d.fail("block ", b, " owner ", t.block_owner(b), ", model ", s);
    if (t.block_thought(b) != mb.thought) d.fail("block ", b, " thought ", t.block_thought(b), ", model ", mb.thought);
    if (!m.in_pool(b, p) || t.block_precision(b) != p)
      d.fail("block ", b, " of thought ", mb.thought, " is not from the ", to_string(p), " pool");
    if (t.block_fill(b) != mb.fill) d.fail("block ", b, " fill ", t.block_fill(b), ", model ", mb.fill);
    if (t.block_live(b) != mb.live) d.fail("block ", b, " live ", t.block_live(b), ", model ", mb.live);
    const auto mask = t.evict_mask(b);
    if (static_cast<int>(mask.size()) != words) d.fail("block ", b, " mask has ", mask.size(), " words");
    for (int i = 0; i < words * 64 && i / 64 < static_cast<int>(mask.size()); ++i) {
      const bool bit = (mask[i / 64] >> (i % 64)) & 1u;
      const bool want = i < mb.fill && mb.slots[i].evicted;
      if (bit != want) d.fail("block ", b, " mask bit ", i, " = ", bit, ", model ", want);
    }
    // Per-block segment view: start index and mask of every segment with a live slot here.
    std::vector<BlockTable::BlockSegment> want_segs;
    for (int i = 0; i < mb.fill; ++i) {
      if (mb.slots[i].evicted) continue;
      auto it =
          std::find_if(want_segs.begin(), want_segs.end(), [&](const auto& x) { return x.segment == mb.slots[i].seg; });
      if (it == want_segs.end()) {
        want_segs.push_back({mb.slots[i].seg, i, std::vector<std::uint64_t>(static_cast<std::size_t>(words), 0)});
        it = want_segs.end() - 1;
      }
      it->mask[static_cast<std::size_t>(i / 64)] |= std::uint64_t{1} << (i % 64);
    }
    if (t.block_segments(b) != want_segs) d.fail("block ", b, " segment starts/masks differ from the model");
    for (int i = 0; i < mb.fill; ++i) {
      const MSlot& ms_ = mb.slots[i];
      const SlotRef r{b, static_cast<std::uint32_t>(i)};
      if (t.is_live(r) == ms_.evicted) d.fail("slot {", b, ",", i, "} is_live ", t.is_live(r));
      if (ms_.evicted) continue;
      if (t.slot_position(r) != ms_.pos || t.slot_segment(r) != ms_.seg)
        d.fail("slot {", b, ",", i, "} pos/seg ", t.slot_position(r), "/", t.slot_segment(r), ", model ", ms_.pos, "/",
               ms_.seg);
      const MGroup& gr = m.groups.at(ms_.group);
      if (t.slot_record(r) != gr.record)
        d.fail("slot {", b, ",", i, "} record ", t.slot_record(r), ", model ", gr.record);
    }
  }
  // records: held records' refcounts = live slots naming them
  std::set<std::uint32_t> live_records;
  for (const auto& [id, gr] : m.groups) {
    if (gr.record == kNoRecord) continue;
    live_records.insert(gr.record);
    if (t.record_refs(gr.record) != gr.live)
      d.fail("record ", gr.record, " refs ", t.record_refs(gr.record), ", model ", gr.live);
    if (t.record_owner(gr.record) != gr.stream)
      d.fail("record ", gr.record, " owner ", t.record_owner(gr.record), ", model ", gr.stream);
  }
  for (std::int64_t r = 0; r < t.record_capacity(); ++r) {
    const auto rr = static_cast<std::uint32_t>(r);
    if (!live_records.count(rr) && (t.record_refs(rr) != 0 || t.record_owner(rr) != kNoStream))
      d.fail("record ", r, " is free in the model but has refs ", t.record_refs(rr), " owner ", t.record_owner(rr));
  }
  return d;
}

/// check_table plus every stored and staged token's values and the memory accounting.
template <class B>
Diff check_cache(const PagedKvCache<B>& c, const CtModel& m) {
  Diff d = check_table(c.table(), m);
  const int D = m.D;
  std::vector<float> k(static_cast<std::size_t>(D)), v(k.size());
  MemoryUsage total;
  for (int s = 0; s < m.cfg.num_streams; ++s) {
    const MStream& ms = m.S(s);
    for (const auto& b : ms.blocks) {
      for (int i = 0; i < b.fill; ++i) {
        const MSlot& sl = b.slots[i];
        if (sl.evicted || sl.k.empty()) continue;
        const Status st = c.read_token({b.real, static_cast<std::uint32_t>(i)}, k, v);
        if (!st.is_ok()) {
          d.fail("read_token {", b.real, ",", i, "}: ", st.to_string());
          continue;
        }
        for (int ch = 0; ch < D; ++ch) {
          if (fbits(k[ch]) != fbits(sl.k[ch]) || fbits(v[ch]) != fbits(sl.v[ch])) {
            d.fail("stream ", s, " pos ", sl.pos, " slot {", b.real, ",", i, "} (", to_string(m.prec(b.thought)),
                   ") channel ", ch, ": k ", k[ch], " v ", v[ch], ", model k ", sl.k[ch], " v ", sl.v[ch]);
            break;
          }
        }
      }
    }
    for (int r = 0; r < static_cast<int>(ms.staged.size()); ++r) {
      if (ms.staged[r].k.empty()) continue;
      const Status st = c.backend().read_staged(s, r, k.data(), v.data());
      if (!st.is_ok() || !same_bits(k, ms.staged[r].k) || !same_bits(v, ms.staged[r].v))
        d.fail("stream ", s, " staged row ", r, " differs from the BF16-rounded input");
    }
    const MemoryUsage got = c.memory(s), want = m.memory(s);
    if (!(got == want)) d.fail("memory(", s, ") = ", describe(got), "\n   formula = ", describe(want));
    total += want;
  }
  if (!(c.memory() == total)) d.fail("memory() = ", describe(c.memory()), "\n   sum = ", describe(total));
  return d;
}

// ---- snapshots ------------------------------------------------------------------------------

inline std::string hex(const void* p, std::size_t n) {
  static const char* kDigits = "0123456789abcdef";
  std::string s;
  s.reserve(2 * n);
  const auto* b = static_cast<const unsigned char*>(p);
  for (std::size_t i = 0; i < n; ++i) {
    s += kDigits[b[i] >> 4];
    s += kDigits[b[i] & 15];
  }
  return s;
}

/// Every observable piece of a BlockTable's state, one labelled line each.
inline std::vector<std::string> snapshot_table(const BlockTable& t) {
  std::vector<std::string> out;
  auto line = [&](auto&&... a) {
    std::ostringstream os;
    (os << ... << a);
    out.push_back(os.str());
  };
  const auto& s = t.stats();
  line("stats ", s.commits, " ", s.slots_written, " ", s.slots_reused, " ", s.slots_evicted, " ", s.blocks_allocated,
       " ", s.blocks_freed, " ", s.records_allocated, " ", s.records_freed);
  for (Precision p : kAllPrecisions) line("free_blocks ", to_string(p), " ", t.free_blocks(p));
  line("free_records ", t.free_records());
  for (int st = 0; st < t.num_streams(); ++st) {
    std::ostringstream bl;
    for (auto b : t.blocks(st)) bl << b << " ";
    line("stream ", st, " blocks ", bl.str());
    line("stream ", st, " live ", t.live_slots(st), " holes ", t.hole_slots(st), " records ", t.records_held(st),
         " staged ", t.staged_count(st), " next ", t.next_position(st));
    if (t.staged_count(st) > 0) line("stream ", st, " staged thought ", t.staged_thought(st));
    for (int r = 0; r < t.staged_count(st); ++r)
      line("stream ", st, " staged ", r, " pos ", t.staged_position(st, r), " seg ", t.staged_segment(st, r));
    std::ostringstream ll;
    for (auto x : t.live_slot_list(st)) ll << x.block << ":" << x.slot << " ";
    line("stream ", st, " live list ", ll.str());
  }
  for (std::uint32_t b = 0; b < t.pools().total; ++b) {
    std::ostringstream mk;
    for (auto w : t.evict_mask(b)) mk << std::hex << w << " ";
    line("block ", b, " owner ", t.block_owner(b), " thought ", t.block_thought(b), " fill ", t.block_fill(b), " live ",
         t.block_live(b), " mask ", mk.str());
    if (t.is_shared(b)) {
      std::ostringstream hs;
      for (auto h : t.holders(b)) hs << h << " ";
      line("block ", b, " shared by ", hs.str());
    }
    for (int i = 0; i < t.block_fill(b); ++i) {
      const SlotRef r{b, static_cast<std::uint32_t>(i)};
      if (!t.is_live(r)) continue;
      line("slot ", b, ":", i, " rec ", t.slot_record(r), " seg ", t.slot_segment(r), " pos ", t.slot_position(r));
    }
  }
  for (int r = 0; r < t.record_capacity(); ++r)
    line("record ", r, " refs ", t.record_refs(static_cast<std::uint32_t>(r)), " owner ",
         t.record_owner(static_cast<std::uint32_t>(r)));
  return out;
}

/// snapshot_table plus memory, backend stats, every live slot's dequantized K/V, every staged
/// token, and (for backends that expose them) raw pages, key-scale records and stream scales.
template <class B>
std::vector<std::string> snapshot_cache(const PagedKvCache<B>& c, bool include_raw = true) {
  std::vector<std::string> out = snapshot_table(c.table());
  const BlockTable& t = c.table();
  const int D = c.config().head_dim;
  std::vector<float> k(static_cast<std::size_t>(D)), v(k.size());
  for (int s = 0; s < t.num_streams(); ++s) {
    out.push_back("memory " + std::to_string(s) + " " + describe(c.memory(s)));
    for (SlotRef r : t.live_slot_list(s)) {
      const Status st = c.read_token(r, k, v);
      out.push_back("token " + std::to_string(r.block) + ":" + std::to_string(r.slot) + " " + st.to_string() + " " +
                    hex(k.data(), k.size() * 4) + " " + hex(v.data(), v.size() * 4));
    }
    for (int row = 0; row < t.staged_count(s); ++row) {
      const Status st = c.backend().read_staged(s, row, k.data(), v.data());
      out.push_back("staged " + std::to_string(s) + ":" + std::to_string(row) + " " + st.to_string() + " " +
                    hex(k.data(), k.size() * 4) + " " + hex(v.data(), v.size() * 4));
    }
  }
  out.push_back("memory total " + describe(c.memory()));
  const BackendStats bst = c.backend().stats();
  out.push_back("backend stats " + std::to_string(bst.groups_quantized) + " " + std::to_string(bst.scale_saturations) +
                " " + std::to_string(bst.bytes_allocated));
  if constexpr (requires(const B& b) {
                  b.page(0u);
                  b.record_scales(0u);
                  b.stream_scale(0, 0, Precision::kBf16);
                }) {
    if (!include_raw) return out;
    for (std::uint32_t b = 0; b < t.pools().total; ++b) {
      const auto pg = c.backend().page(b);
      out.push_back("page " + std::to_string(b) + " " + hex(pg.data(), pg.size()));
    }
    for (int r = 0; r < t.record_capacity(); ++r) {
      const auto rs = c.backend().record_scales(static_cast<std::uint32_t>(r));
      out.push_back("record scales " + std::to_string(r) + " " + hex(rs.data(), rs.size()));
    }
    for (int s = 0; s < t.num_streams(); ++s)
      for (int kv = 0; kv < 2; ++kv)
        for (Precision p : kAllPrecisions) {
          const float x = c.backend().stream_scale(s, kv, p);
          out.push_back("s2 " + std::to_string(s) + " " + std::to_string(kv) + " " + std::string(to_string(p)) + " " +
                        hex(&x, 4));
        }
  }
  return out;
}

/// "" when equal, else the first differing line of each.
inline std::string first_difference(const std::vector<std::string>& a, const std::vector<std::string>& b) {
  const std::size_t n = std::min(a.size(), b.size());
  for (std::size_t i = 0; i < n; ++i) {
    if (a[i] != b[i]) {
      auto cut = [](const std::string& s) { return s.size() > 300 ? s.substr(0, 300) + "..." : s; };
      return "before: " + cut(a[i]) + "\nafter:  " + cut(b[i]);
    }
  }
  if (a.size() != b.size())
    return "snapshot sizes differ: " + std::to_string(a.size()) + " vs " + std::to_string(b.size());
  return {};
}
#define TT_REQUIRE_SAME_SNAPSHOT(before, after)                         \
  do {                                                                  \
    const std::string tt_diff_ = ::tt::first_difference(before, after); \
    INFO(tt_diff_);                                                     \
    REQUIRE(tt_diff_.empty());                                          \
  } while (0)

// ---- drivers ----------------------------------------------------------------------------------

/// The slots of the stream's live tokens with the given positions (found through the table).
inline std::vector<SlotRef> slots_of_positions(const BlockTable& t, int s, std::span<const std::int32_t> pos) {
  std::vector<SlotRef> out(pos.size(), SlotRef{});
  for (SlotRef r : t.live_slot_list(s)) {
    for (std::size_t i = 0; i < pos.size(); ++i)
      if (t.slot_position(r) == pos[i]) out[i] = r;
  }
  return out;
}

/// Appends one token to cache and model and, when the group commits, checks placement with the
/// model (the commit's slots are found through their positions). Returns the append status; on an
/// error the model is left unchanged.
/// Mirrors into the model one token the implementation has appended to stream s: stages it and,
/// when the group is full, commits it where the table put it (found through the positions).
inline void mirror_append(const BlockTable& t, CtModel& m, int s, std::span<const float> k, std::span<const float> v,
                          ThoughtType th, std::uint32_t seg, Diff& d) {
  m.stage(s, th, seg, k, v);
  if (static_cast<int>(m.S(s).staged.size()) == m.g) {
    std::vector<std::int32_t> pos;
    for (const auto& x : m.S(s).staged) pos.push_back(x.pos);
    const auto real = slots_of_positions(t, s, pos);
    const std::uint32_t rec = real[0].block == kNoBlock ? kNoRecord : t.slot_record(real[0]);
    for (SlotRef r : real)
      if (r.block != kNoBlock && t.slot_record(r) != rec) d.fail("the slots of one group name different records");
    m.commit(s, real, rec, d);
  }
}

template <class B>
Status append_both(PagedKvCache<B>& c, CtModel& m, int s, std::span<const float> k, std::span<const float> v,
                   ThoughtType t, std::uint32_t seg, Diff& d) {
  const Status st = c.append(s, k, v, t, seg);
  if (st.is_ok()) mirror_append(c.table(), m, s, k, v, t, seg, d);
  return st;
}

/// A random thought type allowed for the next append of stream s (the staged type mid-group).
inline ThoughtType next_thought(std::mt19937_64& rng, const CtModel& m, int s) {
  if (!m.S(s).staged.empty()) return m.S(s).staged_thought;
  return kAllThoughtTypes[static_cast<std::size_t>(uniform_int(rng, 0, 2))];
}

/// A random subset (1..max_n) of the stream's live slots, in random order.
inline std::vector<SlotRef> random_live_subset(std::mt19937_64& rng, const CtModel& m, int s, int max_n) {
  auto live = m.live_slots(s);
  std::shuffle(live.begin(), live.end(), rng);
  const int n = std::min<int>(static_cast<int>(live.size()), uniform_int(rng, 1, std::max(1, max_n)));
  live.resize(static_cast<std::size_t>(n));
  return live;
}

struct OpCounts {
  int appends = 0, commits = 0, exhausted = 0, evictions = 0, resets = 0;
};

/// n_ops random operations on cache and model: appends (mostly whole groups, thought types
/// changing on group boundaries, random segments), evictions of random live subsets, and
/// (with probability reset_p) stream resets. A full pool must be predicted by the model. With
/// check_each, the whole cache is compared with the model after every operation.
template <class B>
void random_ops(PagedKvCache<B>& c, CtModel& m, std::mt19937_64& rng, int n_ops, Diff& d, OpCounts& n,
                double reset_p = 0.02, bool check_each = true) {
  const int g = m.g;
  for (int op = 0; op < n_ops && d.ok(); ++op) {
    const int s = uniform_int(rng, 0, m.cfg.num_streams - 1);
    const double a = uniform01(rng);
    if (a < 0.7) {
      const int staged = static_cast<int>(m.S(s).staged.size());
      const int count = chance(rng, 0.6) ? g - staged : uniform_int(rng, 1, g);
      const ThoughtType th = next_thought(rng, m, s);
      const auto seg = static_cast<std::uint32_t>(uniform_int(rng, 0, 1 << 20));
      const double mag = std::exp2(std::uniform_real_distribution<double>(-4, 4)(rng));
      for (int i = 0; i < count; ++i) {
        const bool fills = static_cast<int>(m.S(s).staged.size()) + 1 == g;
        const StatusCode want = fills ? m.fit(s, th) : StatusCode::kOk;
        const auto k = random_row(rng, m.D, mag), v = random_row(rng, m.D, mag);
        const Status st = append_both(c, m, s, k, v, th, seg, d);
        if (st.code() != want) {
          d.fail("append to stream ", s, ": ", st.to_string(), "; the model predicts ", to_string(want));
          return;
        }
        if (!st.is_ok()) {
          ++n.exhausted;
          break;
        }
        ++n.appends;
        n.commits += fills;
      }
    } else if (a < 1.0 - reset_p) {
      if (m.live_count(s) == 0) continue;
      const auto batch = random_live_subset(rng, m, s, chance(rng, 0.2) ? 4 * g : g);
      const Status st = c.evict(s, batch);
      if (!st.is_ok()) {
        d.fail("evict: ", st.to_string());
        return;
      }
      m.evict(s, batch);
      ++n.evictions;
    } else {
      const Status st = c.reset_stream(s);
      if (!st.is_ok()) d.fail("reset_stream: ", st.to_string());
      m.reset(s);
      ++n.resets;
    }
    if (check_each) d.merge(check_cache(c, m));
  }
}

// ---- float64 attention ----------------------------------------------------------------------

/// out[c] = sum_j softmax(scale * q.k_j)_j v_jc in float64.
inline std::vector<double> attend64(const float* q, const std::vector<float>& k, const std::vector<float>& v, int d,
                                    double scale) {
  const int n = static_cast<int>(k.size() / static_cast<std::size_t>(d));
  std::vector<double> s(static_cast<std::size_t>(n));
  double mx = -INFINITY;
  for (int j = 0; j < n; ++j) {
    double a = 0;
    for (int c = 0; c < d; ++c) a += static_cast<double>(q[c]) * k[static_cast<std::size_t>(j) * d + c];
    s[j] = a * scale;
    mx = std::max(mx, s[j]);
  }
  double l = 0;
  for (auto& x : s) l += (x = std::exp(x - mx));
  std::vector<double> o(static_cast<std::size_t>(d), 0.0);
  for (int j = 0; j < n; ++j)
    for (int c = 0; c < d; ++c) o[c] += s[j] * v[static_cast<std::size_t>(j) * d + c];
  for (auto& x : o) x /= l;
  return o;
}

/// A rigorous-style bound on max_c |out_fp32 - out_exact| of reference::attend_tokens (FP32, the
/// order of design.md) for one query row, with u = 2^-24:
///  - each score: dot product over d terms (gamma_d), times scale (rounded 1/sqrt(d) and the
///    product: 3u), so |ds_j| <= scale * sum_c |q_c k_jc| * (gamma_d + 3u) =: E;
///  - each weight p_j = exp(s_j - m) then carries a relative error of at most
///    exp(2E + u|s_j - m|) (1 + 2u) - 1 (the u|x| term is weighted by e^x, so at most u/e);
///  - the two sums over n tokens (gamma_n each) and the final division (u).
/// A relative weight perturbation delta moves a convex combination by <= 2 delta/(1-delta) *
/// max|v|. The result is doubled as a safety margin.
inline double attention_error_bound(const float* q, const std::vector<float>& k, const std::vector<float>& v, int d,
                                    double scale) {
  const double u = std::ldexp(1.0, -24);
  const int n = static_cast<int>(k.size() / static_cast<std::size_t>(d));
  auto gamma = [&](double m) { return m * u / (1 - m * u); };
  double E = 0, vmax = 0;
  for (int j = 0; j < n; ++j) {
    double a = 0;
    for (int c = 0; c < d; ++c) a += std::fabs(static_cast<double>(q[c]) * k[static_cast<std::size_t>(j) * d + c]);
    E = std::max(E, a * scale * (gamma(d) + 3 * u));
  }
  for (float x : v) vmax = std::max(vmax, static_cast<double>(std::fabs(x)));
  const double delta = std::expm1(2 * E) + u / std::exp(1.0) + 2 * u + 2 * gamma(n) + u;
  return 2.0 * (2 * delta / (1 - delta) * vmax + u * vmax);
}

}  // namespace tt
