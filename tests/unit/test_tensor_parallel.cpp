// Tensor parallelism on the CPU: a model's KV heads split over two ranks, each rank a
// ThinKvCache of its slice (2 of 4 KV heads, 4 of 8 query heads) on its own thread, the thought
// signal all-reduced through ThinKvCache::set_signal_reduction (here an in-process all-reduce:
// a barrier and a shared buffer, summed in rank order; NCCL's all-reduce on GPUs). Against the
// unsharded cache of all heads fed the same tokens, every rank must take the same decisions
// (thought types, segments, the positions each of its streams holds) and give bit for bit the
// same attention outputs for its heads; a rank whose all-reduce fails reports the error and
// changes nothing.

#include <catch2/catch.hpp>

#include <cstring>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "../../examples/decoder/thinkv_spec.hpp"
#include "thinkv/thinkv_cache.hpp"

#include "local_all_reduce.hpp"
#include "sequence_test_util.hpp"
#include "test_util.hpp"

using thinkv::Status;
using thinkv::StatusCode;
using thinkv::ThoughtType;
using thinkv::decoder::CacheMode;
using thinkv::decoder::ThinKvSpec;
using thinkv::decoder::with_cache;
using tt::LocalAllReduce;

namespace {

/// One token's inputs for every layer: K/V of all KV heads, Q of all query heads.
struct Token {
  std::vector<std::vector<float>> k, v, q;
};

ThinKvSpec spec(CacheMode mode, int kv_heads, int q_heads) {
  ThinKvSpec c = tt::sequence_spec(mode);
  c.num_sequences = 2;
  c.num_kv_heads = kv_heads;
  c.num_q_heads = q_heads;
  return c;
}

/// What a cache decided and computed for one sequence, for comparison across ranks.
struct Trace {
  std::vector<ThoughtType> types;                         // per decoded token, the type after it
  std::vector<float> signal;                              // at every refresh step (tau = 32), each layer's sparsity
  std::vector<std::vector<float>> out;                    // per token and layer, the attention output
  std::vector<std::vector<std::set<std::int32_t>>> held;  // at the end: per stream, the positions held
};

}  // namespace

