// The batched decode API of BasicThinKvCache (begin_step / append_batch / attend_batch /
// end_step) over the CPU backend: the same decisions and the same output bits as the one-
// sequence-at-a-time API, under continuous batching (joins, finishes, shuffled batch order), in
// every element type, and a sequence whose K/V holds NaN or Inf is faulted alone.

#include <catch2/catch.hpp>

#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "thinkv/thinkv_cache.hpp"

#include "batched_driver.hpp"
#include "test_util.hpp"

using namespace thinkv;

namespace {

ThinKvConfig small_config() {
  ThinKvConfig c;
  c.num_sequences = 5;
  c.num_layers = 2;
  c.num_kv_heads = 2;
  c.num_q_heads = 4;
  c.head_dim = 16;
  c.group_size = 8;
  c.block_size = 16;
  c.max_tokens = 700;
  c.segment_len = 64;
  c.token_budget = 160;
  return c;
}

ThinKvPolicy small_policy() {
  ThinKvPolicy p;
  p.precision = kR4E4T2;
  p.retention = RetentionSchedule({32, 16, 8, 4});
  p.classifier = ThoughtClassifier::three_types(0.3f, 0.6f, {0, 1}, 64, 2);
  return p;
}

// The same policy selecting on the host (the reference path of run_tbe).
bt::HostKmeansPolicy host_policy() {
  const ThinKvPolicy p = small_policy();
  bt::HostKmeansPolicy h;
  h.precision = p.precision;
  h.retention = p.retention;
  h.classifier = p.classifier;
  return h;
}

}  // namespace

TEST_CASE("Batched decode takes the per-sequence API's decisions and output bits", "[batched]") {
  TT_SEEDED_RNG();
  const ElementType types[] = {ElementType::kF32, ElementType::kF16, ElementType::kBf16};
  for (ElementType kv : types) {
    for (ElementType qo : types) {
      INFO("kv " << to_string(kv) << ", q/out " << to_string(qo));
      ThinKvCache<> batched(small_config(), small_policy());
      BasicThinKvCache<bt::HostKmeansPolicy> reference(small_config(), host_policy());
      bt::RunOptions o;
      o.steps = kv == ElementType::kF32 && qo == ElementType::kF32 ? 600 : 200;
      o.kv_type = kv;
      o.q_type = qo;
      o.out_type = qo;
      o.finish = 0.004;
      bt::RunReport r;
      const std::string err = bt::run_batched(batched, reference, bt::host_memory(), rng, o, r);
      INFO(err);
      REQUIRE(err.empty());
      CHECK(r.max_batch >= 3);
      if (o.steps >= 600) {
        CHECK(batched.stats().tokens_evicted > 0);
        CHECK(batched.stats().refreshes > 0);
        CHECK(r.finishes > 0);
      }
      CHECK(batched.paged().moved_bytes() == 0);
    }
  }
}

TEST_CASE("Batched decode in lockstep: every sequence evicts at the same steps, one K-means call", "[batched]") {
  TT_SEEDED_RNG();
  ThinKvCache<> batched(small_config(), small_policy());
  BasicThinKvCache<bt::HostKmeansPolicy> reference(small_config(), host_policy());
  bt::RunOptions o;
  o.steps = 500;
  o.join = 1.0;  // all five join at step 0 and never finish
  o.finish = 0.0;
  bt::RunReport r;
  const std::string err = bt::run_batched(batched, reference, bt::host_memory(), rng, o, r);
  INFO(err);
  REQUIRE(err.empty());
  CHECK(r.max_batch == 5);
  CHECK(batched.stats().eviction_calls >= 5 * 3);
}

TEST_CASE("Batched decode with seq_rm between steps takes the one-token path's decisions", "[batched][sequence_ops]") {
  TT_SEEDED_RNG();
  ThinKvCache<> batched(small_config(), small_policy());
  BasicThinKvCache<bt::HostKmeansPolicy> reference(small_config(), host_policy());
  bt::RunOptions o;
  o.steps = 600;
  o.finish = 0.004;
  o.remove = 0.05;
  bt::RunReport r;
  const std::string err = bt::run_batched(batched, reference, bt::host_memory(), rng, o, r);
  INFO(err);
  REQUIRE(err.empty());
  INFO("removes " << r.removes << ", refused " << r.removes_refused);
  CHECK(r.removes > 15);
  CHECK(r.removes_refused > 3);
  CHECK(batched.stats().tokens_removed > 0);
  CHECK(batched.stats().tokens_evicted > 0);
  CHECK(batched.paged().moved_bytes() == 0);
}

TEST_CASE("Reserved host metadata changes no decision and still releases emptied chunks", "[batched]") {
  TT_SEEDED_RNG();
  ThinKvConfig cfg = small_config();
  cfg.chunk_blocks = 1;  // a pool's top block that empties is released at once
  ThinKvCache<> batched(cfg, small_policy());
  BasicThinKvCache<bt::HostKmeansPolicy> reference(cfg, host_policy());
  const std::int64_t bytes = batched.reserve_host_metadata();
  CHECK(batched.paged().table().host_metadata_reserved());
  CHECK(bytes > 0);
  bt::RunOptions o;
  o.steps = 600;
  o.finish = 0.004;
  bt::RunReport r;
  const std::string err = bt::run_batched(batched, reference, bt::host_memory(), rng, o, r);
  INFO(err);
  REQUIRE(err.empty());
  CHECK(batched.stats().tokens_evicted > 0);
  CHECK(r.finishes > 0);
  // Pools follow what is held (chunks released) while the arrays keep their capacity: once every
  // sequence is freed, no block chunk is left.
  CHECK(batched.paged().allocated_bytes() == reference.paged().allocated_bytes());
  for (int s = 0; s < cfg.num_sequences; ++s) {
    REQUIRE(batched.reset_sequence(s).is_ok());
    REQUIRE(reference.reset_sequence(s).is_ok());
  }
  CHECK(batched.paged().table().stats().chunks_released > 0);
  for (Precision p : kAllPrecisions) CHECK(batched.paged().table().allocated_blocks(p) == 0);
  CHECK(batched.paged().allocated_bytes() == reference.paged().allocated_bytes());
  CHECK(batched.paged().table().host_metadata_reserved());
}

