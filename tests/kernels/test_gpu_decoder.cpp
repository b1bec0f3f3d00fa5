// GPU test: the GPU decoder (examples/decoder/gpu_transformer.hpp) against the CPU decoder
// (transformer.hpp) on real model files: stories260K (head_dim 8) and the testbed reasoning model
// (head_dim 32, GQA 3:1). Several sequences join at different steps and decode together
// (continuous batching, the batch order shuffled every step); each sequence's inputs are then
// replayed one token at a time through the CPU decoder with the same cache configuration over the
// CPU backend, and the logits of every step compared.
//
// Tolerances (measured on an NVIDIA H200, see the printed lines): the GPU computes the same
// expression in another order (cuBLAS GEMMs, tree reductions, FMA), so logits differ by rounding;
// the cache stores K/V in BF16 on both sides, where a value on a rounding boundary can land one
// BF16 step apart. FullKV with FP32 weights: max |logit difference| <= 5e-3 x max |logit| + 1e-4
// per step (measured on 2026-12-03: 3.0e-4 on stories260K, 2.6e-3 on the testbed), and the greedy
// token equal wherever the CPU's top-two margin exceeds twice that bound. BF16 weights (the GEMM
// inputs rounded to BF16 too) against a CPU model whose weights were rounded to BF16: 1e-1 x
// max |logit| (measured 5.5e-2 and 2.5e-2). The per-step error has a tail (a BF16 K/V value one
// step apart stays in the cache for every later step): on an NVIDIA H100 on 2026-12-06, four
// seeds of the testbed case gave worst steps of 1.7e-3..5.4e-3 (FP32 weights) and 2.5e-2..1.74e-1
// (BF16 weights), each time one step of 1000 past the bound. So up to 1% of the steps may pass
// the bound, none by more than 4x. A wrong position, RoPE or layer gives O(1) on most steps.
// ThinKV (R4E4T2, TBE) cannot be
// compared step for step: a key a rounding apart may take another E2M1 code, and K-means then another token; there the
// GPU run must evict, stay in budget and agree with the CPU on most greedy tokens.
//
// Models: $THINKV_MODELS, <repo>/models, <repo>/../shared/models (a model not found is skipped).

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <random>
#include <vector>

#include "../unit/test_util.hpp"
#include "decoder/decoder.hpp"
#include "decoder/gpu_transformer.hpp"
#include "gpu_decoder_test_util.hpp"

using namespace thinkv;
using namespace thinkv::decoder;
namespace fs = std::filesystem;
using tt::find_model_file;
using tt::load_or_skip;
using tt::spec_for;

