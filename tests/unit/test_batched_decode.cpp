// The batched decode API of BasicThinKvCache (begin_step / append_batch / attend_batch /
// end_step) over the CPU backend: the same decisions and the same output bits as the one-
// sequence-at-a-time API, under continuous batching (joins, finishes, shuffled batch order), in
// every element type, and a sequence whose K/V holds NaN or Inf is faulted alone.

#include <catch2/catch.hpp>

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
  REQUIRE(cache.begin_step(batch).is_ok());
  // A second begin for an open token names it; nothing else begins.
  const std::vector<int> again{4, 2};
  e = cache.begin_step(again);
  CHECK(e.message().find("begin_token(2)") != std::string::npos);
  CHECK(cache.begin_token(4).is_ok());  // 4 did not begin above
  std::vector<float> k(2 * 2 * 16, 0.5f), q(2 * 4 * 16, 0.25f), out(q.size());
  // Attend before append, end before every layer: refused, naming layer and sequence.
  e = cache.attend_batch(0, batch, {q.data(), ElementType::kF32}, {out.data(), ElementType::kF32});
  CHECK(e.message().find("before its append") != std::string::npos);
  CHECK(cache.append_batch(0, batch, {nullptr, ElementType::kF32}, {k.data(), ElementType::kF32}).code() ==
        StatusCode::kInvalidArgument);
  REQUIRE(cache.append_batch(0, batch, {k.data(), ElementType::kF32}, {k.data(), ElementType::kF32}).is_ok());
  e = cache.append_batch(0, batch, {k.data(), ElementType::kF32}, {k.data(), ElementType::kF32});
  CHECK(e.message().find("already appended") != std::string::npos);
  e = cache.end_step(batch);
  CHECK(e.message().find("layer 1 of sequence 2 was never appended") != std::string::npos);
  CHECK(cache.position(2) == 0);
  REQUIRE(cache.attend_batch(0, batch, {q.data(), ElementType::kF32}, {out.data(), ElementType::kF32}).is_ok());
  REQUIRE(cache.append_batch(1, batch, {k.data(), ElementType::kF32}, {k.data(), ElementType::kF32}).is_ok());
  REQUIRE(cache.end_step(batch).is_ok());
  CHECK(cache.position(2) == 1);
  CHECK(cache.position(0) == 1);
  CHECK(cache.live_tokens(0) == 1);
}