TEST_CASE("Batched decode: a NaN or Inf in one sequence's K/V faults that sequence alone", "[batched][bad_input]") {
  TT_SEEDED_RNG();
  ThinKvCache<> batched(small_config(), small_policy());
  BasicThinKvCache<bt::HostKmeansPolicy> reference(small_config(), host_policy());
  bt::RunOptions o;
  o.steps = 400;
  o.poison = 0.05;
  o.kv_type = ElementType::kBf16;
  bt::RunReport r;
  const std::string err = bt::run_batched(batched, reference, bt::host_memory(), rng, o, r);
  INFO(err);
  REQUIRE(err.empty());
  CHECK(r.faults > 3);
}

TEST_CASE("Capturable batched steps take the one-sequence path's decisions", "[batched][graph]") {
  TT_SEEDED_RNG();
  ThinKvCache<> batched(small_config(), small_policy());
  BasicThinKvCache<bt::HostKmeansPolicy> reference(small_config(), host_policy());
  REQUIRE(batched.set_capturable_steps(true).is_ok());
  CHECK(batched.capturable_steps());
  bt::RunOptions o;
  o.steps = 300;
  bt::RunReport r;
  const std::string err = bt::run_batched(batched, reference, bt::host_memory(), rng, o, r);
  INFO(err);
  REQUIRE(err.empty());
  CHECK(batched.stats().refreshes > 0);
  CHECK(batched.graph_epoch() == 0);  // the CPU backend has no graphs
  // replay_step: only on an open capturable step, before any per-layer call.
  CHECK(batched.replay_step().message().find("no step is open") != std::string::npos);
  const std::vector<int> batch{batched.position(0) < small_config().max_tokens ? 0 : 1};
  ThinKvCache<> fresh(small_config(), small_policy());
  REQUIRE(fresh.begin_step(batch).is_ok());
  CHECK(fresh.replay_step().message().find("not capturable") != std::string::npos);
  CHECK(fresh.set_capturable_steps(true).code() == StatusCode::kInvalidArgument);  // a step is open
}

TEST_CASE("Batched decode refuses bad batches naming the sequence, changing nothing", "[batched][bad_input]") {
  ThinKvCache<> cache(small_config(), small_policy());
  const std::vector<int> twice{1, 3, 1};
  Status e = cache.begin_step(twice);
  CHECK(e.code() == StatusCode::kInvalidArgument);
  CHECK(e.message().find("sequence 1 is named twice") != std::string::npos);
  const std::vector<int> out_of_range{0, 9};
  CHECK(cache.begin_step(out_of_range).code() == StatusCode::kOutOfRange);
  CHECK(cache.begin_step(std::vector<int>{}).code() == StatusCode::kInvalidArgument);
  const std::vector<int> batch{2, 0};
  // A sequence with an open token (begin_token) names it; nothing begins.
  REQUIRE(cache.begin_token(0).is_ok());
  e = cache.begin_step(batch);
  CHECK(e.message().find("begin_token(0)") != std::string::npos);
  CHECK(cache.position(2) == 0);
  CHECK(cache.live_tokens(2) == 0);
  REQUIRE(cache.reset_sequence(0).is_ok());
  REQUIRE(cache.begin_step(batch).is_ok());
  // One step at a time; a sequence of the open step cannot begin a token or be reset.
  const std::vector<int> again{4, 3};
  e = cache.begin_step(again);
  CHECK(e.message().find("still open") != std::string::npos);
  CHECK(cache.begin_token(2).code() == StatusCode::kInvalidArgument);
  CHECK(cache.reset_sequence(2).message().find("open step") != std::string::npos);
  CHECK(cache.begin_token(4).is_ok());  // another sequence may decode one token at a time meanwhile
  std::vector<float> k(2 * 2 * 16, 0.5f), q(2 * 4 * 16, 0.25f), out(q.size());
  // The per-layer calls take the step's batch, in its order.
  const std::vector<int> swapped{0, 2};
  e = cache.append_batch(0, swapped, {k.data(), ElementType::kF32}, {k.data(), ElementType::kF32});
  CHECK(e.message().find("not the one begin_step was given") != std::string::npos);
  CHECK(cache.append_batch(2, batch, {k.data(), ElementType::kF32}, {k.data(), ElementType::kF32}).code() ==
        StatusCode::kOutOfRange);
  // Attend before append, end before every layer: refused, naming layer and sequence.
  e = cache.attend_batch(0, batch, {q.data(), ElementType::kF32}, {out.data(), ElementType::kF32});
  CHECK(e.message().find("before its append") != std::string::npos);
  CHECK(cache.append_batch(0, batch, {nullptr, ElementType::kF32}, {k.data(), ElementType::kF32}).code() ==
        StatusCode::kInvalidArgument);
  REQUIRE(cache.append_batch(0, batch, {k.data(), ElementType::kF32}, {k.data(), ElementType::kF32}).is_ok());
  e = cache.append_batch(0, batch, {k.data(), ElementType::kF32}, {k.data(), ElementType::kF32});
  CHECK(e.message().find("already appended") != std::string::npos);
  e = cache.end_step(batch);
  CHECK(e.message().find("layer 1 was never appended") != std::string::npos);
  CHECK(cache.position(2) == 0);
  REQUIRE(cache.attend_batch(0, batch, {q.data(), ElementType::kF32}, {out.data(), ElementType::kF32}).is_ok());
  REQUIRE(cache.append_batch(1, batch, {k.data(), ElementType::kF32}, {k.data(), ElementType::kF32}).is_ok());
  REQUIRE(cache.end_step(batch).is_ok());
  CHECK(cache.position(2) == 1);
  CHECK(cache.position(0) == 1);
  CHECK(cache.live_tokens(0) == 1);
  CHECK(cache.end_step(batch).message().find("no step is open") != std::string::npos);
  CHECK(cache.attend_batch(0, batch, {q.data(), ElementType::kF32}, {out.data(), ElementType::kF32})
            .message()
            .find("no step is open") != std::string::npos);
}