TEST_CASE("Tensor parallelism: two ranks with the thought signal all-reduced decide as the unsharded cache",
          "[tensor_parallel]") {
  for (CacheMode mode : {CacheMode::kThinKv, CacheMode::kTbe}) {
    INFO("mode " << thinkv::decoder::to_string(mode));
    auto rng = tt::make_rng("tensor_parallel");
    const int hkv = 4, hq = 8, ranks = 2, steps = 400;
    const ThinKvSpec full = spec(mode, hkv, hq);
    ThinKvSpec shards[ranks];
    for (int r = 0; r < ranks; ++r) {
      shards[r] = spec(mode, hkv / ranks, hq / ranks);
      shards[r].model_kv_heads = hkv;
      shards[r].kv_head_offset = r * (hkv / ranks);
    }
    const int d = full.head_dim, L = full.num_layers;
    // The tokens of both sequences (sequence s decodes tokens[s][t]).
    std::vector<std::vector<Token>> tokens(2);
    for (auto& seq : tokens) {
      for (int t = 0; t < steps; ++t) {
        Token tok;
        for (int l = 0; l < L; ++l) {
          tok.k.push_back(tt::random_row(rng, hkv * d));
          tok.v.push_back(tt::random_row(rng, hkv * d));
          tok.q.push_back(tt::random_row(rng, hq * d));
        }
        seq.push_back(std::move(tok));
      }
    }
    // rank < 0: the unsharded cache; else rank `rank`'s slice: KV heads [rank * 2, rank * 2 + 2),
    // query heads [rank * 4, rank * 4 + 4).
    // No Catch assertion inside the rank threads (Catch is not thread-safe): `run` returns the
    // first failure as text, checked after the threads are joined.
    auto run = [&](auto& cache, int rank, Trace(&trace)[2], bool batched = false) -> std::string {
      const int kh = cache.config().num_kv_heads, qh = cache.config().num_q_heads;
      const int k0 = rank < 0 ? 0 : rank * kh, q0 = rank < 0 ? 0 : rank * qh;
      std::vector<float> k(static_cast<std::size_t>(kh * d)), v(k.size()), q(static_cast<std::size_t>(qh * d));
      for (int t = 0; t < steps && batched; ++t) {
        // Both sequences in one step (begin_step, append_batch / attend_batch per layer, end_step:
        // one all-reduce for both when they refresh).
        const int seqs[2] = {0, 1};
        if (Status e = cache.begin_step(seqs); !e.is_ok()) return "begin_step: " + e.to_string();
        for (int l = 0; l < L; ++l) {
          std::vector<float> kb, vb, qb, ob(static_cast<std::size_t>(2 * qh * d), NAN);
          for (int s = 0; s < 2; ++s) {
            const Token& tok = tokens[static_cast<std::size_t>(s)][static_cast<std::size_t>(t)];
            const auto& K = tok.k[static_cast<std::size_t>(l)];
            const auto& V = tok.v[static_cast<std::size_t>(l)];
            const auto& Q = tok.q[static_cast<std::size_t>(l)];
            kb.insert(kb.end(), K.begin() + k0 * d, K.begin() + (k0 + kh) * d);
            vb.insert(vb.end(), V.begin() + k0 * d, V.begin() + (k0 + kh) * d);
            qb.insert(qb.end(), Q.begin() + q0 * d, Q.begin() + (q0 + qh) * d);
          }
          if (Status e = cache.append_batch(l, seqs, {kb.data()}, {vb.data()}); !e.is_ok())
            return "append_batch: " + e.to_string();
          if (Status e = cache.attend_batch(l, seqs, {qb.data()}, {ob.data()}); !e.is_ok())
            return "attend_batch: " + e.to_string();
          for (int s = 0; s < 2; ++s) {
            trace[s].out.emplace_back(ob.begin() + s * qh * d, ob.begin() + (s + 1) * qh * d);
          }
        }
        if (Status e = cache.end_step(seqs); !e.is_ok()) return "end_step: " + e.to_string();
        for (int s = 0; s < 2; ++s) {
          trace[s].types.push_back(cache.tracker(s).current());
          if (t % 32 == 0) {
            const auto x = cache.layer_sparsity(s);
            trace[s].signal.insert(trace[s].signal.end(), x.begin(), x.end());
          }
        }
      }
      for (int t = 0; t < steps && !batched; ++t) {
        for (int s = 0; s < 2; ++s) {
          const Token& tok = tokens[static_cast<std::size_t>(s)][static_cast<std::size_t>(t)];
          if (Status e = cache.begin_token(s); !e.is_ok()) return "begin_token: " + e.to_string();
          for (int l = 0; l < L; ++l) {
            const auto& K = tok.k[static_cast<std::size_t>(l)];
            const auto& V = tok.v[static_cast<std::size_t>(l)];
            const auto& Q = tok.q[static_cast<std::size_t>(l)];
            std::copy_n(K.begin() + k0 * d, kh * d, k.begin());
            std::copy_n(V.begin() + k0 * d, kh * d, v.begin());
            std::copy_n(Q.begin() + q0 * d, qh * d, q.begin());
            std::vector<float> out(q.size(), NAN);
            if (Status e = cache.append(s, l, k, v); !e.is_ok()) return "append: " + e.to_string();
            if (Status e = cache.attend(s, l, q, out); !e.is_ok()) return "attend: " + e.to_string();
            trace[s].out.push_back(std::move(out));
          }
          if (Status e = cache.end_token(s); !e.is_ok()) return "end_token: " + e.to_string();
          if (t % 32 == 0) {
            const auto x = cache.layer_sparsity(s);
            trace[s].signal.insert(trace[s].signal.end(), x.begin(), x.end());
          }
          trace[s].types.push_back(cache.tracker(s).current());
        }
      }
      for (int s = 0; s < 2; ++s) trace[s].held = {tt::held_positions(cache, s)};
      return {};
    };
    Trace want[2];
    with_cache(full, [&](auto& cache) { REQUIRE(run(cache, -1, want).empty()); });
    for (bool batched : {false, true}) {
      INFO((batched ? "batched steps (end_step)" : "token by token (end_token)"));
      Trace got[ranks][2];
      LocalAllReduce reduce(ranks);
      int reductions[ranks] = {};
      std::string failed[ranks];
      std::vector<std::thread> threads;
      for (int r = 0; r < ranks; ++r) {
        threads.emplace_back([&, r] {
          with_cache(shards[r], [&](auto& cache) {
            const Status e = cache.set_signal_reduction(hq, [&, r](std::span<double> x) { return reduce(r, x); });
            failed[r] = e.is_ok() ? run(cache, r, got[r], batched) : e.to_string();
            reductions[r] = reduce.calls(r);
          });
        });
      }
      for (auto& th : threads) th.join();
      for (int r = 0; r < ranks; ++r) {
        INFO("rank " << r);
        REQUIRE(failed[r].empty());
        CHECK(reductions[r] > 2);
        for (int s = 0; s < 2; ++s) {
          INFO("sequence " << s);
          // The signal at every refresh, bit for bit (double sums of the shares are exact), so the types.
          REQUIRE(std::memcmp(got[r][s].signal.data(), want[s].signal.data(), want[s].signal.size() * 4) == 0);
          REQUIRE(got[r][s].types == want[s].types);
          // The rank's streams are the unsharded cache's streams of its KV heads, layer by layer.
          const auto& held = got[r][s].held.front();
          const auto& all = want[s].held.front();
          for (int l = 0; l < L; ++l) {
            for (int h = 0; h < hkv / ranks; ++h) {
              INFO("layer " << l << " KV head " << r * (hkv / ranks) + h);
              REQUIRE(held[static_cast<std::size_t>(l * (hkv / ranks) + h)] ==
                      all[static_cast<std::size_t>(l * hkv + r * (hkv / ranks) + h)]);
            }
          }
          for (std::size_t i = 0; i < want[s].out.size(); ++i) {
            const std::size_t n = static_cast<std::size_t>(hq / ranks * d);
            REQUIRE(std::memcmp(got[r][s].out[i].data(), want[s].out[i].data() + static_cast<std::size_t>(r) * n,
                                n * sizeof(float)) == 0);
          }
        }
      }
      if (batched) {
        // one all-reduce per refresh step for both sequences, against one per sequence above
        CHECK(reductions[0] == (steps - 1) / 32);  // refreshes at positions 32, 64, ...
      } else {
        CHECK(reductions[0] == 2 * ((steps - 1) / 32));
      }
    }
    // Without the all-reduce a rank's signal is the mean over its own heads only.
    Trace alone[2];
    with_cache(shards[0], [&](auto& cache) { REQUIRE(run(cache, 0, alone).empty()); });
    CHECK(alone[0].signal != want[0].signal);
  }
}

