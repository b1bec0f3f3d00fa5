// GPU test: the GPU decoder under tensor parallelism (GpuDecoderOptions::tensor_parallel),
// against the same decoder on one GPU.
//
// Ranks run as threads of this process. LocalGroup's ranks share one GPU (the sums taken on the
// host in rank order): that checks the sharding itself (which rows and columns of each weight a
// rank holds, the cache's slice of heads, the thought signal summed over ranks, the partial
// outputs summed) on any machine with one GPU. NCCL's ranks need one GPU each: with two or more
// GPUs the same checks run over NcclCollective; with one, NCCL runs a group of one rank (its
// wiring) and the two-GPU cases print SKIPPED.
//
// What must hold:
//  - every rank ends each step with the same greedy tokens and bit for bit the same logits, and
//    takes the same decisions: thought refreshes and their outcomes, segments (ids, types,
//    sizes, levels), live tokens, evictions;
//  - against one GPU, FullKV with FP32 weights: logits within 5e-3 x max |logit| + 1e-4 (the
//    partial products of wo and w2 are summed over ranks in another order than one GEMM sums
//    them; measured on an NVIDIA H100, printed), greedy tokens equal beyond twice that margin;
//    ThinKV (TBE at budget 128): the rounding differences may move a K-means choice, so most
//    greedy tokens and thought refreshes agree, as between the CPU and the GPU decoders;
//  - a rank that fails mid-step (its step refused) aborts the group and every other rank's step
//    fails with an error naming it; a rank that stops without a word is found by the timeout.
//
// Models: $THINKV_MODELS, <repo>/models, <repo>/../shared/models (a model not found is skipped).

#include <catch2/catch.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <random>
#include <thread>
#include <vector>

#include "../unit/test_util.hpp"
#include "decoder/collective.hpp"
#include "decoder/decoder.hpp"
#include "decoder/gpu_transformer.hpp"
#include "gpu_decoder_test_util.hpp"
#include "thinkv/calibration.hpp"
#ifdef THINKV_HAVE_NCCL
#include "decoder/nccl_collective.hpp"
#endif

using namespace thinkv;
using namespace thinkv::decoder;
namespace fs = std::filesystem;
using tt::find_model_file;
using tt::load_or_skip;
using tt::spec_for;