TEST_CASE("Prefill in chunks stores what token-by-token appends store, and attends causally in FP32",
          "[batched][prefill]") {
  TT_SEEDED_RNG();
  const ElementType types[] = {ElementType::kF32, ElementType::kBf16};
  for (ElementType t : types) {
    INFO("element type " << to_string(t));
    ThinKvCache<> batched(small_config(), small_policy());
    BasicThinKvCache<bt::HostKmeansPolicy> reference(small_config(), host_policy());
    bt::RunOptions o;
    o.steps = 300;
    o.kv_type = o.q_type = o.out_type = t;
    o.finish = 0.01;
    o.prompt = 0.7;
    o.max_prompt = 200;   // past segment_len (64) and the budget (160); lengths not multiples of g
    o.prompt_chunks = 4;  // ubatches: chunks cut anywhere (inside groups, segments, blocks)
    bt::RunReport r;
    const std::string err = bt::run_batched(batched, reference, bt::host_memory(), rng, o, r);
    INFO(err);
    REQUIRE(err.empty());
    CHECK(r.prompts >= 3);
    CHECK(r.prompt_tokens > 150);
    CHECK(r.prompt_chunks > r.prompts);         // some prompts came in several chunks
    CHECK(batched.stats().tokens_evicted > 0);  // decoding after a prompt still evicts (its thoughts)
    INFO("worst prefill error / max|out| " << r.worst_prompt_err);
  }
}

TEST_CASE("Prefill refuses bad calls naming the problem, changing nothing", "[batched][prefill][bad_input]") {
  ThinKvConfig c = small_config();
  ThinKvCache<> cache(c, small_policy());
  const int T = 40, hkv = c.num_kv_heads, hq = c.num_q_heads, d = c.head_dim;
  std::vector<float> k(static_cast<std::size_t>(T) * hkv * d, 0.5f), q(static_cast<std::size_t>(T) * hq * d, 0.25f),
      out(q.size());
  const TensorRef kr{k.data(), ElementType::kF32}, qr{q.data(), ElementType::kF32};
  const MutableTensorRef outr{out.data(), ElementType::kF32};
  CHECK(cache.prefill(0, 1, qr, kr, kr, outr).message().find("no open prompt") != std::string::npos);
  CHECK(cache.begin_prompt(1, 0).code() == StatusCode::kOutOfRange);
  CHECK(cache.begin_prompt(1, c.max_tokens + 1).code() == StatusCode::kOutOfRange);
  CHECK(cache.begin_prompt(7, T).code() == StatusCode::kOutOfRange);
  REQUIRE(cache.begin_prompt(1, T).is_ok());
  CHECK(cache.begin_prompt(1, T).message().find("open prompt") != std::string::npos);
  CHECK(cache.begin_token(1).message().find("open prompt") != std::string::npos);
  CHECK(cache.prefill(2, 1, qr, kr, kr, outr).code() == StatusCode::kOutOfRange);
  CHECK(cache.prefill(0, 1, qr, {nullptr, ElementType::kF32}, kr, outr).code() == StatusCode::kInvalidArgument);
  REQUIRE(cache.prefill(0, 1, qr, kr, kr, outr).is_ok());
  CHECK(cache.prefill(0, 1, qr, kr, kr, outr).message().find("already filled") != std::string::npos);
  CHECK(cache.end_prompt(1).message().find("layer 1 of sequence 1 was never filled") != std::string::npos);
  REQUIRE(cache.prefill(1, 1, qr, kr, kr, outr).is_ok());
  REQUIRE(cache.end_prompt(1).is_ok());
  CHECK(cache.position(1) == T);
  CHECK(cache.live_tokens(1) == T);
  CHECK(cache.pinned_prefix(1) == T);
  CHECK(cache.end_prompt(1).message().find("no open prompt") != std::string::npos);
  // A prompt chunk or a later turn past max_tokens is refused.
  {
    const std::vector<int> one{1};
    const std::vector<float> k1(static_cast<std::size_t>(hkv) * d, 0.5f), q1(static_cast<std::size_t>(hq) * d, 0.25f);
    std::vector<float> o1(q1.size());
    REQUIRE(cache.begin_step(one).is_ok());
    for (int l = 0; l < c.num_layers; ++l) {
      REQUIRE(cache.append_batch(l, one, {k1.data(), ElementType::kF32}, {k1.data(), ElementType::kF32}).is_ok());
      REQUIRE(cache.attend_batch(l, one, {q1.data(), ElementType::kF32}, {o1.data(), ElementType::kF32}).is_ok());
    }
    REQUIRE(cache.end_step(one).is_ok());
    const Status e = cache.begin_prompt(1, c.max_tokens - 40);
    CHECK(e.code() == StatusCode::kOutOfRange);
    CHECK(e.message().find("at position 41 is out of range; allowed: 1..659") != std::string::npos);
    CHECK(cache.position(1) == 41);
  }
  // Equal keys and values: every causal output row is the value itself.
  for (float x : out) REQUIRE(x == 0.5f);
  // A NaN in a prompt's V faults the sequence alone once the prompt ends.
  REQUIRE(cache.begin_prompt(3, T).is_ok());
  std::vector<float> bad = k;
  bad[static_cast<std::size_t>(17) * hkv * d + 3] = std::numeric_limits<float>::quiet_NaN();
  REQUIRE(cache.prefill(0, 3, qr, kr, {bad.data(), ElementType::kF32}, outr).is_ok());
  REQUIRE(cache.prefill(1, 3, qr, kr, kr, outr).is_ok());
  REQUIRE(cache.end_prompt(3).is_ok());
  CHECK(cache.faulted(3));
  CHECK_FALSE(cache.faulted(1));
  CHECK(cache.begin_step(std::vector<int>{1, 3}).code() == StatusCode::kNonFinite);
  REQUIRE(cache.reset_sequence(3).is_ok());
  CHECK_FALSE(cache.faulted(3));
}

