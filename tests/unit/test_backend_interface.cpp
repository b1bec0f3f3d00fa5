/// \file test_backend_interface.cpp
/// The backend interface: the kv_backend concept, the virtual KvBackend through BackendModel and
/// DynamicBackend (bit-identical to the direct CPU backend), construction errors, and backend
/// failures during append (the cache must stay exactly as it was).

#include <catch2/catch.hpp>

#include <algorithm>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "test_util.hpp"

using namespace thinkv;
using Catch::Matchers::Contains;
using tt::chance;
using tt::CtModel;
using tt::Diff;
using tt::uniform_int;

namespace {

/// A concept model that forwards to the CPU backend and fails on request.
class FlakyBackend {
 public:
  struct Control {
    StatusCode init = StatusCode::kOk;
    bool fail_stage = false;
    bool fail_commit = false;
    bool fail_grow = false;  ///< refuse to give a pool or the records more storage
  };
  explicit FlakyBackend(std::shared_ptr<Control> c = std::make_shared<Control>()) : ctl_(std::move(c)) {}
  std::string_view name() const { return "flaky"; }
  Status init(const StorageConfig& c) {
    if (ctl_->init != StatusCode::kOk) return {ctl_->init, "flaky init refused"};
    return cpu_.init(c);
  }
  Status resize_pool(Precision p, std::uint32_t n) {
    if (ctl_->fail_grow && n > cpu_.pool_pages(p)) return {StatusCode::kPoolExhausted, "flaky: out of memory"};
    return cpu_.resize_pool(p, n);
  }
  Status resize_records(std::uint32_t n) {
    if (ctl_->fail_grow && n > cpu_.records_allocated()) return {StatusCode::kPoolExhausted, "flaky: out of memory"};
    return cpu_.resize_records(n);
  }
  Status stage(int s, int r, const float* k, const float* v) {
    if (ctl_->fail_stage) return {StatusCode::kCudaError, "flaky stage failed"};
    return cpu_.stage(s, r, k, v);
  }
  Status commit(const CommitPlan& p) {
    if (ctl_->fail_commit) return {StatusCode::kCudaError, "flaky commit failed"};
    return cpu_.commit(p);
  }
  Status reset_stream(int s) { return cpu_.reset_stream(s); }
  Status read_token(const TokenRef& t, float* k, float* v) const { return cpu_.read_token(t, k, v); }
  Status read_staged(int s, int r, float* k, float* v) const { return cpu_.read_staged(s, r, k, v); }
  Status attend(const AttendView& w, const DecodeAttentionArgs& a) const { return cpu_.attend(w, a); }
  BackendStats stats() const { return cpu_.stats(); }
  // for snapshots
  std::span<const std::uint8_t> page(std::uint32_t b) const { return cpu_.page(b); }
  std::span<const std::uint8_t> record_scales(std::uint32_t r) const { return cpu_.record_scales(r); }
  float stream_scale(int s, int kv, Precision p) const { return cpu_.stream_scale(s, kv, p); }

 private:
  std::shared_ptr<Control> ctl_;
  CpuKvBackend cpu_;
};

struct NotABackend {
  std::string_view name() const { return "nope"; }
  Status init(const CacheConfig&) { return {}; }
};

static_assert(kv_backend<CpuKvBackend>);
static_assert(kv_backend<DynamicBackend>);
static_assert(kv_backend<FlakyBackend>);
static_assert(!kv_backend<NotABackend>);
static_assert(!kv_backend<int>);
static_assert(std::is_base_of_v<KvBackend, BackendModel<CpuKvBackend>>);

CacheConfig config_for(PrecisionMap map, int d, int g, int bs, int streams, int blocks) {
  CacheConfig c;
  c.num_streams = streams;
  c.head_dim = d;
  c.group_size = g;
  c.block_size = bs;
  c.precision = map;
  for (Precision p : kAllPrecisions) c.pool_blocks[static_cast<int>(p)] = map.uses(p) ? blocks : 0;
  return c;
}

DynamicBackend dynamic_cpu() { return DynamicBackend(std::make_unique<BackendModel<CpuKvBackend>>()); }

const CpuKvBackend& inner_cpu(const PagedKvCache<DynamicBackend>& c) {
  const auto* m = dynamic_cast<const BackendModel<CpuKvBackend>*>(c.backend().get());
  REQUIRE(m != nullptr);
  return m->get();
}

std::vector<float> attend_all(const auto& cache, const std::vector<std::int32_t>& streams, int nq,
                              const std::vector<float>& q, Status& st) {
  std::vector<float> out(q.size(), std::numeric_limits<float>::quiet_NaN());
  DecodeAttentionArgs a;
  a.num_q_heads = nq;
  a.num_kv_heads = static_cast<int>(streams.size());
  a.kv_streams = streams.data();
  a.q = q.data();
  a.out = out.data();
  st = cache.attend(a);
  return out;
}

/// Appends n random tokens of thought `th` to stream s of the cache and of its model.
template <class B>
void append_random(PagedKvCache<B>& c, CtModel& m, std::mt19937_64& rng, int s, ThoughtType th, int n, Diff& diff) {
  const int d = c.config().head_dim;
  for (int i = 0; i < n; ++i) {
    const auto k = tt::random_row(rng, d), v = tt::random_row(rng, d);
    REQUIRE(tt::append_both(c, m, s, k, v, th, 1, diff).is_ok());
  }
}

}  // namespace