namespace {

/// The testbed's committed calibration (models/testbed-calib.json): a classifier that reads the
/// attention's sparsity on its layers at every refresh, so the signal's all-reduce is exercised.
ThoughtClassifier testbed_classifier(const Model& m) {
  const fs::path p = find_model_file("testbed-calib.json");
  REQUIRE(!p.empty());
  CalibrationFile f;
  const Status s = read_calibration_json(p, f);
  INFO(s.to_string());
  REQUIRE(s.is_ok());
  REQUIRE(check_model(f, m.config.n_layers, m.name).is_ok());
  return classifier_from_calibration(f);
}

/// One step of a schedule: which sequences take which tokens.
struct Step {
  std::vector<int> seqs, tokens;
};

/// What a decoder did over a schedule: per step, its greedy tokens and logits; at the end, its
/// decisions.
struct Trace {
  std::vector<std::vector<int>> next;
  std::vector<std::vector<float>> logits;
  std::vector<ThoughtStats> thoughts;  // per sequence (refresh_ns cleared: a time)
  std::vector<std::vector<SegmentState>> segments;
  std::vector<std::int64_t> live;
  std::int64_t tokens_evicted = 0;
  Status failure;  // the first failed step's status
  int failed_at = -1;
};

/// Waits for the decoder's pending selections and records its decisions (no Catch2 assertion:
/// ranks call it on their threads); settle's status.
Status record_decisions(GpuTransformer& g, int sequences, Trace& t) {
  THINKV_RETURN_IF_ERROR(g.settle());
  for (int q = 0; q < sequences; ++q) {
    ThoughtStats ts = g.cache().thought_stats(q);
    ts.refresh_ns = 0;
    t.thoughts.push_back(ts);
    t.segments.push_back(g.cache().segments(q));
    t.live.push_back(g.live_tokens(q));
  }
  t.tokens_evicted = g.stats().tokens_evicted;
  return Status::ok();
}

/// Sequences join at steps 0, 3, 6, ...; each feeds its prompt (BOS, then random tokens from
/// [lo, hi]) and then its own greedy tokens, `steps` steps in all, on one GPU: the schedule and
/// its trace.
std::vector<Step> run_one_gpu(GpuTransformer& g, int sequences, int prompt_len, int steps, int lo, int hi,
                              std::mt19937& rng, Trace& trace) {
  const std::size_t vocab = static_cast<std::size_t>(g.config().vocab_size);
  std::vector<std::vector<int>> prompts(static_cast<std::size_t>(sequences)), fed(prompts.size());
  std::vector<int> last(prompts.size(), 0);
  for (auto& p : prompts) {
    p.push_back(1);
    for (int i = 1; i < prompt_len; ++i) p.push_back(lo + static_cast<int>(rng() % static_cast<unsigned>(hi - lo + 1)));
  }
  std::vector<Step> schedule;
  for (int t = 0;; ++t) {
    Step st;
    for (int s = 0; s < sequences; ++s) {
      if (t >= 3 * s && static_cast<int>(fed[static_cast<std::size_t>(s)].size()) < steps) st.seqs.push_back(s);
    }
    if (st.seqs.empty()) break;
    std::shuffle(st.seqs.begin(), st.seqs.end(), rng);
    for (int s : st.seqs) {
      const std::size_t i = fed[static_cast<std::size_t>(s)].size();
      st.tokens.push_back(i < prompts[static_cast<std::size_t>(s)].size() ? prompts[static_cast<std::size_t>(s)][i]
                                                                          : last[static_cast<std::size_t>(s)]);
    }
    std::vector<int> next(st.seqs.size(), -7);
    std::vector<float> logits(st.seqs.size() * vocab, NAN);
    const Status s = g.step(st.seqs, st.tokens, next, logits);
    INFO(s.to_string());
    REQUIRE(s.is_ok());
    for (std::size_t b = 0; b < st.seqs.size(); ++b) {
      fed[static_cast<std::size_t>(st.seqs[b])].push_back(st.tokens[b]);
      last[static_cast<std::size_t>(st.seqs[b])] = next[b];
    }
    trace.next.push_back(next);
    trace.logits.push_back(logits);
    schedule.push_back(std::move(st));
  }
  REQUIRE(record_decisions(g, sequences, trace).is_ok());
  return schedule;
}

/// Replays `schedule` on a decoder (a rank); stops at the first failed step (recorded).
Trace replay(GpuTransformer& g, const std::vector<Step>& schedule, int sequences) {
  Trace t;
  const std::size_t vocab = static_cast<std::size_t>(g.config().vocab_size);
  for (std::size_t i = 0; i < schedule.size(); ++i) {
    const Step& st = schedule[i];
    std::vector<int> next(st.seqs.size(), -7);
    std::vector<float> logits(st.seqs.size() * vocab, NAN);
    const Status s = g.step(st.seqs, st.tokens, next, logits);
    if (!s.is_ok()) {
      t.failure = s;
      t.failed_at = static_cast<int>(i);
      return t;
    }
    t.next.push_back(std::move(next));
    t.logits.push_back(std::move(logits));
  }
  if (Status s = record_decisions(g, sequences, t); !s.is_ok()) {
    t.failure = s;  // settling after the last step
    t.failed_at = static_cast<int>(schedule.size());
  }
  return t;
}

/// Runs `body(rank)` on `size` threads (rank r on GPU devices[r]) and joins them. Catch2's
/// assertions are not thread-safe: the bodies only record, the caller checks.
void on_ranks(int size, const std::vector<int>& devices, const std::function<void(int)>& body) {
  std::vector<std::thread> th;
  for (int r = 0; r < size; ++r) {
    th.emplace_back([&, r] {
      (void)cudaSetDevice(devices[static_cast<std::size_t>(r)]);
      body(r);
    });
  }
  for (std::thread& t : th) t.join();
}

/// Every rank's trace equals rank 0's: tokens, logits bit for bit, decisions.
void check_ranks_agree(const std::vector<Trace>& ranks) {
  for (std::size_t r = 1; r < ranks.size(); ++r) {
    CAPTURE(r);
    REQUIRE(ranks[r].next.size() == ranks[0].next.size());
    int logits_differ = 0;
    for (std::size_t i = 0; i < ranks[0].next.size(); ++i) {
      CHECK(ranks[r].next[i] == ranks[0].next[i]);
      logits_differ += ranks[r].logits[i] != ranks[0].logits[i] ? 1 : 0;
    }
    CHECK(logits_differ == 0);
    CHECK(ranks[r].thoughts == ranks[0].thoughts);
    CHECK(ranks[r].segments == ranks[0].segments);
    CHECK(ranks[r].live == ranks[0].live);
  }
}

struct Agreement {
  double worst_rel = 0.0;
  int steps = 0, over_tol = 0, greedy_same = 0, greedy_beyond_margin = 0;
};

/// A rank's logits and tokens against one GPU's, step by step.
Agreement compare(const Trace& one, const Trace& rank, int vocab, double rel_tol) {
  Agreement a;
  const std::size_t V = static_cast<std::size_t>(vocab);
  for (std::size_t i = 0; i < one.next.size() && i < rank.next.size(); ++i) {
    for (std::size_t b = 0; b < one.next[i].size(); ++b) {
      const float* l1 = one.logits[i].data() + b * V;
      const float* l2 = rank.logits[i].data() + b * V;
      double mx = 0.0, diff = 0.0;
      int top = 0;
      for (std::size_t v = 0; v < V; ++v) {
        mx = std::max(mx, std::fabs(static_cast<double>(l1[v])));
        diff = std::max(diff, std::fabs(static_cast<double>(l2[v]) - l1[v]));
        if (l1[v] > l1[top]) top = static_cast<int>(v);
      }
      float second = -INFINITY;
      for (std::size_t v = 0; v < V; ++v) {
        if (static_cast<int>(v) != top) second = std::max(second, l1[v]);
      }
      const double bound = rel_tol * mx + 1e-4;
      a.worst_rel = std::max(a.worst_rel, diff / std::max(mx, 1e-30));
      a.over_tol += diff > bound ? 1 : 0;
      ++a.steps;
      const bool same = rank.next[i][b] == one.next[i][b];
      a.greedy_same += same ? 1 : 0;
      if (!same && static_cast<double>(l1[top]) - second > 2.0 * bound) ++a.greedy_beyond_margin;
    }
  }
  return a;
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

/// Decodes `schedule` on `size` ranks built by make_ranks(model, spec, options with the rank's
/// collective) and returns their traces.
std::vector<Trace> run_ranks(const Model& m, const ThinKvSpec& spec, GpuWeightType wt,
                             const std::vector<Collective*>& group, const std::vector<int>& devices,
                             const std::vector<Step>& schedule) {
  const int size = static_cast<int>(group.size());
  std::vector<Trace> traces(group.size());
  std::vector<Status> created(group.size());
  on_ranks(size, devices, [&](int r) {
    GpuDecoderOptions o{wt};
    o.tensor_parallel = group[static_cast<std::size_t>(r)];
    std::unique_ptr<GpuTransformer> g;
    created[static_cast<std::size_t>(r)] = GpuTransformer::create(m, spec, o, g);
    if (!created[static_cast<std::size_t>(r)].is_ok()) {
      group[static_cast<std::size_t>(r)]->abort("creation failed");
      return;
    }
    traces[static_cast<std::size_t>(r)] = replay(*g, schedule, spec.num_sequences);
  });
  for (const Status& s : created) {
    INFO(s.to_string());
    REQUIRE(s.is_ok());
  }
  for (const Trace& t : traces) {
    INFO(t.failure.to_string());
    REQUIRE(t.failed_at == -1);
  }
  return traces;
}

/// The sharding checks for one way of making a group (LocalGroup or NCCL), `size` ranks.
void sharding_cases(const char* how, int size, const std::function<std::vector<Collective*>()>& make_group,
                    const std::vector<int>& devices) {
  Model m;
  if (!load_or_skip("testbed.bin", m)) return;
  std::mt19937 rng(tt::base_seed() ^ 0x7470u);
  SECTION("FullKV, FP32 weights: the logits of one GPU") {
    const int sequences = 4, steps = 160;
    const ThinKvSpec spec = spec_for(m, CacheMode::kFull, steps + 1, 0, sequences);
    std::unique_ptr<GpuTransformer> one;
    REQUIRE(GpuTransformer::create(m, spec, GpuDecoderOptions{GpuWeightType::kF32}, one).is_ok());
    Trace t1;
    const std::vector<Step> schedule = run_one_gpu(*one, sequences, 40, steps, 4, 98, rng, t1);
    one.reset();
    const std::vector<Trace> ranks = run_ranks(m, spec, GpuWeightType::kF32, make_group(), devices, schedule);
    check_ranks_agree(ranks);
    const Agreement a = compare(t1, ranks[0], m.config.vocab_size, 5e-3);
    std::printf(
        "%s, %d ranks, testbed FullKV f32: %d steps, worst |dlogit|/max|logit| %.3g (tol 5e-3, %d over), "
        "greedy same %d, %d differ beyond the margin\n",
        how, size, a.steps, a.worst_rel, a.over_tol, a.greedy_same, a.greedy_beyond_margin);
    CHECK(a.steps == sequences * steps);
    CHECK(a.over_tol == 0);
    CHECK(a.greedy_beyond_margin == 0);
  }
  SECTION("ThinKV R4E4T2, TBE at budget 128: every rank the same decisions, most as one GPU's") {
    const int sequences = 4, steps = 500, budget = 128;
    const ThinKvSpec spec = spec_for(m, CacheMode::kThinKv, steps + 1, budget, sequences, testbed_classifier(m));
    std::unique_ptr<GpuTransformer> one;
    REQUIRE(GpuTransformer::create(m, spec, GpuDecoderOptions{GpuWeightType::kF32}, one).is_ok());
    Trace t1;
    const std::vector<Step> schedule = run_one_gpu(*one, sequences, 40, steps, 4, 98, rng, t1);
    one.reset();
    const std::vector<Trace> ranks = run_ranks(m, spec, GpuWeightType::kF32, make_group(), devices, schedule);
    check_ranks_agree(ranks);
    const Agreement a = compare(t1, ranks[0], m.config.vocab_size, 1e-3);
    std::int64_t refreshes = 0, refreshes_same = 0;
    for (std::size_t q = 0; q < t1.thoughts.size(); ++q) {
      refreshes += t1.thoughts[q].refreshes;
      for (std::size_t k = 0; k < t1.thoughts[q].refresh_histogram.size(); ++k) {
        refreshes_same += std::min(t1.thoughts[q].refresh_histogram[k], ranks[0].thoughts[q].refresh_histogram[k]);
      }
    }
    std::printf(
        "%s, %d ranks, testbed ThinKV budget %d: tokens evicted %lld (one GPU %lld), greedy same %d/%d, "
        "refresh outcomes shared %lld/%lld\n",
        how, size, budget, static_cast<long long>(ranks[0].tokens_evicted), static_cast<long long>(t1.tokens_evicted),
        a.greedy_same, a.steps, static_cast<long long>(refreshes_same), static_cast<long long>(refreshes));
    CHECK(ranks[0].tokens_evicted > 0);
    CHECK(refreshes > 0);
    for (std::int64_t live : ranks[0].live) CHECK(live <= budget + spec.segment_len);
    CHECK(a.greedy_same * 10 >= a.steps * 8);
    CHECK(refreshes_same * 10 >= refreshes * 8);
  }
  SECTION("a rank whose step fails aborts the group: every rank reports it, none hangs") {
    const ThinKvSpec spec = spec_for(m, CacheMode::kThinKv, 64, 0, 2);
    std::vector<Collective*> group = make_group();
    std::vector<Status> at_fail(group.size());
    std::vector<double> seconds(group.size(), 0.0);
    on_ranks(size, devices, [&](int r) {
      GpuDecoderOptions o{GpuWeightType::kF32};
      o.tensor_parallel = group[static_cast<std::size_t>(r)];
      std::unique_ptr<GpuTransformer> g;
      Status s = GpuTransformer::create(m, spec, o, g);
      std::vector<int> next(2);
      for (int i = 0; s.is_ok() && i < 12; ++i) {
        // At step 6 the last rank passes a token outside the vocabulary: its step is refused.
        const int bad = (i == 6 && r == size - 1) ? m.config.vocab_size + 5 : 1 + i;
        const auto t0 = std::chrono::steady_clock::now();
        s = g->step(std::vector<int>{0, 1}, std::vector<int>{bad, 2}, next);
        seconds[static_cast<std::size_t>(r)] =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      }
      at_fail[static_cast<std::size_t>(r)] = s;
    });
    for (int r = 0; r < size; ++r) {
      const Status& s = at_fail[static_cast<std::size_t>(r)];
      CAPTURE(r, s.to_string(), seconds[static_cast<std::size_t>(r)]);
      std::printf("%s, rank %d of %d: %s (its last step took %.2f s)\n", how, r, size, s.to_string().c_str(),
                  seconds[static_cast<std::size_t>(r)]);
      CHECK_FALSE(s.is_ok());
      if (r == size - 1) {
        CHECK(s.code() == StatusCode::kOutOfRange);
      } else {
        CHECK(s.code() == StatusCode::kCudaError);
      }
      CHECK(seconds[static_cast<std::size_t>(r)] < 30.0);
    }
  }
}

}  // namespace

TEST_CASE("GPU decoder, tensor parallelism: 2 ranks sharing one GPU (in-process all-reduce) decode as one GPU",
          "[gpu][decoder][tp]") {
  std::unique_ptr<LocalGroup> lg;
  sharding_cases("in-process", 2,
                 [&] {
                   lg = std::make_unique<LocalGroup>(2, std::chrono::milliseconds(10000));
                   return std::vector<Collective*>{&lg->rank(0), &lg->rank(1)};
                 },
                 {0, 0});
}

TEST_CASE("GPU decoder, tensor parallelism: random weights, a rank's slice is the one-GPU model's",
          "[gpu][decoder][tp]") {
  // A Llama shape with 4 KV heads, 8 query heads, 2 layers: 1, 2 and 4 ranks; weights drawn by
  // index in the whole matrix, K/V of a fill drawn likewise.
  ModelConfig c;
  c.dim = 256;
  c.hidden_dim = 512;
  c.n_layers = 2;
  c.n_heads = 8;
  c.n_kv_heads = 4;
  c.head_dim = 32;
  c.rope_dim = 32;
  c.vocab_size = 1000;
  c.seq_len = 512;
  ThinKvSpec spec;
  spec.num_layers = c.n_layers;
  spec.num_kv_heads = c.n_kv_heads;
  spec.num_q_heads = c.n_heads;
  spec.head_dim = c.head_dim;
  spec.num_sequences = 3;
  spec.max_tokens = 512;
  spec.mode = CacheMode::kFull;
  const std::vector<Step> schedule = [] {
    std::vector<Step> s;
    for (int i = 0; i < 24; ++i) s.push_back({{0, 1, 2}, {(7 * i + 3) % 1000, (11 * i + 5) % 1000, (13 * i) % 1000}});
    return s;
  }();
  auto run = [&](int size) {
    auto lg = std::make_unique<LocalGroup>(size, std::chrono::milliseconds(10000));
    std::vector<Trace> traces(static_cast<std::size_t>(size));
    std::vector<Status> st(static_cast<std::size_t>(size));
    on_ranks(size, std::vector<int>(static_cast<std::size_t>(size), 0), [&](int r) {
      GpuDecoderOptions o{GpuWeightType::kF32};
      o.tensor_parallel = size > 1 ? &lg->rank(r) : nullptr;
      ThinKvSpec sp = spec;
      std::unique_ptr<GpuCache> cache;
      Status s = size > 1 ? tensor_parallel_slice(spec, r, size, sp) : Status::ok();
      if (s.is_ok()) s = make_gpu_cache(sp, cache);
      std::unique_ptr<GpuTransformer> g;
      if (s.is_ok()) s = GpuTransformer::create_random(c, 42, std::move(cache), o, g);
      if (s.is_ok()) s = g->fill(0, 100, 7);  // a prompt of random K/V for sequence 0
      st[static_cast<std::size_t>(r)] = s;
      if (!s.is_ok()) {
        if (o.tensor_parallel != nullptr) o.tensor_parallel->abort("setup failed");
        return;
      }
      traces[static_cast<std::size_t>(r)] = replay(*g, schedule, spec.num_sequences);
    });
    for (const Status& s : st) {
      INFO(s.to_string());
      REQUIRE(s.is_ok());
    }
    return traces;
  };
  const std::vector<Trace> one = run(1);
  REQUIRE(one[0].failed_at == -1);
  for (int size : {2, 4}) {
    CAPTURE(size);
    const std::vector<Trace> ranks = run(size);
    for (const Trace& t : ranks) {
      INFO(t.failure.to_string());
      REQUIRE(t.failed_at == -1);
    }
    check_ranks_agree(ranks);
    const Agreement a = compare(one[0], ranks[0], c.vocab_size, 5e-3);
    std::printf("random weights, %d ranks: %d steps, worst |dlogit|/max|logit| %.3g, greedy same %d\n", size, a.steps,
                a.worst_rel, a.greedy_same);
    CHECK(a.over_tol == 0);
    CHECK(a.greedy_beyond_margin == 0);
  }
}

TEST_CASE("GPU decoder, tensor parallelism: a rank that stops is found by the timeout", "[gpu][decoder][tp]") {
  Model m;
  if (!load_or_skip("testbed.bin", m)) return;
  const ThinKvSpec spec = spec_for(m, CacheMode::kFull, 64, 0, 1);
  LocalGroup lg(2, std::chrono::milliseconds(1500));
  Status s0;
  double seconds = 0.0;
  on_ranks(2, {0, 0}, [&](int r) {
    GpuDecoderOptions o{GpuWeightType::kF32};
    o.tensor_parallel = &lg.rank(r);
    std::unique_ptr<GpuTransformer> g;
    Status s = GpuTransformer::create(m, spec, o, g);
    std::vector<int> next(1);
    // Rank 1 decodes 3 steps and returns without a word; rank 0 goes on.
    for (int i = 0; s.is_ok() && i < (r == 1 ? 3 : 10); ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      s = g->step(std::vector<int>{0}, std::vector<int>{1 + i}, next);
      if (r == 0) seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    if (r == 0) s0 = s;
  });
  std::printf("in-process, rank 0 after rank 1 stopped: %s (its last step took %.2f s)\n", s0.to_string().c_str(),
              seconds);
  CHECK(s0.code() == StatusCode::kCudaError);
  CHECK(s0.message().find("waited 1500 ms") != std::string::npos);
  CHECK(seconds < 10.0);
}

#ifdef THINKV_HAVE_NCCL
TEST_CASE("GPU decoder, tensor parallelism over NCCL: one rank per GPU decodes as one GPU", "[gpu][decoder][tp]") {
  const int gpus = device_count();
  const int size = gpus >= 2 ? 2 : 1;
  std::printf("NCCL %d, %d GPU(s)\n", NcclCollective::version(), gpus);
  if (gpus < 2) {
    const std::string msg = "SKIPPED: tensor parallelism over NCCL across GPUs needs 2 GPUs (found " +
                            std::to_string(gpus) + "); a group of one rank runs instead";
    WARN(msg);
    std::printf("%s\n", msg.c_str());
  }
  std::vector<std::unique_ptr<NcclCollective>> comms;
  std::vector<int> devices;
  for (int r = 0; r < size; ++r) devices.push_back(r);
  sharding_cases(
      "NCCL", size,
      [&] {
        std::string id;
        const Status s = NcclCollective::unique_id(id);
        INFO(s.to_string());
        REQUIRE(s.is_ok());
        comms.clear();
        comms.resize(static_cast<std::size_t>(size));
        std::vector<Status> st(static_cast<std::size_t>(size));
        on_ranks(size, devices, [&](int r) {
          st[static_cast<std::size_t>(r)] =
              NcclCollective::create(id, r, size, std::chrono::milliseconds(8000), comms[static_cast<std::size_t>(r)]);
        });
        std::vector<Collective*> g;
        for (int r = 0; r < size; ++r) {
          INFO(st[static_cast<std::size_t>(r)].to_string());
          REQUIRE(st[static_cast<std::size_t>(r)].is_ok());
          g.push_back(comms[static_cast<std::size_t>(r)].get());
        }
        return g;
      },
      devices);
}
#endif