TEST_CASE("Prefill of a prompt the pools cannot hold is refused whole", "[batched][prefill][bad_input]") {
  ThinKvConfig c = small_config();
  c.pool_blocks = 12;  // per precision pool: 12 blocks of 16 slots
  ThinKvCache<> cache(c, small_policy());
  const std::int64_t before = cache.allocated_bytes();
  // 2 layers x 2 heads = 4 streams; 64 tokens need 4 blocks each = 16 > 12.
  const Status e = cache.begin_prompt(0, 64);
  CHECK(e.code() == StatusCode::kPoolExhausted);
  CHECK(e.message().find("begin_prompt(0) of 64 tokens") != std::string::npos);
  CHECK(cache.position(0) == 0);
  CHECK(cache.segments(0).empty());
  CHECK(cache.allocated_bytes() == before);
  CHECK(cache.begin_prompt(0, 48).is_ok());  // 3 blocks each = 12
}

namespace {

/// What a cache holds, whichever blocks hold it: every stream's live tokens in attention order
/// (position, segment, dequantized K/V bits), its staged rows and its memory.
std::vector<std::string> stored_contents(const ThinKvCache<>& cache) {
  std::vector<std::string> out;
  const BlockTable& t = cache.paged().table();
  const int d = cache.config().head_dim;
  std::vector<float> k(static_cast<std::size_t>(d)), v(k.size());
  for (int st = 0; st < t.num_streams(); ++st) {
    out.push_back("stream " + std::to_string(st) + " " + tt::describe(cache.paged().memory(st)));
    for (SlotRef r : t.live_slot_list(st)) {
      const Status e = cache.paged().read_token(r, k, v);
      out.push_back(std::to_string(t.slot_position(r)) + " " + std::to_string(t.slot_segment(r)) + " " + e.to_string() +
                    " " + tt::hex(k.data(), k.size() * 4) + " " + tt::hex(v.data(), v.size() * 4));
    }
    for (int row = 0; row < t.staged_count(st); ++row) {
      const Status e = cache.paged().backend().read_staged(st, row, k.data(), v.data());
      out.push_back("staged " + std::to_string(t.staged_position(st, row)) + " " +
                    std::to_string(t.staged_segment(st, row)) + " " + e.to_string() + " " +
                    tt::hex(k.data(), k.size() * 4) + " " + tt::hex(v.data(), v.size() * 4));
    }
  }
  out.push_back(tt::describe(cache.memory()));
  return out;
}

/// Random K/V/q of tokens [0, n) of one sequence, every layer: k, v [n][Hkv][D], q [n][Hq][D].
struct TokenData {
  std::vector<std::vector<float>> k, v, q;  // per layer
  TokenData(const ThinKvConfig& c, int n, std::mt19937_64& rng) {
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (int l = 0; l < c.num_layers; ++l) {
      k.emplace_back(static_cast<std::size_t>(n) * c.num_kv_heads * c.head_dim);
      v.emplace_back(k.back().size());
      q.emplace_back(static_cast<std::size_t>(n) * c.num_q_heads * c.head_dim);
      for (float& x : k.back()) x = nd(rng);
      for (float& x : v.back()) x = nd(rng);
      for (float& x : q.back()) x = 2.0f * nd(rng);
    }
  }
};

/// Tokens [lo, hi) through the one-token calls; their outputs appended to `outs`.
Status feed_tokens(ThinKvCache<>& cache, int seq, const TokenData& t, int lo, int hi, std::vector<float>& outs) {
  const ThinKvConfig& c = cache.config();
  const auto kn = static_cast<std::size_t>(c.num_kv_heads) * c.head_dim;
  const auto qn = static_cast<std::size_t>(c.num_q_heads) * c.head_dim;
  std::vector<float> out(qn);
  for (int p = lo; p < hi; ++p) {
    THINKV_RETURN_IF_ERROR(cache.begin_token(seq));
    for (int l = 0; l < c.num_layers; ++l) {
      const auto lu = static_cast<std::size_t>(l);
      const auto pu = static_cast<std::size_t>(p);
      THINKV_RETURN_IF_ERROR(cache.append(seq, l, std::span<const float>(t.k[lu]).subspan(pu * kn, kn),
                                          std::span<const float>(t.v[lu]).subspan(pu * kn, kn)));
      THINKV_RETURN_IF_ERROR(cache.attend(seq, l, std::span<const float>(t.q[lu]).subspan(pu * qn, qn), out));
      outs.insert(outs.end(), out.begin(), out.end());
    }
    THINKV_RETURN_IF_ERROR(cache.end_token(seq));
  }
  return Status::ok();
}

/// Tokens [lo, hi) as one chunk (begin_prompt / prefill / end_prompt), attended when `outs`.
Status feed_chunk(ThinKvCache<>& cache, int seq, const TokenData& t, int lo, int hi, std::vector<float>* outs) {
  const ThinKvConfig& c = cache.config();
  const auto kn = static_cast<std::size_t>(c.num_kv_heads) * c.head_dim;
  const auto qn = static_cast<std::size_t>(c.num_q_heads) * c.head_dim;
  const auto n = static_cast<std::size_t>(hi - lo), lu0 = static_cast<std::size_t>(lo);
  THINKV_RETURN_IF_ERROR(cache.begin_prompt(seq, hi - lo));
  std::vector<float> out(n * qn);
  for (int l = 0; l < c.num_layers; ++l) {
    const auto lu = static_cast<std::size_t>(l);
    const TensorRef k{t.k[lu].data() + lu0 * kn, ElementType::kF32}, v{t.v[lu].data() + lu0 * kn, ElementType::kF32};
    if (outs != nullptr) {
      THINKV_RETURN_IF_ERROR(
          cache.prefill(l, seq, {t.q[lu].data() + lu0 * qn, ElementType::kF32}, k, v, {out.data(), ElementType::kF32}));
      outs->insert(outs->end(), out.begin(), out.end());
    } else {
      THINKV_RETURN_IF_ERROR(cache.prefill(l, seq, {nullptr, ElementType::kF32}, k, v, {nullptr, ElementType::kF32}));
    }
  }
  return cache.end_prompt(seq);
}

}  // namespace