TEST_CASE("DynamicBackend over BackendModel<CpuKvBackend> is bit-identical to CpuKvBackend", "[backend]") {
  TT_SEEDED_RNG();
  for (const PrecisionMap& map : {kR4E4T2, kR8E4T2, kR8E8T4, kFullKvMap}) {
    const int g = 8 << uniform_int(rng, 0, 2);
    const int d = g * uniform_int(rng, 1, 4);
    const int bs = uniform_int(rng, 2, 32);
    const int streams = 4;
    const CacheConfig cfg = config_for(map, d, g, bs, streams, 3 * ((g + bs - 1) / bs) + 2);
    CAPTURE(cfg);
    PagedKvCache<CpuKvBackend> a(cfg);
    PagedKvCache<DynamicBackend> b(cfg, dynamic_cpu());
    CHECK(a.backend().name() == "cpu");
    CHECK(b.backend().name() == "cpu");
    CtModel m(cfg);
    int errors = 0, commits = 0;
    for (int op = 0; op < 200; ++op) {
      CAPTURE(op);
      const int s = uniform_int(rng, 0, streams - 1);
      const double x = tt::uniform01(rng);
      if (x < 0.7) {
        const ThoughtType th = tt::next_thought(rng, m, s);
        const int n = chance(rng, 0.5) ? g - static_cast<int>(m.S(s).staged.size()) : 1;
        for (int i = 0; i < n; ++i) {
          auto k = tt::random_row(rng, d), v = tt::random_row(rng, d);
          if (chance(rng, 0.01))
            k[static_cast<std::size_t>(uniform_int(rng, 0, d - 1))] = std::numeric_limits<float>::infinity();
          Diff diff;
          const bool fills = static_cast<int>(m.S(s).staged.size()) + 1 == g;
          const Status sa = tt::append_both(a, m, s, k, v, th, 0, diff);
          const Status sb = b.append(s, k, v, th, 0);
          REQUIRE(sa.code() == sb.code());
          REQUIRE(sa.message() == sb.message());
          TT_REQUIRE_OK_DIFF(diff);
          errors += !sa.is_ok();
          commits += sa.is_ok() && fills;
        }
      } else if (x < 0.95) {
        if (m.live_count(s) == 0) continue;
        const auto batch = tt::random_live_subset(rng, m, s, g);
        REQUIRE(a.evict(s, batch).is_ok());
        REQUIRE(b.evict(s, batch).is_ok());
        m.evict(s, batch);
      } else {
        REQUIRE(a.reset_stream(s).is_ok());
        REQUIRE(b.reset_stream(s).is_ok());
        m.reset(s);
      }
      // identical state: table, memory, tokens, pages, records, scales, stats
      REQUIRE(a.memory() == b.memory());
      if (op % 10 == 0) {
        TT_REQUIRE_SAME_SNAPSHOT(tt::snapshot_cache(a, false), tt::snapshot_cache(b));
        for (std::uint32_t blk = 0; blk < a.table().pools().total; ++blk) {
          const auto pa = a.backend().page(blk), pb = inner_cpu(b).page(blk);
          REQUIRE(std::equal(pa.begin(), pa.end(), pb.begin(), pb.end()));
        }
      }
      // identical attention output, bit for bit
      std::vector<std::int32_t> kv;
      for (int h = 0; h < 2; ++h) {
        int st = uniform_int(rng, 0, streams - 1);
        if (m.live_count(st) + static_cast<int>(m.S(st).staged.size()) == 0) st = -1;
        kv.push_back(st);
      }
      if (kv[0] >= 0 && kv[1] >= 0) {
        const int nq = 2 * uniform_int(rng, 1, 4);
        std::vector<float> q;
        for (int h = 0; h < nq; ++h) {
          const auto r = tt::random_row(rng, d, 1.0);
          q.insert(q.end(), r.begin(), r.end());
        }
        Status sa, sb;
        const auto oa = attend_all(a, kv, nq, q, sa), ob = attend_all(b, kv, nq, q, sb);
        REQUIRE(sa.is_ok());
        REQUIRE(sb.is_ok());
        REQUIRE(tt::same_bits(oa, ob));
      }
    }
    TT_REQUIRE_OK_DIFF(tt::check_cache(a, m));
    CHECK(commits > 3);
    const BackendStats x = a.backend().stats(), y = b.backend().stats();
    CHECK(x.groups_quantized == y.groups_quantized);
    CHECK(x.scale_saturations == y.scale_saturations);
    CHECK(x.bytes_allocated == y.bytes_allocated);
  }
}