namespace {

/// Rounds every matrix of a model to BF16 (F32 copies it owns): what the GPU decoder computes
/// with BF16 weights.
void round_to_bf16(Model& r) {
  auto round = [&](Matrix& x) {
    std::vector<float> f(static_cast<std::size_t>(x.rows * x.cols));
    for (std::int64_t i = 0; i < x.rows; ++i) x.row(i, f.data() + i * x.cols);
    for (float& v : f) {
      std::uint32_t u = 0;
      std::memcpy(&u, &v, 4);
      u += 0x7FFFu + ((u >> 16) & 1u);
      u &= 0xFFFF0000u;
      std::memcpy(&v, &u, 4);
    }
    r.owned.push_back(std::move(f));
    Matrix out;
    out.rows = x.rows;
    out.cols = x.cols;
    out.type = WeightType::kF32;
    out.f32 = r.owned.back().data();
    x = out;
  };
  r.owned.reserve(r.owned.size() + 2 + 7 * r.layers.size());
  round(r.tok_embeddings);
  round(r.output);
  for (LayerWeights& w : r.layers) {
    for (Matrix* x : {&w.wq, &w.wk, &w.wv, &w.wo, &w.w1, &w.w2, &w.w3}) round(*x);
  }
}

/// What the GPU run fed each sequence and the logits it got back.
struct SeqRun {
  std::vector<int> inputs;    // the token of each step
  std::vector<float> logits;  // [steps, vocab]
  std::vector<int> next;      // the GPU's greedy choice of each step
};

/// Sequences join at steps 0, 3, 6, ...; each feeds its prompt (BOS, then random tokens from
/// [lo, hi]) and then its own greedy tokens, `steps` steps in all.
std::vector<SeqRun> run_gpu(GpuTransformer& g, int sequences, int prompt_len, int steps, int lo, int hi,
                            std::mt19937& rng) {
  const int vocab = g.config().vocab_size;
  std::vector<SeqRun> runs(static_cast<std::size_t>(sequences));
  std::vector<std::vector<int>> prompts(runs.size());
  for (auto& p : prompts) {
    p.push_back(1);
    for (int i = 1; i < prompt_len; ++i) p.push_back(lo + static_cast<int>(rng() % static_cast<unsigned>(hi - lo + 1)));
  }
  std::vector<int> seqs, tokens, next;
  std::vector<float> logits;
  for (int t = 0;; ++t) {
    seqs.clear();
    for (int s = 0; s < sequences; ++s) {
      const int done = static_cast<int>(runs[static_cast<std::size_t>(s)].inputs.size());
      if (t >= 3 * s && done < steps) seqs.push_back(s);
    }
    if (seqs.empty()) break;
    std::shuffle(seqs.begin(), seqs.end(), rng);
    tokens.clear();
    for (int s : seqs) {
      SeqRun& r = runs[static_cast<std::size_t>(s)];
      const std::size_t i = r.inputs.size();
      tokens.push_back(i < prompts[static_cast<std::size_t>(s)].size() ? prompts[static_cast<std::size_t>(s)][i]
                                                                       : r.next.back());
    }
    next.assign(seqs.size(), -7);
    logits.assign(seqs.size() * static_cast<std::size_t>(vocab), NAN);
    const Status st = g.step(seqs, tokens, next, logits);
    INFO(st.to_string());
    REQUIRE(st.is_ok());
    for (std::size_t b = 0; b < seqs.size(); ++b) {
      SeqRun& r = runs[static_cast<std::size_t>(seqs[b])];
      r.inputs.push_back(tokens[b]);
      r.next.push_back(next[b]);
      r.logits.insert(r.logits.end(), logits.begin() + static_cast<std::ptrdiff_t>(b * vocab),
                      logits.begin() + static_cast<std::ptrdiff_t>((b + 1) * vocab));
    }
  }
  return runs;
}

struct Agreement {
  double worst_rel = 0.0;  // max over steps of max|diff| / max|cpu logit|
  int greedy_checked = 0, greedy_same = 0, greedy_required_mismatch = 0, steps = 0, over_tol = 0;
};

/// Replays each sequence's inputs through the CPU decoder (model `cpu`, the spec with one
/// sequence, CPU backend) and compares every step's logits with the GPU's.
Agreement compare_with_cpu(const Model& cpu, const ThinKvSpec& gpu_spec, const std::vector<SeqRun>& runs,
                           double rel_tol) {
  ThinKvSpec one = gpu_spec;
  one.num_sequences = 1;
  Agreement a;
  const std::size_t vocab = static_cast<std::size_t>(cpu.config.vocab_size);
  std::vector<float> lc(vocab);
  for (const SeqRun& r : runs) {
    with_cache(one, [&](auto& cache) {
      Transformer t(cpu);
      for (std::size_t i = 0; i < r.inputs.size(); ++i) {
        const Status s = t.forward(cache, 0, r.inputs[i], lc);
        INFO(s.to_string());
        REQUIRE(s.is_ok());
        const float* lg = r.logits.data() + i * vocab;
        double mx = 0.0, diff = 0.0;
        for (std::size_t v = 0; v < vocab; ++v) {
          mx = std::max(mx, std::fabs(static_cast<double>(lc[v])));
          diff = std::max(diff, std::fabs(static_cast<double>(lg[v]) - lc[v]));
        }
        const double bound = rel_tol * mx + 1e-4;
        a.worst_rel = std::max(a.worst_rel, diff / std::max(mx, 1e-30));
        a.over_tol += diff > bound ? 1 : 0;
        ++a.steps;
        // Greedy: the CPU's top two.
        const int c1 = argmax(lc);
        float second = -INFINITY;
        for (std::size_t v = 0; v < vocab; ++v) {
          if (static_cast<int>(v) != c1) second = std::max(second, lc[v]);
        }
        ++a.greedy_checked;
        a.greedy_same += r.next[i] == c1 ? 1 : 0;
        if (r.next[i] != c1 && static_cast<double>(lc[static_cast<std::size_t>(c1)]) - second > 2.0 * bound) {
          ++a.greedy_required_mismatch;
        }
      }
    });
  }
  return a;
}

void print(const char* what, const Agreement& a, double tol) {
  std::printf(
      "%-58s steps %5d  worst |dlogit|/max|logit| %.3g (tol %.3g, %d over)  greedy same %d/%d, "
      "%d differ beyond the margin\n",
      what, a.steps, a.worst_rel, tol, a.over_tol, a.greedy_same, a.greedy_checked, a.greedy_required_mismatch);
}

void full_kv_case(const char* name, int prompt_len, int steps, int lo, int hi) {
  Model m;
  if (!load_or_skip(name, m)) return;
  if (tt::small_run()) steps = std::max(steps / 4, 20);
  std::mt19937 rng(tt::base_seed() ^ 0x6770u);
  const int sequences = 5;
  const ThinKvSpec spec = spec_for(m, CacheMode::kFull, steps + 1, 0, sequences);
  for (GpuWeightType wt : {GpuWeightType::kF32, GpuWeightType::kBF16}) {
    std::unique_ptr<GpuTransformer> g;
    const Status s = GpuTransformer::create(m, spec, GpuDecoderOptions{wt}, g);
    INFO(s.to_string());
    REQUIRE(s.is_ok());
    const std::vector<SeqRun> runs = run_gpu(*g, sequences, prompt_len, steps, lo, hi, rng);
    const double tol = wt == GpuWeightType::kF32 ? 5e-3 : 1e-1;
    Model rounded;
    if (wt == GpuWeightType::kBF16) {
      REQUIRE(load_or_skip(name, rounded));
      round_to_bf16(rounded);
    }
    const Agreement a = compare_with_cpu(wt == GpuWeightType::kF32 ? m : rounded, spec, runs, tol);
    const std::string what = std::string(name) + " FullKV, " + to_string(wt) + " weights";
    print(what.c_str(), a, tol);
    CHECK(a.steps == sequences * steps);
    CHECK(a.over_tol * 100 <= a.steps);  // the tail (file comment)
    CHECK(a.worst_rel <= 4 * tol);
    CHECK(a.greedy_required_mismatch == 0);
  }
}

}  // namespace