TEST_CASE("A prompt in chunks stores the bytes one prompt stores, and reserves exactly what it takes",
          "[batched][prefill]") {
  TT_SEEDED_RNG();
  const ThinKvConfig c = small_config();
  const int T = 83;
  const TokenData t(c, T, rng);  // stored only: the bytes do not depend on the attention
  ThinKvCache<> whole(c, small_policy());
  REQUIRE(feed_chunk(whole, 0, t, 0, T, nullptr).is_ok());
  // Cut inside a group (g = 8), at group and block (16) boundaries, across a segment (64), a
  // chunk of one token, and in random places.
  std::vector<std::vector<int>> cuts = {{0, 3, 8, 9, 16, 61, 70, 71, T}, {0, 1, 2, 3, T}, {0, 64, T}, {0, 82, T}};
  for (int r = 0; r < 4; ++r) {
    std::vector<int> cut{0, T};
    for (int i = 0; i < 5; ++i) cut.push_back(1 + static_cast<int>(rng() % (T - 1)));
    std::sort(cut.begin(), cut.end());
    cut.erase(std::unique(cut.begin(), cut.end()), cut.end());
    cuts.push_back(cut);
  }
  for (const std::vector<int>& cut : cuts) {
    ThinKvCache<> parts(c, small_policy());
    std::string where;
    for (std::size_t i = 0; i + 1 < cut.size(); ++i) {
      where += std::to_string(cut[i]) + " ";
      REQUIRE(feed_chunk(parts, 0, t, cut[i], cut[i + 1], nullptr).is_ok());
    }
    INFO("chunks starting at " << where);
    CHECK(parts.position(0) == T);
    CHECK(parts.pinned_prefix(0) == T);
    CHECK(tt::first_difference(stored_contents(whole), stored_contents(parts)) == "");
    REQUIRE(parts.segments(0).size() == whole.segments(0).size());
    for (std::size_t i = 0; i < parts.segments(0).size(); ++i) {
      CHECK(parts.segments(0)[i].start == whole.segments(0)[i].start);
      CHECK(parts.segments(0)[i].size == whole.segments(0)[i].size);
      CHECK(parts.segments(0)[i].pinned);
    }
  }
  // Pools: 12 blocks of 16 slots per precision, 4 streams. A prompt of 40 tokens takes 3 blocks
  // a stream (all 12), the third holding 8 free slots: a chunk of 8 more fits in them, a chunk
  // that completes one more group then needs a fresh block and is refused with nothing changed.
  ThinKvConfig small = c;
  small.pool_blocks = 12;
  ThinKvCache<> cache(small, small_policy());
  REQUIRE(feed_chunk(cache, 0, t, 0, 40, nullptr).is_ok());
  REQUIRE(feed_chunk(cache, 0, t, 40, 45, nullptr).is_ok());  // staged only
  const std::vector<std::string> before = tt::snapshot_cache(cache.paged());
  const Status e = cache.begin_prompt(0, 12);  // 5 staged + 12 = 2 groups: 16 slots, 8 free
  CHECK(e.code() == StatusCode::kPoolExhausted);
  CHECK(e.message().find("begin_prompt(0) of 12 tokens at position 45") != std::string::npos);
  CHECK(tt::snapshot_cache(cache.paged()) == before);
  CHECK(cache.position(0) == 45);
  CHECK(cache.pinned_prefix(0) == 45);
  REQUIRE(feed_chunk(cache, 0, t, 45, 48, nullptr).is_ok());  // 5 + 3 = one group, into the 8 free slots
  CHECK(cache.paged().table().slots_before_fresh_block(cache.stream_of(0, 1, 1), ThoughtType::kReasoning) == 0);
  REQUIRE(feed_chunk(cache, 0, t, 48, 55, nullptr).is_ok());             // staged only
  CHECK(cache.begin_prompt(0, 1).code() == StatusCode::kPoolExhausted);  // 7 + 1: a group, no free slot
  CHECK(cache.position(0) == 55);
}