TEST_CASE("PagedKvCache<DynamicBackend> without a backend throws a clear error", "[backend][errors]") {
  const CacheConfig cfg = config_for(kR4E4T2, 32, 16, 16, 2, 4);
  CHECK(DynamicBackend().name() == "none");
  CHECK(DynamicBackend().get() == nullptr);
  try {
    PagedKvCache<DynamicBackend> c(cfg);
    FAIL("constructed a cache over an empty DynamicBackend");
  } catch (const std::exception& e) { CHECK_THAT(std::string(e.what()), Contains("DynamicBackend holds no backend")); }
  CHECK_THROWS_AS(PagedKvCache<DynamicBackend>(cfg, DynamicBackend(nullptr)), std::invalid_argument);
}

TEST_CASE("PagedKvCache: backend init failures are reported", "[backend][errors]") {
  const CacheConfig cfg = config_for(kR4E4T2, 32, 16, 16, 2, 4);
  auto ctl = std::make_shared<FlakyBackend::Control>();
  ctl->init = StatusCode::kCudaError;
  try {
    PagedKvCache<FlakyBackend> c(cfg, FlakyBackend(ctl));
    FAIL("init failure ignored");
  } catch (const ConfigError&) {
    FAIL("an allocation failure is not a configuration error");
  } catch (const BackendError& e) {
    CHECK_THAT(std::string(e.what()), Contains("flaky") && Contains("flaky init refused"));
    CHECK(e.status().code() == StatusCode::kCudaError);  // the backend's code is kept
  }
  ctl->init = StatusCode::kInvalidArgument;
  CHECK_THROWS_AS(PagedKvCache<FlakyBackend>(cfg, FlakyBackend(ctl)), ConfigError);
  // an invalid configuration is reported before the backend is asked
  CacheConfig bad = cfg;
  bad.group_size = 12;
  ctl->init = StatusCode::kOk;
  CHECK_THROWS_WITH(PagedKvCache<FlakyBackend>(bad, FlakyBackend(ctl)), Contains("group_size 12"));
}

