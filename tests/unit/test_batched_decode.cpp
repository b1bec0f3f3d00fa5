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
  // The prompt may continue (below); once a token was decoded it may not.
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
    const Status e = cache.begin_prompt(1, T);
    CHECK(e.code() == StatusCode::kUnsupported);
    CHECK(e.message().find("at position 41: positions 40..40 were decoded") != std::string::npos);
    CHECK(cache.begin_prompt(1, c.max_tokens).code() == StatusCode::kUnsupported);
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

TEST_CASE("A prompt in chunks stores the bytes one prompt stores, and reserves exactly what it takes",
          "[batched][prefill]") {
  TT_SEEDED_RNG();
  const ThinKvConfig c = small_config();
  const int T = 83, hkv = c.num_kv_heads, d = c.head_dim;
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<std::vector<float>> ks, vs;
  for (int l = 0; l < c.num_layers; ++l) {
    ks.emplace_back(static_cast<std::size_t>(T) * hkv * d);
    vs.emplace_back(ks.back().size());
    for (float& x : ks.back()) x = nd(rng);
    for (float& x : vs.back()) x = nd(rng);
  }
  // Stores tokens [lo, hi) as one chunk (store only: the bytes do not depend on the attention).
  auto chunk = [&](ThinKvCache<>& cache, int seq, int lo, int hi) -> Status {
    THINKV_RETURN_IF_ERROR(cache.begin_prompt(seq, hi - lo));
    for (int l = 0; l < c.num_layers; ++l) {
      const auto off = static_cast<std::size_t>(lo) * hkv * d;
      const TensorRef k{ks[static_cast<std::size_t>(l)].data() + off, ElementType::kF32},
          v{vs[static_cast<std::size_t>(l)].data() + off, ElementType::kF32};
      THINKV_RETURN_IF_ERROR(cache.prefill(l, seq, {nullptr, ElementType::kF32}, k, v, {nullptr, ElementType::kF32}));
    }
    return cache.end_prompt(seq);
  };
  // What a cache holds, whichever blocks hold it: every stream's live tokens in attention order
  // (position, segment, dequantized K/V bits), its staged rows and its memory.
  auto contents = [&](const ThinKvCache<>& cache) {
    std::vector<std::string> out;
    const BlockTable& t = cache.paged().table();
    std::vector<float> k(static_cast<std::size_t>(d)), v(k.size());
    for (int st = 0; st < t.num_streams(); ++st) {
      out.push_back("stream " + std::to_string(st) + " " + tt::describe(cache.paged().memory(st)));
      for (SlotRef r : t.live_slot_list(st)) {
        REQUIRE(cache.paged().read_token(r, k, v).is_ok());
        out.push_back(std::to_string(t.slot_position(r)) + " " + std::to_string(t.slot_segment(r)) + " " +
                      tt::hex(k.data(), k.size() * 4) + " " + tt::hex(v.data(), v.size() * 4));
      }
      for (int row = 0; row < t.staged_count(st); ++row) {
        REQUIRE(cache.paged().backend().read_staged(st, row, k.data(), v.data()).is_ok());
        out.push_back("staged " + std::to_string(t.staged_position(st, row)) + " " +
                      std::to_string(t.staged_segment(st, row)) + " " + tt::hex(k.data(), k.size() * 4) + " " +
                      tt::hex(v.data(), v.size() * 4));
      }
    }
    out.push_back(tt::describe(cache.memory()));
    return out;
  };
  ThinKvCache<> whole(c, small_policy());
  REQUIRE(chunk(whole, 0, 0, T).is_ok());
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
      REQUIRE(chunk(parts, 0, cut[i], cut[i + 1]).is_ok());
    }
    INFO("chunks starting at " << where);
    CHECK(parts.position(0) == T);
    CHECK(parts.pinned_prefix(0) == T);
    CHECK(tt::first_difference(contents(whole), contents(parts)) == "");
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
  REQUIRE(chunk(cache, 0, 0, 40).is_ok());
  REQUIRE(chunk(cache, 0, 40, 45).is_ok());  // staged only
  const std::vector<std::string> before = tt::snapshot_cache(cache.paged());
  const Status e = cache.begin_prompt(0, 12);  // 5 staged + 12 = 2 groups: 16 slots, 8 free
  CHECK(e.code() == StatusCode::kPoolExhausted);
  CHECK(e.message().find("begin_prompt(0) of 12 tokens at position 45") != std::string::npos);
  CHECK(tt::snapshot_cache(cache.paged()) == before);
  CHECK(cache.position(0) == 45);
  CHECK(cache.pinned_prefix(0) == 45);
  REQUIRE(chunk(cache, 0, 45, 48).is_ok());  // 5 + 3 = one group, into the 8 free slots
  CHECK(cache.paged().table().slots_before_fresh_block(cache.stream_of(0, 1, 1), ThoughtType::kReasoning) == 0);
  REQUIRE(chunk(cache, 0, 48, 55).is_ok());                              // staged only
  CHECK(cache.begin_prompt(0, 1).code() == StatusCode::kPoolExhausted);  // 7 + 1: a group, no free slot
  CHECK(cache.position(0) == 55);
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