TEST_CASE("Tensor parallelism: a failed all-reduce is reported and changes nothing, and bad settings are refused",
          "[tensor_parallel][errors]") {
  const ThinKvSpec shard = spec(CacheMode::kThinKv, 2, 4);
  auto rng = tt::make_rng("tensor_parallel_errors");
  ThinKvSpec past = shard;  // heads 3 and 4 of a model with 4 KV heads
  past.model_kv_heads = 4;
  past.kv_head_offset = 3;
  CHECK_THROWS_WITH(with_cache(past, [](auto&) {}), Catch::Matchers::Contains("kv_head_offset 3"));
  past.kv_head_offset = 0;
  past.model_kv_heads = 1;
  CHECK_THROWS_WITH(with_cache(past, [](auto&) {}), Catch::Matchers::Contains("model_kv_heads 1"));
  with_cache(shard, [&](auto& cache) {
    CHECK(cache.set_signal_reduction(3, [](std::span<double>) { return Status::ok(); }).code() ==
          StatusCode::kInvalidArgument);
    CHECK(cache.set_signal_reduction(8, nullptr).code() == StatusCode::kInvalidArgument);
    bool fail = false;
    int calls = 0;
    REQUIRE(cache
                .set_signal_reduction(8,
                                      [&](std::span<double> x) {
                                        ++calls;
                                        if (fail) return Status{StatusCode::kInternal, "rank 1 timed out"};
                                        for (double& e : x) e *= 2;  // a second rank with the same heads
                                        return Status::ok();
                                      })
                .is_ok());
    const int d = shard.head_dim, L = shard.num_layers;
    auto token = [&](bool expect_ok) {
      REQUIRE(cache.begin_token(0).is_ok());
      for (int l = 0; l < L; ++l) {
        std::vector<float> k = tt::random_row(rng, 2 * d), v = tt::random_row(rng, 2 * d),
                           q = tt::random_row(rng, 4 * d);
        std::vector<float> out(q.size());
        REQUIRE(cache.append(0, l, k, v).is_ok());
        REQUIRE(cache.attend(0, l, q, out).is_ok());
      }
      CHECK(cache.end_token(0).is_ok() == expect_ok);
    };
    // Up to the first refresh step (tau 32): no call.
    while (cache.position(0) < 32) token(true);
    CHECK(calls == 0);
    fail = true;
    const auto types_before = cache.tracker(0).stats().refreshes;
    // The refresh step: the all-reduce fails, the token stays open, nothing changed.
    REQUIRE(cache.begin_token(0).is_ok());
    for (int l = 0; l < L; ++l) {
      std::vector<float> k = tt::random_row(rng, 2 * d), v = tt::random_row(rng, 2 * d), q = tt::random_row(rng, 4 * d);
      std::vector<float> out(q.size());
      REQUIRE(cache.append(0, l, k, v).is_ok());
      REQUIRE(cache.attend(0, l, q, out).is_ok());
    }
    const auto open = tt::snapshot_cache(cache.paged());
    const Status e = cache.end_token(0);
    CHECK(e.code() == StatusCode::kInternal);
    CHECK_THAT(e.message(), Catch::Matchers::Contains("all-reduce") && Catch::Matchers::Contains("rank 1 timed out"));
    CHECK(calls == 1);
    CHECK(cache.position(0) == 32);
    CHECK(cache.tracker(0).stats().refreshes == types_before);
    TT_REQUIRE_SAME_SNAPSHOT(open, tt::snapshot_cache(cache.paged()));
    // Retried once the rank is back: the token ends, the signal is the all-rank mean.
    fail = false;
    REQUIRE(cache.end_token(0).is_ok());
    CHECK(calls == 2);
    CHECK(cache.position(0) == 33);
    CHECK(cache.tracker(0).stats().refreshes == types_before + 1);
  });
}