TEST_CASE("A later turn after decoding is stored as the one-token calls store it between refreshes",
          "[batched][prefill]") {
  TT_SEEDED_RNG();
  ThinKvConfig c = small_config();
  c.token_budget = 0;  // no eviction: the two paths differ only where TBE would run
  const TokenData t(c, 240, rng);
  ThinKvCache<> chunked(c, small_policy()), tokens(c, small_policy());
  std::vector<float> oa, ob;
  for (ThinKvCache<>* cache : {&chunked, &tokens}) {
    std::vector<float>& o = cache == &chunked ? oa : ob;
    REQUIRE(feed_chunk(*cache, 1, t, 0, 20, nullptr).is_ok());  // the prompt, pinned
    REQUIRE(feed_tokens(*cache, 1, t, 20, 129, o).is_ok());     // refreshes at 64 and 128 (tau 64)
  }
  REQUIRE(oa == ob);
  const ThoughtType type = chunked.tracker(1).current();
  // Positions 129..190 hold no refresh step (192 is the next): the turn as one chunk, attended,
  // and the same tokens one at a time.
  std::vector<float> turn;
  REQUIRE(feed_chunk(chunked, 1, t, 129, 191, &turn).is_ok());
  REQUIRE(feed_tokens(tokens, 1, t, 129, 191, ob).is_ok());
  CHECK(chunked.position(1) == 191);
  CHECK(chunked.pinned_prefix(1) == 20);
  CHECK(chunked.tracker(1).current() == type);
  CHECK(chunked.tracker(1).stats().tokens == tokens.tracker(1).stats().tokens);
  for (float x : turn) REQUIRE(std::isfinite(x));
  auto same_storage = [&] {
    const BlockTable& ta = chunked.paged().table();
    const BlockTable& tb = tokens.paged().table();
    std::vector<float> ka(static_cast<std::size_t>(c.head_dim)), va(ka.size()), kb(ka.size()), vb(ka.size());
    for (int st = chunked.stream_of(1, 0, 0); st < chunked.stream_of(2, 0, 0); ++st) {
      INFO("stream " << st);
      const auto la = ta.live_slot_list(st), lb = tb.live_slot_list(st);
      REQUIRE(la.size() == lb.size());
      for (std::size_t i = 0; i < la.size(); ++i) {
        REQUIRE(ta.slot_position(la[i]) == tb.slot_position(lb[i]));
        REQUIRE(ta.slot_segment(la[i]) == tb.slot_segment(lb[i]));
        REQUIRE(ta.block_precision(la[i].block) == tb.block_precision(lb[i].block));
        REQUIRE(chunked.paged().read_token(la[i], ka, va).is_ok());
        REQUIRE(tokens.paged().read_token(lb[i], kb, vb).is_ok());
        REQUIRE(ka == kb);
        REQUIRE(va == vb);
      }
      REQUIRE(ta.staged_count(st) == tb.staged_count(st));
    }
    REQUIRE(chunked.segments(1).size() == tokens.segments(1).size());
    for (std::size_t i = 0; i < chunked.segments(1).size(); ++i) {
      CHECK(chunked.segments(1)[i].start == tokens.segments(1)[i].start);
      CHECK(chunked.segments(1)[i].size == tokens.segments(1)[i].size);
      CHECK(chunked.segments(1)[i].type == tokens.segments(1)[i].type);
      CHECK(chunked.segments(1)[i].pinned == tokens.segments(1)[i].pinned);
    }
  };
  same_storage();
  // Decoding on (a refresh at 192 reads the same sparsity over the same storage): the same bits.
  oa.clear();
  ob.clear();
  REQUIRE(feed_tokens(chunked, 1, t, 191, 240, oa).is_ok());
  REQUIRE(feed_tokens(tokens, 1, t, 191, 240, ob).is_ok());
  CHECK(oa == ob);
  same_storage();
  CHECK(chunked.tracker(1).stats().tokens == tokens.tracker(1).stats().tokens);
}

TEST_CASE("A later turn that takes a sequence over its budget is evicted back within it by TBE", "[batched][prefill]") {
  TT_SEEDED_RNG();
  const ThinKvConfig c = small_config();  // budget 160, segments of 64, retention 32/16/8/4
  const TokenData t(c, 520, rng);
  ThinKvCache<> cache(c, small_policy());
  std::vector<float> o;
  REQUIRE(feed_chunk(cache, 0, t, 0, 16, &o).is_ok());
  REQUIRE(feed_tokens(cache, 0, t, 16, 150, o).is_ok());
  const std::int64_t evicted = cache.stats().tokens_evicted;
  const std::int64_t live_before = cache.live_tokens(0);
  std::vector<float> turn;
  REQUIRE(feed_chunk(cache, 0, t, 150, 450, &turn).is_ok());  // 300 tokens in one turn
  for (float x : turn) REQUIRE(std::isfinite(x));
  CHECK(cache.position(0) == 450);
  CHECK(cache.pinned_prefix(0) == 16);
  CHECK(cache.stats().tokens_evicted > evicted);
  // Within budget + the open segment (or every closed segment at the minimum, 4 tokens).
  std::int64_t closed = 0;
  for (const SegmentState& seg : cache.segments(0)) closed += seg.closed && !seg.pinned ? 1 : 0;
  const std::int64_t bound = std::max<std::int64_t>(c.token_budget, 4 * closed) + c.segment_len;
  INFO("live before the turn " << live_before << ", after " << cache.live_tokens(0));
  CHECK(cache.live_tokens(0) - 16 <= bound);
  // Every segment's live count in every stream is its recorded size.
  const BlockTable& table = cache.paged().table();
  std::vector<SlotRef> slots;
  for (const SegmentState& seg : cache.segments(0)) {
    for (int st = cache.stream_of(0, 0, 0); st < cache.stream_of(1, 0, 0); ++st) {
      table.live_segment_slots(st, seg.id, slots);
      std::int64_t staged = 0;
      for (int r = 0; r < table.staged_count(st); ++r) staged += table.staged_segment(st, r) == seg.id ? 1 : 0;
      REQUIRE(static_cast<std::int64_t>(slots.size()) + staged == seg.size);
    }
  }
  REQUIRE(feed_tokens(cache, 0, t, 450, 520, o).is_ok());  // decoding goes on
  CHECK(cache.live_tokens(0) - 16 <= std::max<std::int64_t>(c.token_budget, 4 * 12) + c.segment_len + 1);
}