TEST_CASE("GPU decoder: stories260K, FullKV, same logits and greedy tokens as the CPU decoder", "[gpu][decoder]") {
  full_kv_case("stories260K.bin", 6, 120, 3, 511);
}

TEST_CASE("GPU decoder: the testbed model, FullKV, same logits and greedy tokens as the CPU decoder",
          "[gpu][decoder]") {
  full_kv_case("testbed.bin", 40, 200, 4, 98);
}

TEST_CASE("GPU decoder: the testbed model under ThinKV (R4E4T2, TBE at budget 128)", "[gpu][decoder]") {
  Model m;
  if (!load_or_skip("testbed.bin", m)) return;
  std::mt19937 rng(tt::base_seed() ^ 0x7468u);
  const int sequences = 4, steps = tt::small_run() ? 250 : 500, budget = 128;
  const ThinKvSpec spec = spec_for(m, CacheMode::kThinKv, steps + 1, budget, sequences);
  std::unique_ptr<GpuTransformer> g;
  const Status s = GpuTransformer::create(m, spec, GpuDecoderOptions{GpuWeightType::kF32}, g);
  INFO(s.to_string());
  REQUIRE(s.is_ok());
  const std::vector<SeqRun> runs = run_gpu(*g, sequences, 40, steps, 4, 98, rng);
  REQUIRE(g->settle().is_ok());
  std::int64_t live_max = 0;
  for (int q = 0; q < sequences; ++q) live_max = std::max(live_max, g->live_tokens(q));
  const ThinKvStats& st = g->stats();
  std::printf("testbed ThinKV budget %d: %lld evictions, %lld tokens evicted, live tokens per stream <= %lld\n", budget,
              static_cast<long long>(st.eviction_calls), static_cast<long long>(st.tokens_evicted),
              static_cast<long long>(live_max));
  CHECK(st.tokens_evicted > 0);
  CHECK(live_max <= budget + spec.segment_len);
  const Agreement a = compare_with_cpu(m, spec, runs, 1e-3);
  print("testbed ThinKV R4E4T2 budget 128, f32 weights", a, 1e-3);
  for (const SeqRun& r : runs) {
    for (float x : r.logits) REQUIRE(std::isfinite(x));
  }
  // Most greedy tokens agree (they diverge only after a selection took another token).
  CHECK(a.greedy_same * 10 >= a.greedy_checked * 8);
}