TEST_CASE("PagedKvCache: a backend failure in stage or commit leaves the cache unchanged", "[backend][errors]") {
  TT_SEEDED_RNG();
  const int d = 16, g = 8;
  const CacheConfig cfg = config_for(kR4E4T2, d, g, 8, 2, 6);
  auto ctl = std::make_shared<FlakyBackend::Control>();
  PagedKvCache<FlakyBackend> c(cfg, FlakyBackend(ctl));
  CtModel m(cfg);
  Diff diff;
  auto add = [&](int s, ThoughtType th, int n) { append_random(c, m, rng, s, th, n, diff); };
  add(0, ThoughtType::kReasoning, 2 * g);
  add(1, ThoughtType::kTransition, g);
  REQUIRE(c.evict(0, std::vector<SlotRef>{m.live_slots(0)[3]}).is_ok());
  m.evict(0, std::vector<SlotRef>{m.live_slots(0)[3]});
  add(0, ThoughtType::kReasoning, g - 1);  // the next append commits (into the hole first)
  add(1, ThoughtType::kExecution, 3);
  TT_REQUIRE_OK_DIFF(diff);
  const auto before = tt::snapshot_cache(c);
  const auto k = tt::random_row(rng, d), v = tt::random_row(rng, d);
  ctl->fail_commit = true;
  Status st = c.append(0, k, v, ThoughtType::kReasoning);
  CHECK(st.code() == StatusCode::kCudaError);
  CHECK_THAT(st.message(), Contains("flaky commit failed"));
  TT_REQUIRE_SAME_SNAPSHOT(before, tt::snapshot_cache(c));
  ctl->fail_commit = false;
  ctl->fail_stage = true;
  for (int s : {0, 1}) {
    st = c.append(s, k, v, s == 0 ? ThoughtType::kReasoning : ThoughtType::kExecution);
    CHECK(st.code() == StatusCode::kCudaError);
    TT_REQUIRE_SAME_SNAPSHOT(before, tt::snapshot_cache(c));
  }
  ctl->fail_stage = false;
  // The same append now succeeds and lands where it should.
  REQUIRE(tt::append_both(c, m, 0, k, v, ThoughtType::kReasoning, 1, diff).is_ok());
  TT_REQUIRE_OK_DIFF(diff);
  TT_REQUIRE_OK_DIFF(tt::check_cache(c, m));
}

TEST_CASE("PagedKvCache: a backend that cannot grow, or fails after growing, leaves cache and storage unchanged",
          "[backend][errors][arena]") {
  TT_SEEDED_RNG();
  const int d = 16, g = 8;
  CacheConfig cfg = config_for(kR4E4T2, d, g, 8, 2, 6);
  cfg.chunk_blocks = 1;  // every fresh block is a new chunk
  auto ctl = std::make_shared<FlakyBackend::Control>();
  PagedKvCache<FlakyBackend> c(cfg, FlakyBackend(ctl));
  CtModel m(cfg);
  Diff diff;
  auto add = [&](int s, ThoughtType th, int n) { append_random(c, m, rng, s, th, n, diff); };
  add(0, ThoughtType::kReasoning, 2 * g);
  add(0, ThoughtType::kReasoning, g - 1);  // the next append commits into a fresh block
  TT_REQUIRE_OK_DIFF(diff);
  const auto before = tt::snapshot_cache(c);
  const std::int64_t allocated = c.allocated_bytes();
  const std::int64_t backend_bytes = c.backend().stats().bytes_allocated;
  const auto k = tt::random_row(rng, d), v = tt::random_row(rng, d);
  ctl->fail_grow = true;
  Status st = c.append(0, k, v, ThoughtType::kReasoning);
  CHECK(st.code() == StatusCode::kPoolExhausted);
  CHECK_THAT(st.message(), Contains("flaky: out of memory"));
  TT_REQUIRE_SAME_SNAPSHOT(before, tt::snapshot_cache(c));
  ctl->fail_grow = false;
  ctl->fail_commit = true;  // storage given, then the commit fails: the storage goes back
  st = c.append(0, k, v, ThoughtType::kReasoning);
  CHECK(st.code() == StatusCode::kCudaError);
  TT_REQUIRE_SAME_SNAPSHOT(before, tt::snapshot_cache(c));
  CHECK(c.allocated_bytes() == allocated);
  CHECK(c.backend().stats().bytes_allocated == backend_bytes);
  ctl->fail_commit = false;
  REQUIRE(tt::append_both(c, m, 0, k, v, ThoughtType::kReasoning, 1, diff).is_ok());
  TT_REQUIRE_OK_DIFF(diff);
  TT_REQUIRE_OK_DIFF(tt::check_cache(c, m));
  CHECK(c.allocated_bytes() > allocated);
}

