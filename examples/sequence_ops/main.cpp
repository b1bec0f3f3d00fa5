// sequence_ops: llama.cpp's sequence operations over ThinKV's compressed cache, as a runtime that
// forks, rolls back and saves sequences uses them (docs/design.md, "Sequence operations").
//
//   1. a prompt is decoded into sequence 0 and forked into sequences 1 and 2 (seq_cp, parallel
//      sampling): each copy continues on its own;
//   2. sequence 1 takes a speculative draft of 5 tokens and rejects the last 3 (seq_rm to the
//      end: a roll back); a roll back behind an already quantized group is refused with the
//      position to remove from instead;
//   3. sequence 2 is saved (llama_state_seq_get_data), loaded into sequence 3 (set_data), and both
//      decode the same next token: their attention outputs are bit for bit equal; a damaged state
//      is refused and changes nothing;
//   4. seq_keep(0) frees every other sequence.
//
// The model is left out: each token's post-RoPE K, V and queries are random. The run checks what it
// prints and exits non-zero when something is not as documented.
//
//   sequence_ops [--seed S]

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "thinkv/thinkv.hpp"

namespace {

constexpr int kLayers = 4, kKvHeads = 2, kQHeads = 8, kHeadDim = 64;

struct Token {  // one decoded token's inputs: per layer, K and V of every KV head and the queries
  std::vector<std::vector<float>> k, v, q;
};

Token random_token(std::mt19937& rng) {
  std::normal_distribution<float> normal;
  Token t;
  for (int l = 0; l < kLayers; ++l) {
    auto row = [&](int n) {
      std::vector<float> x(static_cast<std::size_t>(n));
      for (float& e : x) e = normal(rng);
      return x;
    };
    t.k.push_back(row(kKvHeads * kHeadDim));
    t.v.push_back(row(kKvHeads * kHeadDim));
    t.q.push_back(row(kQHeads * kHeadDim));
  }
  return t;
}

int failures = 0;
void expect(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "sequence_ops: FAILED: %s\n", what);
    ++failures;
  }
}

/// Decodes one token into `seq`; returns every layer's attention output (all query heads).
std::vector<float> decode(thinkv::ThinKvCache<>& cache, int seq, const Token& t) {
  std::vector<float> outs;
  auto check = [](thinkv::Status s) {
    if (!s.is_ok()) {
      std::fprintf(stderr, "sequence_ops: %s\n", s.to_string().c_str());
      std::exit(1);
    }
  };
  check(cache.begin_token(seq));
  for (int l = 0; l < kLayers; ++l) {
    std::vector<float> out(static_cast<std::size_t>(kQHeads * kHeadDim));
    check(cache.append(seq, l, t.k[static_cast<std::size_t>(l)], t.v[static_cast<std::size_t>(l)]));
    check(cache.attend(seq, l, t.q[static_cast<std::size_t>(l)], out));
    outs.insert(outs.end(), out.begin(), out.end());
  }
  check(cache.end_token(seq));
  return outs;
}

void show(const thinkv::ThinKvCache<>& cache, const char* when) {
  std::printf("%s\n", when);
  for (int s = 0; s < cache.config().num_sequences; ++s) {
    std::printf("  sequence %d: positions %d..%d, %lld live tokens per stream, %lld bytes held\n", s, cache.pos_min(s),
                cache.pos_max(s), static_cast<long long>(cache.live_tokens(s)),
                static_cast<long long>(cache.memory(s).physical_bytes()));
  }
}

}  // namespace

