// What llama.cpp's sequence operations cost on a ThinKvCache (CPU backend, host work only: the
// operations move no K/V data): one sequence at Llama-3-8B's KV geometry (32 layers x 8 KV heads,
// head_dim 128: 256 streams), R4E4T2 pages, budget 1,024, decoded to `tokens` positions (K/V
// stored without attention; the eviction keeps each segment's last tokens, which costs the same
// here as K-means would for these operations). The first argument is `tokens` (4,096; the
// ctest smoke run takes 320). Each benchmark times one call:
//   RemoveTail/n       remove(seq, P - n, -1) at a group boundary (a speculative decoder's roll back
//                      of n tokens; the tokens are decoded again outside the timing)
//   RemoveInGroup/n    the same inside the open quantization group (n < P % group_size)
//   RemoveMiddle/n     remove(seq, p, p + n) in the budget-shrunk history (a new range each time)
//   PosMin             pos_min(seq): the blocks holding the first non-empty segment
//   SaveSequence       save_sequence(seq, bytes) (llama_state_seq_get_data): every held page,
//                      record, scale and the metadata, into a checksummed byte vector
//   LoadSequence       load_sequence(seq, bytes) into an empty sequence (llama_state_seq_set_data),
//                      checks and checksum included; the reset that empties it is not timed
//   CopySequence       copy_sequence(0, 1) (llama_memory_seq_cp) into an empty sequence: the
//                      source's snapshot and its load, no codec; the reset is not timed
//   CopyPinnedPrompt   copy_sequence(0, 1) of a sequence whose first `prompt` positions are pinned
//                      (a shared system prompt, parallel sampling), with share_prompt_blocks on
//                      (the prompt's full blocks shared, not copied) or off (a whole copy);
//                      (arguments: tokens, prompt, share); copy_MB = the bytes the copy adds to
//                      what the cache holds
//   Ubatch/n           a ubatch of later turns (a user's next message after decoding), n tokens
//                      for each of 4 sequences holding the same history (copies of sequence 0):
//                      begin_prompts, prefill_batch of every layer storing K/V only (q and out
//                      null: on this CPU backend the attention would dominate), end_prompts (TBE
//                      back within budget); the turn is removed again outside the timing.
//                      rows_per_s = tokens stored per second (4 x n per ubatch)
//   ContextShift/n     shift_positions(seq, 64 + n, -1, -n) (llama_memory_seq_add) after
//                      remove(seq, 64, 64 + n) (not timed): llama.cpp's context shift, with BF16
//                      pages (precision map kFullKvMap; quantized pages refuse a shift): every
//                      held key after the removed block is read, rotated and written back
// Counters: held = live tokens per stream, streams = 256, state_MB = the saved state's size,
// GB/s = its bytes per second of the call; keys_M = keys rotated per shift (millions, the mean).
//   bench_sequence_ops --benchmark_filter=/4096 --benchmark_counters_tabular=true

#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "thinkv/thinkv_cache.hpp"