TEST_CASE("GPU decoder: bad steps are refused and change nothing", "[gpu][decoder]") {
  Model m;
  if (!load_or_skip("stories260K.bin", m)) return;
  const ThinKvSpec spec = spec_for(m, CacheMode::kFull, 64, 0, 3);
  std::unique_ptr<GpuTransformer> g;
  REQUIRE(GpuTransformer::create(m, spec, GpuDecoderOptions{GpuWeightType::kF32}, g).is_ok());
  std::vector<int> next(3, 0);
  REQUIRE(g->step(std::vector<int>{0, 1}, std::vector<int>{1, 1}, std::span<int>(next.data(), 2)).is_ok());
  auto refused = [&](std::vector<int> seqs, std::vector<int> toks, std::size_t nout, StatusCode code,
                     const char* needle) {
    std::vector<int> out(nout, 0);
    const Status s = g->step(seqs, toks, out);
    INFO(s.to_string());
    CHECK(s.code() == code);
    CHECK(s.message().find(needle) != std::string::npos);
    CHECK(g->position(0) == 1);
    CHECK(g->position(1) == 1);
    CHECK(g->position(2) == 0);
  };
  refused({}, {}, 0, StatusCode::kInvalidArgument, "0 sequences");
  refused({0, 1, 2, 0}, {1, 1, 1, 1}, 4, StatusCode::kInvalidArgument, "allowed 1..3");
  refused({0, 1}, {1}, 2, StatusCode::kShapeMismatch, "one each");
  refused({0, 1}, {1, 512}, 2, StatusCode::kOutOfRange, "token 512");
  refused({0, 0}, {1, 1}, 2, StatusCode::kInvalidArgument, "named twice");
  refused({0, 5}, {1, 1}, 2, StatusCode::kOutOfRange, "5");
  // The cache still works, and a freed sequence starts again at 0.
  REQUIRE(g->step(std::vector<int>{2, 0}, std::vector<int>{1, 9}, std::span<int>(next.data(), 2)).is_ok());
  CHECK(g->position(0) == 2);
  REQUIRE(g->reset_sequence(0).is_ok());
  CHECK(g->position(0) == 0);
  // A model/cache shape mismatch is refused at creation.
  ThinKvSpec wrong = spec;
  wrong.num_layers += 1;
  std::unique_ptr<GpuTransformer> g2;
  const Status s = GpuTransformer::create(m, wrong, GpuDecoderOptions{}, g2);
  CHECK(s.code() == StatusCode::kShapeMismatch);
  CHECK(g2 == nullptr);
}

TEST_CASE("GPU decoder: reserved storage decodes the same bits and never grows, fill stores a prompt",
          "[gpu][decoder]") {
  Model m;
  if (!load_or_skip("stories260K.bin", m)) return;
  std::mt19937 rng(tt::base_seed() ^ 0x7265u);
  const int sequences = 3, steps = 90;
  const ThinKvSpec spec = spec_for(m, CacheMode::kFull, steps + 40, 0, sequences);
  std::unique_ptr<GpuTransformer> plain, reserved;
  REQUIRE(GpuTransformer::create(m, spec, GpuDecoderOptions{GpuWeightType::kF32, false}, plain).is_ok());
  REQUIRE(GpuTransformer::create(m, spec, GpuDecoderOptions{GpuWeightType::kF32, true}, reserved).is_ok());
  const std::int64_t held = reserved->cache_device_bytes();
  CHECK(held > plain->cache_device_bytes());
  std::mt19937 rng2 = rng;
  const std::vector<SeqRun> a = run_gpu(*plain, sequences, 4, steps, 3, 511, rng);
  const std::vector<SeqRun> b = run_gpu(*reserved, sequences, 4, steps, 3, 511, rng2);
  for (std::size_t s = 0; s < a.size(); ++s) {
    CHECK(a[s].inputs == b[s].inputs);
    REQUIRE(a[s].logits.size() == b[s].logits.size());
    CHECK(std::memcmp(a[s].logits.data(), b[s].logits.data(), a[s].logits.size() * sizeof(float)) == 0);
  }
  CHECK(reserved->cache_device_bytes() == held);
  // fill: a fresh sequence gets 37 stored positions, then decodes from position 37.
  REQUIRE(reserved->reset_sequence(1).is_ok());
  REQUIRE(reserved->fill(1, 37, 5).is_ok());
  CHECK(reserved->position(1) == 37);
  CHECK(reserved->live_tokens(1) == 37);
  std::vector<int> next(1, -1);
  REQUIRE(reserved->step(std::vector<int>{1}, std::vector<int>{1}, next).is_ok());
  CHECK(reserved->position(1) == 38);
  CHECK(next[0] >= 0);
  CHECK(reserved->fill(1, 5, 5).code() == StatusCode::kInvalidArgument);  // not at position 0
}