TEST_CASE("AttendView lists exactly the table's live slots, and storage refuses a view that disagrees",
          "[backend][view]") {
  TT_SEEDED_RNG();
  const int d = 16, g = 8, bs = 16, streams = 3;
  const CacheConfig cfg = config_for(kR4E4T2, d, g, bs, streams, 64);
  PagedKvCache<CpuKvBackend> c(cfg);
  // Random tokens of random types in every stream, with random evictions in between.
  for (int round = 0; round < 6; ++round) {
    for (int s = 0; s < streams; ++s) {
      const auto th = static_cast<ThoughtType>(uniform_int(rng, 0, 2));
      const int n = g * uniform_int(rng, 1, 4) + uniform_int(rng, 0, g - 1) * (round == 5);
      for (int i = 0; i < n; ++i) {
        if (c.table().staged_count(s) > 0 && c.table().staged_thought(s) != th) break;  // groups keep one type
        const auto k = tt::random_row(rng, d), v = tt::random_row(rng, d);
        REQUIRE(c.append(s, k, v, th, static_cast<std::uint32_t>(round)).is_ok());
      }
      std::vector<SlotRef> victims;
      for (SlotRef r : c.table().live_slot_list(s)) {
        if (tt::chance(rng, 0.3)) victims.push_back(r);
      }
      REQUIRE(c.evict(s, victims).is_ok());
    }
  }
  const std::vector<std::int32_t> ids = {2, 0, 1};
  std::vector<StreamView> sv;
  const AttendView view = c.table().attend_view(ids, sv);
  REQUIRE(view.streams.size() == ids.size());
  std::int64_t slots_seen = 0;
  for (std::size_t h = 0; h < ids.size(); ++h) {
    const StreamView& s = view.streams[h];
    CHECK(s.stream == ids[h]);
    CHECK(s.staged == c.table().staged_count(ids[h]));
    // Walking the view's blocks, masks and fill gives the table's live slots, in order, with their
    // owners and records.
    std::vector<SlotRef> walked;
    for (std::uint32_t b : s.blocks) {
      const int p = view.pool_of(b);
      REQUIRE(p >= 0);
      CHECK(static_cast<Precision>(p) == c.table().block_precision(b));
      for (int i = 0; i < view.block_size; ++i) {
        if (!view.live(p, b, i)) continue;
        const TokenRef t = view.token(p, b, i);
        const TokenRef want = c.table().token_ref(t.slot);
        CHECK(t.stream == want.stream);
        CHECK(t.record == want.record);
        walked.push_back(t.slot);
      }
    }
    CHECK(walked == c.table().live_slot_list(ids[h]));
    CHECK(static_cast<std::int64_t>(walked.size()) == s.live);
    slots_seen += s.live;
  }
  REQUIRE(slots_seen > 0);
  // The backend's attention over the view is the cache's.
  const std::vector<float> q = tt::random_row(rng, 3 * 2 * d);
  Status st;
  const auto want = attend_all(c, ids, 6, q, st);
  REQUIRE(st.is_ok());
  std::vector<float> out(q.size(), std::numeric_limits<float>::quiet_NaN());
  DecodeAttentionArgs a;
  a.num_q_heads = 6;
  a.num_kv_heads = 3;
  a.kv_streams = ids.data();
  a.q = q.data();
  a.out = out.data();
  REQUIRE(c.backend().attend(view, a).is_ok());
  CHECK(out == want);
  // Views that disagree with the args or with the masks are refused.
  auto refused = [&](const AttendView& v, const char* text) {
    const Status s = c.backend().attend(v, a);
    INFO(s);
    CHECK_FALSE(s.is_ok());
    CHECK_THAT(s.message(), Catch::Matchers::Contains(text));
  };
  std::vector<StreamView> bad = sv;
  AttendView v2 = view;
  v2.streams = std::span<const StreamView>(bad).first(2);
  refused(v2, "the view has 2 streams for 3 KV heads");
  bad = sv;
  bad[1].stream = 2;
  v2.streams = bad;
  refused(v2, "view stream 1 is stream 2");
  bad = sv;
  bad[0].live += 1;
  v2.streams = bad;
  refused(v2, "live slots but its blocks hold");
  bad = sv;
  std::vector<std::uint32_t> alien(bad[0].blocks.begin(), bad[0].blocks.end());
  alien.push_back(kNoBlock - 1);
  bad[0].blocks = alien;
  v2.streams = bad;
  refused(v2, "has no storage");
  // A quantized token read without its owner or record is refused, not decoded with stale scales.
  const SlotRef any = c.table().live_slot_list(ids[0]).front();
  TokenRef t = c.table().token_ref(any);
  std::vector<float> k(d), v(d);
  REQUIRE(c.backend().read_token(t, k.data(), v.data()).is_ok());
  t.stream = kNoStream;
  CHECK(c.backend().read_token(t, k.data(), v.data()).code() == StatusCode::kInvalidArgument);
}