namespace {

using Policy = thinkv::CachePolicy<thinkv::SingleThought, thinkv::PrecisionMap, thinkv::RetentionSchedule,
                                   thinkv::SegmentSelector>;
using Cache = thinkv::BasicThinKvCache<Policy>;

thinkv::ThinKvConfig config(int tokens) {
  thinkv::ThinKvConfig c;
  c.num_layers = 32;
  c.num_kv_heads = 8;
  c.num_q_heads = 32;
  c.head_dim = 128;
  c.max_tokens = tokens + 64;
  c.token_budget = 1024;
  return c;
}

Policy policy() {
  Policy p;
  p.precision = thinkv::kR4E4T2;
  p.selector = thinkv::SegmentSelector{thinkv::SegmentSelection::kLast, {}};
  return p;
}

/// Decodes `n` tokens of sequence 0 (K/V only).
bool decode(Cache& cache, int n, std::mt19937& rng) {
  const auto& c = cache.config();
  std::normal_distribution<float> normal;
  std::vector<float> k(static_cast<std::size_t>(c.num_kv_heads * c.head_dim)), v(k.size());
  for (int t = 0; t < n; ++t) {
    if (!cache.begin_token(0).is_ok()) return false;
    for (int l = 0; l < c.num_layers; ++l) {
      for (auto& x : k) x = normal(rng);
      for (auto& x : v) x = normal(rng);
      if (!cache.append(0, l, k, v).is_ok()) return false;
    }
    if (!cache.end_token(0).is_ok()) return false;
  }
  return true;
}

void counters(benchmark::State& state, const Cache& cache) {
  state.counters["held"] = static_cast<double>(cache.live_tokens(0));
  state.counters["streams"] = cache.config().streams_per_sequence();
}

void BM_RemoveTail(benchmark::State& state) {
  const int tokens = static_cast<int>(state.range(0)), n = static_cast<int>(state.range(1));
  Cache cache(config(tokens), policy());
  std::mt19937 rng(7);
  if (!decode(cache, tokens, rng)) state.SkipWithError("decode failed");
  for (auto _ : state) {
    const std::int32_t p = cache.position(0);
    if (!cache.remove(0, p - n, -1).is_ok()) state.SkipWithError("remove failed");
    state.PauseTiming();
    if (!decode(cache, n, rng)) state.SkipWithError("decode failed");
    state.ResumeTiming();
  }
  counters(state, cache);
}
BENCHMARK(BM_RemoveTail)
    ->Args({320, 16})
    ->Args({4096, 16})
    ->Args({4096, 64})
    ->Iterations(50)
    ->Unit(benchmark::kMillisecond);

void BM_RemoveInGroup(benchmark::State& state) {
  const int tokens = static_cast<int>(state.range(0)), n = static_cast<int>(state.range(1));
  Cache cache(config(tokens + 12), policy());
  std::mt19937 rng(7);
  if (!decode(cache, tokens + 12, rng)) state.SkipWithError("decode failed");  // 12 tokens staged
  for (auto _ : state) {
    const std::int32_t p = cache.position(0);
    if (!cache.remove(0, p - n, -1).is_ok()) state.SkipWithError("remove failed");
    state.PauseTiming();
    if (!decode(cache, n, rng)) state.SkipWithError("decode failed");
    state.ResumeTiming();
  }
  counters(state, cache);
}
BENCHMARK(BM_RemoveInGroup)->Args({320, 4})->Args({4096, 4})->Iterations(200)->Unit(benchmark::kMillisecond);

void BM_RemoveMiddle(benchmark::State& state) {
  const int tokens = static_cast<int>(state.range(0)), n = static_cast<int>(state.range(1));
  Cache cache(config(tokens), policy());
  std::mt19937 rng(7);
  if (!decode(cache, tokens, rng)) state.SkipWithError("decode failed");
  std::int32_t p = 0;
  for (auto _ : state) {
    if (!cache.remove(0, p, p + n).is_ok()) state.SkipWithError("remove failed");
    p += n;  // the next range (32 x 64 positions: inside the history of 4,096)
  }
  counters(state, cache);
}
BENCHMARK(BM_RemoveMiddle)->Args({320, 64})->Args({4096, 64})->Iterations(32)->Unit(benchmark::kMillisecond);

void BM_PosMin(benchmark::State& state) {
  const int tokens = static_cast<int>(state.range(0));
  Cache cache(config(tokens), policy());
  std::mt19937 rng(7);
  if (!decode(cache, tokens, rng)) state.SkipWithError("decode failed");
  for (auto _ : state) benchmark::DoNotOptimize(cache.pos_min(0));
  counters(state, cache);
}
BENCHMARK(BM_PosMin)->Arg(320)->Arg(4096)->Unit(benchmark::kMillisecond);

Cache two_sequences(int tokens) {
  thinkv::ThinKvConfig c = config(tokens);
  c.num_sequences = 2;
  return Cache(c, policy());
}
void state_counters(benchmark::State& state, const Cache& cache, std::size_t bytes) {
  counters(state, cache);
  state.counters["state_MB"] = static_cast<double>(bytes) / 1e6;
  state.counters["GB/s"] = benchmark::Counter(
      static_cast<double>(bytes) * static_cast<double>(state.iterations()) / 1e9, benchmark::Counter::kIsRate);
}

void BM_SaveSequence(benchmark::State& state) {
  const int tokens = static_cast<int>(state.range(0));
  Cache cache = two_sequences(tokens);
  std::mt19937 rng(7);
  if (!decode(cache, tokens, rng)) state.SkipWithError("decode failed");
  std::vector<std::uint8_t> bytes;
  for (auto _ : state) {
    if (!cache.save_sequence(0, bytes).is_ok()) state.SkipWithError("save failed");
  }
  state_counters(state, cache, bytes.size());
}
BENCHMARK(BM_SaveSequence)->Arg(320)->Arg(4096)->Unit(benchmark::kMillisecond);

void BM_LoadSequence(benchmark::State& state) {
  const int tokens = static_cast<int>(state.range(0));
  Cache cache = two_sequences(tokens);
  std::mt19937 rng(7);
  if (!decode(cache, tokens, rng)) state.SkipWithError("decode failed");
  std::vector<std::uint8_t> bytes;
  if (!cache.save_sequence(0, bytes).is_ok()) state.SkipWithError("save failed");
  for (auto _ : state) {
    if (!cache.load_sequence(1, bytes).is_ok()) state.SkipWithError("load failed");
    state.PauseTiming();
    if (!cache.reset_sequence(1).is_ok()) state.SkipWithError("reset failed");
    state.ResumeTiming();
  }
  state_counters(state, cache, bytes.size());
}
BENCHMARK(BM_LoadSequence)->Arg(320)->Arg(4096)->Unit(benchmark::kMillisecond);

void BM_CopySequence(benchmark::State& state) {
  const int tokens = static_cast<int>(state.range(0));
  Cache cache = two_sequences(tokens);
  std::mt19937 rng(7);
  if (!decode(cache, tokens, rng)) state.SkipWithError("decode failed");
  std::vector<std::uint8_t> bytes;  // the state's size, for the same GB/s as save and load
  if (!cache.save_sequence(0, bytes).is_ok()) state.SkipWithError("save failed");
  for (auto _ : state) {
    if (!cache.copy_sequence(0, 1).is_ok()) state.SkipWithError("copy failed");
    state.PauseTiming();
    if (!cache.reset_sequence(1).is_ok()) state.SkipWithError("reset failed");
    state.ResumeTiming();
  }
  state_counters(state, cache, bytes.size());
}
BENCHMARK(BM_CopySequence)->Arg(320)->Arg(4096)->Unit(benchmark::kMillisecond);

void BM_CopyPinnedPrompt(benchmark::State& state) {
  const int tokens = static_cast<int>(state.range(0)), prompt = static_cast<int>(state.range(1));
  thinkv::ThinKvConfig c = config(tokens);
  c.num_sequences = 2;
  c.pinned_prefix = prompt;
  c.share_prompt_blocks = state.range(2) != 0;
  Cache cache(c, policy());
  std::mt19937 rng(7);
  if (!decode(cache, tokens, rng)) state.SkipWithError("decode failed");
  const std::int64_t before = cache.memory().physical_bytes();
  std::int64_t added = 0;
  for (auto _ : state) {
    if (!cache.copy_sequence(0, 1).is_ok()) state.SkipWithError("copy failed");
    state.PauseTiming();
    added = cache.memory().physical_bytes() - before;
    state.counters["shared_blocks"] = static_cast<double>(cache.memory(1).blocks_shared);
    if (!cache.reset_sequence(1).is_ok()) state.SkipWithError("reset failed");
    state.ResumeTiming();
  }
  counters(state, cache);
  state.counters["source_MB"] = static_cast<double>(before) / 1e6;
  state.counters["copy_MB"] = static_cast<double>(added) / 1e6;
}
BENCHMARK(BM_CopyPinnedPrompt)
    ->Args({320, 128, 1})
    ->Args({4096, 2048, 0})
    ->Args({4096, 2048, 1})
    ->Unit(benchmark::kMillisecond);

void BM_ContextShift(benchmark::State& state) {
  const int tokens = static_cast<int>(state.range(0)), n = static_cast<int>(state.range(1));
  Policy p = policy();
  p.precision = thinkv::kFullKvMap;
  Cache cache(config(tokens), p);
  std::mt19937 rng(7);
  if (!decode(cache, tokens, rng)) state.SkipWithError("decode failed");
  const thinkv::RopeSpec rope;  // Llama's: theta 10,000, adjacent pairs
  double keys = 0;              // summed over the iterations
  for (auto _ : state) {
    state.PauseTiming();
    if (!cache.remove(0, 64, 64 + n).is_ok()) state.SkipWithError("remove failed");
    for (int st = 0; st < cache.config().streams_per_sequence(); ++st) {
      for (const thinkv::SlotRef r : cache.paged().table().live_slot_list(st)) {
        keys += cache.paged().table().slot_position(r) >= 64 + n ? 1 : 0;
      }
      keys += cache.paged().table().staged_count(st);
    }
    state.ResumeTiming();
    if (!cache.shift_positions(0, 64 + n, -1, -n, rope).is_ok()) state.SkipWithError("shift failed");
  }
  counters(state, cache);
  state.counters["keys_M"] = keys / static_cast<double>(state.iterations()) / 1e6;  // per shift
}
BENCHMARK(BM_ContextShift)->Args({320, 32})->Args({4096, 256})->Iterations(8)->Unit(benchmark::kMillisecond);

void BM_Ubatch(benchmark::State& state) {
  const int tokens = static_cast<int>(state.range(0)), n = static_cast<int>(state.range(1));
  constexpr int kSeqs = 4;
  thinkv::ThinKvConfig c = config(tokens);
  c.num_sequences = kSeqs;
  c.max_tokens = tokens + n + 64;
  Cache cache(c, policy());
  std::mt19937 rng(7);
  if (!decode(cache, tokens, rng)) state.SkipWithError("decode failed");
  for (int seq = 1; seq < kSeqs; ++seq) {
    if (!cache.copy_sequence(0, seq).is_ok()) state.SkipWithError("copy failed");
  }
  // The ubatch's K/V: kSeqs x n rows of [KV heads, head_dim], one buffer per layer call.
  std::normal_distribution<float> normal;
  std::vector<float> k(static_cast<std::size_t>(kSeqs) * n * c.num_kv_heads * c.head_dim), v(k.size());
  for (auto& x : k) x = normal(rng);
  for (auto& x : v) x = normal(rng);
  const int seqs[kSeqs] = {0, 1, 2, 3};
  int counts[kSeqs];
  std::fill(counts, counts + kSeqs, n);
  const thinkv::TensorRef none{nullptr, thinkv::ElementType::kF32};
  for (auto _ : state) {
    if (!cache.begin_prompts(seqs, counts).is_ok()) state.SkipWithError("begin_prompts failed");
    for (int l = 0; l < c.num_layers; ++l) {
      if (!cache
               .prefill_batch(l, seqs, none, {k.data(), thinkv::ElementType::kF32},
                              {v.data(), thinkv::ElementType::kF32}, {nullptr, thinkv::ElementType::kF32})
               .is_ok()) {
        state.SkipWithError("prefill_batch failed");
      }
    }
    if (!cache.end_prompts(seqs).is_ok()) state.SkipWithError("end_prompts failed");
    state.PauseTiming();  // the turn rolled back: every iteration stores a turn at the same positions
    for (int seq : seqs) {
      if (!cache.remove(seq, tokens, -1).is_ok()) state.SkipWithError("remove failed");
    }
    state.ResumeTiming();
  }
  counters(state, cache);
  state.counters["rows_per_s"] =
      benchmark::Counter(static_cast<double>(state.iterations()) * kSeqs * n, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_Ubatch)->Args({320, 16})->Args({4096, 16})->Args({4096, 128})->Unit(benchmark::kMillisecond);

}  // namespace