TEST_CASE("GPU decoder: pipelined launch / collect decodes step()'s tokens, misuse is refused",
          "[gpu][decoder][pipelined]") {
  Model m;
  if (!load_or_skip("stories260K.bin", m)) return;
  // ThinKV (TBE evicting at budget 64) so that the pipelined host planning meets evictions too.
  const int sequences = 4, steps = 160;
  const ThinKvSpec spec = spec_for(m, CacheMode::kThinKv, steps + 8, 64, sequences);
  std::unique_ptr<GpuTransformer> sync, pipe;
  REQUIRE(GpuTransformer::create(m, spec, GpuDecoderOptions{GpuWeightType::kF32}, sync).is_ok());
  REQUIRE(GpuTransformer::create(m, spec, GpuDecoderOptions{GpuWeightType::kF32}, pipe).is_ok());
  // Sequence q joins at step 7 q with token 1 + q; the synchronous decoder is given each
  // sequence's previous greedy token by the host, the pipelined one takes it on the device (-1).
  std::vector<int> last(sequences, 0);
  std::vector<std::vector<int>> want(sequences), got(sequences);
  std::vector<std::vector<int>> batches;
  for (int t = 0; t < steps; ++t) {
    std::vector<int> seqs, toks;
    for (int q = 0; q < sequences; ++q) {
      if (t < 7 * q) continue;
      seqs.push_back(q);
      toks.push_back(t == 7 * q ? 1 + q : last[static_cast<std::size_t>(q)]);
    }
    std::vector<int> next(seqs.size());
    REQUIRE(sync->step(seqs, toks, next).is_ok());
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      last[static_cast<std::size_t>(seqs[i])] = next[i];
      want[static_cast<std::size_t>(seqs[i])].push_back(next[i]);
    }
    batches.push_back(seqs);
  }
  std::size_t collected = 0;
  auto collect_one = [&]() {
    const std::vector<int>& seqs = batches[collected++];
    std::vector<int> next(seqs.size());
    REQUIRE(pipe->collect(next).is_ok());
    for (std::size_t i = 0; i < seqs.size(); ++i) got[static_cast<std::size_t>(seqs[i])].push_back(next[i]);
  };
  for (int t = 0; t < steps; ++t) {
    std::vector<int> toks;
    for (int q : batches[static_cast<std::size_t>(t)]) toks.push_back(t == 7 * q ? 1 + q : -1);
    REQUIRE(pipe->launch(batches[static_cast<std::size_t>(t)], toks).is_ok());
    if (t == 3) {  // misuse while two steps could be in flight
      std::vector<int> out(batches[3].size());
      CHECK(pipe->step(batches[3], std::vector<int>(batches[3].size(), 1), out).code() == StatusCode::kInvalidArgument);
      CHECK(pipe->reset_sequence(0).code() == StatusCode::kInvalidArgument);
      CHECK(pipe->launch(batches[4], std::vector<int>(batches[4].size(), -1)).code() ==
            StatusCode::kInvalidArgument);  // two in flight already
    }
    if (t >= 1) collect_one();
  }
  collect_one();
  std::vector<int> none(1);
  CHECK(pipe->collect(none).code() == StatusCode::kInvalidArgument);  // nothing in flight
  for (int q = 0; q < sequences; ++q) {
    INFO("sequence " << q);
    CHECK(got[static_cast<std::size_t>(q)] == want[static_cast<std::size_t>(q)]);
  }
  CHECK(pipe->stats().tokens_evicted > 0);
  CHECK(pipe->stats().tokens_evicted == sync->stats().tokens_evicted);
  // -2 is no token: refused naming it.
  const Status bad = pipe->launch(std::vector<int>{0}, std::vector<int>{-2});
  CHECK(bad.code() == StatusCode::kOutOfRange);
  CHECK(bad.message().find("-1") != std::string::npos);
}