TEST_CASE("A ubatch of several sequences (a prompt, a prompt's next chunk, a later turn) in one call per layer",
          "[batched][prefill]") {
  TT_SEEDED_RNG();
  const ThinKvConfig c = small_config();
  const std::vector<int> seqs{0, 1, 2}, counts{25, 20, 40};
  std::vector<TokenData> data;
  for (int i = 0; i < 3; ++i) data.emplace_back(c, 130, rng);
  ThinKvCache<> batched(c, small_policy()), single(c, small_policy());
  for (ThinKvCache<>* cache : {&batched, &single}) {
    std::vector<float> o;
    REQUIRE(feed_chunk(*cache, 1, data[1], 0, 30, nullptr).is_ok());  // a prompt's first chunk
    REQUIRE(feed_chunk(*cache, 2, data[2], 0, 10, nullptr).is_ok());
    REQUIRE(feed_tokens(*cache, 2, data[2], 10, 90, o).is_ok());  // decoded: a later turn comes next
  }
  const std::vector<int> starts{0, 30, 90};
  // The ubatch's rows: each sequence's tokens in order, concatenated.
  const auto kn = static_cast<std::size_t>(c.num_kv_heads) * c.head_dim;
  const auto qn = static_cast<std::size_t>(c.num_q_heads) * c.head_dim;
  auto rows_of = [&](int l, auto member, std::size_t width) {
    std::vector<float> x;
    for (std::size_t i = 0; i < 3; ++i) {
      const std::vector<float>& src = (data[i].*member)[static_cast<std::size_t>(l)];
      const auto lo = static_cast<std::size_t>(starts[i]) * width;
      x.insert(x.end(), src.begin() + static_cast<std::ptrdiff_t>(lo),
               src.begin() + static_cast<std::ptrdiff_t>(lo + static_cast<std::size_t>(counts[i]) * width));
    }
    return x;
  };
  const std::size_t rows = 85;
  // All or nothing: bad batches change nothing.
  const std::vector<std::string> before = stored_contents(batched);
  CHECK(batched.begin_prompts(std::vector<int>{0, 0}, std::vector<int>{5, 5}).message().find("named twice") !=
        std::string::npos);
  CHECK(batched.begin_prompts(seqs, std::vector<int>{5, 5}).code() == StatusCode::kInvalidArgument);
  CHECK(batched.begin_prompts(seqs, std::vector<int>{5, 5, c.max_tokens}).code() == StatusCode::kOutOfRange);
  CHECK(stored_contents(batched) == before);
  CHECK(batched.position(0) == 0);
  CHECK(batched.position(2) == 90);
  REQUIRE(batched.begin_prompts(seqs, counts).is_ok());
  for (int i = 0; i < 3; ++i)
    REQUIRE(single.begin_prompt(seqs[static_cast<std::size_t>(i)], counts[static_cast<std::size_t>(i)]).is_ok());
  for (int l = 0; l < c.num_layers; ++l) {
    const std::vector<float> k = rows_of(l, &TokenData::k, kn), v = rows_of(l, &TokenData::v, kn),
                             q = rows_of(l, &TokenData::q, qn);
    std::vector<float> out(rows * qn, std::numeric_limits<float>::quiet_NaN()), ref(out.size(), -1.0f);
    if (l == 0) {  // a sequence without an open prompt: refused before anything is enqueued
      CHECK(batched
                .prefill_batch(l, std::vector<int>{0, 3}, {q.data(), ElementType::kF32}, {k.data(), ElementType::kF32},
                               {v.data(), ElementType::kF32}, {out.data(), ElementType::kF32})
                .message()
                .find("sequence 3 has no open prompt") != std::string::npos);
    }
    REQUIRE(batched
                .prefill_batch(l, seqs, {q.data(), ElementType::kF32}, {k.data(), ElementType::kF32},
                               {v.data(), ElementType::kF32}, {out.data(), ElementType::kF32})
                .is_ok());
    std::size_t row = 0;
    for (std::size_t i = 0; i < 3; ++i) {
      REQUIRE(single
                  .prefill(l, seqs[i], {q.data() + row * qn, ElementType::kF32},
                           {k.data() + row * kn, ElementType::kF32}, {v.data() + row * kn, ElementType::kF32},
                           {ref.data() + row * qn, ElementType::kF32})
                  .is_ok());
      row += static_cast<std::size_t>(counts[i]);
    }
    CHECK(std::memcmp(out.data(), ref.data(), out.size() * 4) == 0);  // the same bits, every row written
    if (l == 0) {  // one layer missing: end_prompts refuses, nothing closed
      CHECK(batched.end_prompts(seqs).message().find("layer 1 of sequence 0 was never filled") != std::string::npos);
      CHECK(batched.position(1) == 30);
    }
  }
  // A sequence without an open prompt at the end of the batch: refused before any is closed.
  CHECK(batched.end_prompts(std::vector<int>{0, 1, 2, 3}).message().find("sequence 3 has no open prompt") !=
        std::string::npos);
  CHECK(batched.position(0) == 0);
  REQUIRE(batched.end_prompts(seqs).is_ok());
  for (int seq : seqs) REQUIRE(single.end_prompt(seq).is_ok());
  for (std::size_t i = 0; i < 3; ++i) CHECK(batched.position(seqs[i]) == starts[i] + counts[i]);
  CHECK(batched.pinned_prefix(0) == 25);
  CHECK(batched.pinned_prefix(1) == 50);
  CHECK(batched.pinned_prefix(2) == 10);
  CHECK(tt::first_difference(stored_contents(single), stored_contents(batched)) == "");
}