TEST_CASE("Tensor parallelism: tensor_parallel_slice gives each rank its heads and refuses what cannot split",
          "[tensor_parallel]") {
  using thinkv::decoder::tensor_parallel_slice;
  const ThinKvSpec whole = spec(CacheMode::kThinKv, 8, 32);
  for (int size : {1, 2, 4, 8}) {
    for (int rank = 0; rank < size; ++rank) {
      CAPTURE(size, rank);
      ThinKvSpec s;
      REQUIRE(tensor_parallel_slice(whole, rank, size, s).is_ok());
      CHECK(s.num_kv_heads == 8 / size);
      CHECK(s.num_q_heads == 32 / size);
      CHECK(s.model_kv_heads == 8);
      CHECK(s.kv_head_offset == rank * (8 / size));
      CHECK(s.num_layers == whole.num_layers);
      CHECK(s.head_dim == whole.head_dim);
      CHECK(s.token_budget == whole.token_budget);
      CHECK(s.mode == whole.mode);
      CHECK(s.validate().is_ok());
    }
  }
  auto refused = [&](const ThinKvSpec& w, int rank, int size, const char* needle) {
    ThinKvSpec out = spec(CacheMode::kFull, 2, 4);
    const ThinKvSpec before = out;
    const Status s = tensor_parallel_slice(w, rank, size, out);
    INFO(s.to_string());
    CHECK(s.code() == StatusCode::kInvalidArgument);
    CHECK(s.message().find(needle) != std::string::npos);
    CHECK(out.num_kv_heads == before.num_kv_heads);  // the output is untouched
    CHECK(out.kv_head_offset == before.kv_head_offset);
  };
  refused(whole, 2, 2, "rank 2 of 2");
  refused(whole, -1, 2, "rank -1 of 2");
  refused(whole, 0, 0, "rank 0 of 0");
  refused(whole, 0, 3, "8 KV heads and 32 query heads do not split evenly over 3 ranks");
  refused(whole, 0, 16, "over 16 ranks");
  ThinKvSpec half;
  REQUIRE(tensor_parallel_slice(whole, 1, 2, half).is_ok());
  refused(half, 0, 2, "already a slice (model_kv_heads 8, num_kv_heads 4)");
}