int main(int argc, char** argv) {
  unsigned seed = 1;
  if (argc == 3 && std::strcmp(argv[1], "--seed") == 0) {
    seed = static_cast<unsigned>(std::strtoul(argv[2], nullptr, 10));
  } else if (argc != 1) {
    std::fprintf(stderr, "usage: sequence_ops [--seed S]\n");
    return 2;
  }
  thinkv::ThinKvConfig cfg;
  cfg.num_sequences = 4;
  cfg.num_layers = kLayers;
  cfg.num_kv_heads = kKvHeads;
  cfg.num_q_heads = kQHeads;
  cfg.head_dim = kHeadDim;
  cfg.max_tokens = 1024;
  cfg.token_budget = 256;
  thinkv::ThinKvPolicy policy;  // R4E4T2, TBE with K-means; no calibration here: every token is R
  policy.precision = thinkv::kR4E4T2;
  thinkv::ThinKvCache<> cache(cfg, policy);
  std::mt19937 rng(seed);
  const int g = cfg.group_size;

  // 1. A prompt of 300 tokens (past the budget: TBE shrinks the older segments), then two forks.
  for (int t = 0; t < 300; ++t) (void)decode(cache, 0, random_token(rng));
  expect(cache.copy_sequence(0, 1).is_ok(), "seq_cp(0, 1)");
  expect(cache.copy_sequence(0, 2).is_ok(), "seq_cp(0, 2)");
  expect(cache.copy_sequence(0, 1).code() == thinkv::StatusCode::kInvalidArgument,
         "a copy into a sequence that holds tokens is refused (reset it first)");
  for (int s = 0; s < 3; ++s) {
    for (int t = 0; t < 10; ++t) (void)decode(cache, s, random_token(rng));
  }
  show(cache, "after a 300-token prompt in sequence 0, two forks, and 10 tokens of each:");

  // 2. A speculative draft: 5 tokens, the last 3 rejected. Inside the open quantization group a
  //    roll back is exact; behind it only to a multiple of group_size.
  const int before = cache.position(1);
  for (int t = 0; t < 5; ++t) (void)decode(cache, 1, random_token(rng));
  const thinkv::Status rb = cache.remove(1, before + 2, -1);
  std::printf("\nseq_rm(1, %d, -1) after a 5-token draft: %s; sequence 1 continues at %d\n", before + 2,
              rb.is_ok() ? "ok" : rb.to_string().c_str(), cache.position(1));
  if (rb.is_ok()) expect(cache.position(1) == before + 2, "the roll back continues at p0");
  const std::int32_t deep = cache.position(1) / g * g - 3;  // inside a group already quantized
  const thinkv::Status refused = cache.remove(1, deep, -1);
  std::printf("seq_rm(1, %d, -1): %s\n", deep, refused.to_string().c_str());
  expect(refused.code() == thinkv::StatusCode::kUnsupported, "a roll back into a quantized group is refused");
  const std::int32_t aligned = deep / g * g;
  expect(cache.remove(1, aligned, -1).is_ok(), "a roll back to a multiple of group_size is exact");
  std::printf("seq_rm(1, %d, -1): ok; the runtime decodes positions %d.. again\n", aligned, aligned);

  // 3. Save sequence 2, load it into sequence 3: the two continue alike, bit for bit.
  std::vector<std::uint8_t> state;
  expect(cache.save_sequence(2, state).is_ok(), "save_sequence(2)");
  std::vector<std::uint8_t> damaged = state;
  damaged[damaged.size() / 2] ^= 0x10;
  const thinkv::Status bad = cache.load_sequence(3, damaged);
  std::printf("\nload_sequence(3, a state with one flipped bit): %s\n", bad.to_string().c_str());
  expect(bad.code() == thinkv::StatusCode::kCorruptData && cache.position(3) == 0,
         "a damaged state is refused and changes nothing");
  expect(cache.load_sequence(3, state).is_ok(), "load_sequence(3)");
  const Token next = random_token(rng);
  const std::vector<float> a = decode(cache, 2, next), b = decode(cache, 3, next);
  const bool same = std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  std::printf("saved %zu bytes of sequence 2, loaded them into sequence 3; the next token's attention in both: %s\n",
              state.size(), same ? "bit for bit equal" : "DIFFERENT");
  expect(same, "a loaded sequence decodes exactly as the saved one");
  show(cache, "\nafter the roll back, the save and the load:");

  // 4. seq_keep(0): every other sequence goes, its blocks back to the pools.
  const long long held = cache.allocated_bytes();
  expect(cache.keep_only(0).is_ok(), "keep_only(0)");
  show(cache, "\nafter seq_keep(0):");
  std::printf("allocated bytes: %lld before seq_keep, %lld after\n", held,
              static_cast<long long>(cache.allocated_bytes()));
  for (int s = 1; s < cfg.num_sequences; ++s) expect(cache.pos_max(s) == -1, "seq_keep frees the others");

  if (failures != 0) return 1;
  std::printf("\nall operations behaved as documented\n");
  return 0;
}