TEST_CASE("begin_prompts reserves the pools for the whole ubatch, or changes nothing",
          "[batched][prefill][bad_input]") {
  ThinKvConfig c = small_config();
  c.pool_blocks = 12;  // 4 streams a sequence: 48 tokens take all 12 blocks
  ThinKvCache<> cache(c, small_policy());
  const std::int64_t allocated = cache.allocated_bytes();
  const Status e = cache.begin_prompts(std::vector<int>{0, 1}, std::vector<int>{32, 24});  // 8 + 8 blocks
  CHECK(e.code() == StatusCode::kPoolExhausted);
  CHECK(e.message().find("begin_prompts of 2 sequences (56 tokens)") != std::string::npos);
  CHECK(cache.position(0) == 0);
  CHECK(cache.segments(0).empty());
  CHECK(cache.pinned_prefix(0) == 0);
  CHECK(cache.allocated_bytes() == allocated);
  CHECK(cache.begin_prompt(0, 48).is_ok());  // the pools are all there
}

TEST_CASE("One pool sized on its own (pool_blocks_by_precision) runs out alone, naming itself",
          "[batched][bad_input]") {
  ThinKvConfig c = small_config();
  const int nv = static_cast<int>(Precision::kNvfp4), tern = static_cast<int>(Precision::kTernary);
  c.pool_blocks_by_precision[nv] = 12;  // R and E (NVFP4): 12 blocks of 16 slots; T: the worst case
  ThinKvCache<> cache(c, small_policy());
  ThinKvCache<> worst(small_config(), small_policy());
  CHECK(cache.paged().config().pool_blocks[nv] == 12);
  CHECK(cache.paged().config().pool_blocks[tern] == worst.paged().config().pool_blocks[tern]);
  CHECK(worst.paged().config().pool_blocks[nv] > 12);
  // A prompt is stored as R: 4 streams x 4 blocks = 16 > 12.
  const std::int64_t before = cache.allocated_bytes();
  const Status e = cache.begin_prompt(0, 64);
  CHECK(e.code() == StatusCode::kPoolExhausted);
  CHECK(e.message().find("nvfp4") != std::string::npos);
  CHECK(cache.allocated_bytes() == before);
  CHECK(cache.begin_prompt(0, 48).is_ok());
  // A negative range is refused, naming the pool.
  ThinKvConfig bad = small_config();
  bad.pool_blocks_by_precision[tern] = -3;
  const Status v = bad.validate();
  CHECK(v.code() == StatusCode::kInvalidArgument);
  CHECK(v.message().find("pool_blocks_by_precision[ternary] -3") != std::string::npos);
}

TEST_CASE("Prefill with q and out null stores the prompt's K/V only", "[batched][prefill]") {
  TT_SEEDED_RNG();
  ThinKvConfig c = small_config();
  ThinKvCache<> attended(c, small_policy()), stored(c, small_policy());
  const int T = 53, hkv = c.num_kv_heads, hq = c.num_q_heads, d = c.head_dim;
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto fresh = [&](std::size_t n) {
    std::vector<float> x(n);
    for (float& y : x) y = nd(rng);
    return x;
  };
  const std::vector<float> q = fresh(static_cast<std::size_t>(T) * hq * d);
  std::vector<float> out(q.size(), -1.0f);
  const MutableTensorRef outr{out.data(), ElementType::kF32};
  std::vector<std::vector<float>> ks, vs;
  for (int l = 0; l < c.num_layers; ++l) {
    ks.push_back(fresh(static_cast<std::size_t>(T) * hkv * d));
    vs.push_back(fresh(ks.back().size()));
  }
  REQUIRE(attended.begin_prompt(2, T).is_ok());
  REQUIRE(stored.begin_prompt(2, T).is_ok());
  // Half a store-only call is refused, before anything is stored.
  const TensorRef k0{ks[0].data(), ElementType::kF32}, v0{vs[0].data(), ElementType::kF32};
  CHECK(stored.prefill(0, 2, {q.data(), ElementType::kF32}, k0, v0, {nullptr, ElementType::kF32}).code() ==
        StatusCode::kInvalidArgument);
  CHECK(stored.prefill(0, 2, {nullptr, ElementType::kF32}, k0, v0, outr).message().find("both null") !=
        std::string::npos);
  for (int l = 0; l < c.num_layers; ++l) {
    const TensorRef k{ks[static_cast<std::size_t>(l)].data(), ElementType::kF32},
        v{vs[static_cast<std::size_t>(l)].data(), ElementType::kF32};
    REQUIRE(attended.prefill(l, 2, {q.data(), ElementType::kF32}, k, v, outr).is_ok());
    REQUIRE(stored.prefill(l, 2, {nullptr, ElementType::kF32}, k, v, {nullptr, ElementType::kF32}).is_ok());
  }
  REQUIRE(attended.end_prompt(2).is_ok());
  REQUIRE(stored.end_prompt(2).is_ok());
  CHECK(stored.position(2) == T);
  CHECK(stored.live_tokens(2) == attended.live_tokens(2));
  CHECK(stored.memory(2).physical_bytes() == attended.memory(2).physical_bytes());
  // The same next step on both: the same output bits (the same K/V were stored).
  const std::vector<int> seqs{2};
  const std::vector<float> kn = fresh(static_cast<std::size_t>(hkv) * d), vn = fresh(kn.size()),
                           qn = fresh(static_cast<std::size_t>(hq) * d);
  std::vector<float> oa(qn.size()), ob(qn.size());
  for (auto* cache : {&attended, &stored}) {
    std::vector<float>& o = cache == &attended ? oa : ob;
    REQUIRE(cache->begin_step(seqs).is_ok());
    for (int l = 0; l < c.num_layers; ++l) {
      REQUIRE(cache->append_batch(l, seqs, {kn.data(), ElementType::kF32}, {vn.data(), ElementType::kF32}).is_ok());
      REQUIRE(cache->attend_batch(l, seqs, {qn.data(), ElementType::kF32}, {o.data(), ElementType::kF32}).is_ok());
    }
    REQUIRE(cache->end_step(seqs).is_ok());
  }
  CHECK(std::memcmp(oa.data(), ob.data(), oa.size() * sizeof(float)) == 0);
}
