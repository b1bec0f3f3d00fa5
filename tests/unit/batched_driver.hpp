#pragma once
/// \file batched_driver.hpp
/// Drives a batched cache (begin_step / append_batch / attend_batch / end_step over tensors in
/// its backend's memory) and a reference cache (ThinKvCache over the CPU backend, one
/// begin_token / append / attend / end_token per sequence, in batch order) through the same
/// random continuous-batching run: sequences join, finish and are reset at any step, the batch
/// order is shuffled every step, thought types shift (the query scale steers sparsity), and a
/// K/V value may be made non-finite. After every step it compares the decisions (segments with
/// types, sizes and levels; each stream's live slots and their positions; counters) exactly and
/// the attention outputs within `tolerance` (0: bit for bit, after both are rounded to the
/// output's element type). Used by tests/unit/test_batched_decode.cpp (CPU backend) and
/// tests/kernels/test_cuda_batched.cpp (CUDA backend, device tensors).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "thinkv/thinkv_cache.hpp"

namespace bt {

using namespace thinkv;

/// K-means selection on the host through the policy's selector (a type other than KmeansSelector,
/// so the cache never hands the selection to the backend's select_segments): the reference path.
struct HostKmeans : KmeansSelector {};
struct HostKmeansPolicy : CachePolicy<ThoughtClassifier, PrecisionMap, RetentionSchedule, HostKmeans> {};

/// Where a batched cache's tensors live: `put` copies host bytes in, `get` copies them out.
struct TensorMemory {
  std::function<void*(std::size_t)> alloc;
  std::function<void(void*)> free;
  std::function<void(void*, const void*, std::size_t)> put;
  std::function<void(void*, const void*, std::size_t)> get;
};

inline TensorMemory host_memory() {
  return {[](std::size_t n) { return static_cast<void*>(new std::uint8_t[n]); },
          [](void* p) { delete[] static_cast<std::uint8_t*>(p); },
          [](void* d, const void* s, std::size_t n) { std::memcpy(d, s, n); },
          [](void* d, const void* s, std::size_t n) { std::memcpy(d, s, n); }};
}

/// One buffer in a TensorMemory.
struct Buffer {
  const TensorMemory* mem = nullptr;
  void* p = nullptr;
  std::size_t bytes = 0;
  Buffer(const TensorMemory& m, std::size_t n) : mem(&m), p(m.alloc(n)), bytes(n) {}
  ~Buffer() { mem->free(p); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};

/// Encodes floats as `type` (what the batched cache reads) and returns the values it encodes
/// (what the reference is given).
inline std::vector<float> encode(const std::vector<float>& x, ElementType type, std::vector<std::uint8_t>& bytes) {
  bytes.assign(x.size() * static_cast<std::size_t>(element_bytes(type)), 0);
  std::vector<float> back(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    store_element(bytes.data(), type, i, x[i]);
    back[i] = load_element(bytes.data(), type, i);
  }
  return back;
}

struct RunOptions {
  int steps = 300;
  ElementType kv_type = ElementType::kF32;
  ElementType q_type = ElementType::kF32;
  ElementType out_type = ElementType::kF32;
  double join = 0.3;         ///< chance an idle sequence joins at a step
  double finish = 0.01;      ///< chance a running sequence finishes (is reset) at a step
  double poison = 0.0;       ///< chance per step that one sequence's K or V gets a NaN or Inf
  bool wait_faults = false;  ///< poll_faults(true) after a poisoned step (device backends)
  double prompt = 0.0;       ///< chance a joining sequence (at position 0) first prefills a prompt
  int max_prompt = 0;        ///< longest prompt (lengths uniform in 1..max_prompt)
  int prompt_chunks = 1;     ///< most chunks a prompt comes in (counts uniform in 1..this; cut at random)
  /// Chance per step and running sequence of a llama.cpp seq_rm between steps (remove(), the
  /// same range on both caches, which must answer alike): roll backs inside the open group and
  /// to group boundaries, unaligned ones (refused), middle ranges.
  double remove = 0.0;
  /// Largest |batched - reference| allowed per output value, given the reference row's largest
  /// |value| and the sequence's live tokens; null: bit for bit.
  std::function<double(double max_ref, std::int64_t tokens)> tolerance;
};

struct RunReport {
  std::int64_t steps = 0, tokens = 0, faults = 0, finishes = 0, max_batch = 0, prompts = 0, prompt_tokens = 0,
               prompt_chunks = 0;
  std::int64_t removes = 0, removes_refused = 0;
  double worst_rel_err = 0;
  double worst_prompt_err = 0;  ///< largest prefill error against the float64 reference, / max |out|
};

/// Prefills a prompt of random K/V/q in the batched cache (begin_prompt / prefill / end_prompt,
/// in up to o.prompt_chunks chunks cut at random) and feeds the same tokens to the reference one by
/// one after pin_prefix (its outputs unused: the prefill attends the prompt's own K/V). Checks
/// every prefill output against attention in float64 over the encoded inputs: a chunk's query t
/// over the tokens the batched cache stored before the chunk (read back dequantized) and the
/// chunk's tokens 0..t: |error| <= 2^-(mantissa bits of out) * max|out| + 5e-5 * max|v| (FP32
/// arithmetic with up to `tokens` terms, and one rounding of the output type).
template <class Batched, class Reference>
std::string run_prompt(Batched& bc, Reference& rc, const TensorMemory& mem, std::mt19937_64& rng, const RunOptions& o,
                       int seq, int tokens, RunReport& report) {
  const ThinKvConfig& c = bc.config();
  const int L = c.num_layers, hkv = c.num_kv_heads, hq = c.num_q_heads, d = c.head_dim, G = hq / hkv;
  const auto T = static_cast<std::size_t>(tokens);
  auto fail = [&](const std::string& what) {
    return "prompt of sequence " + std::to_string(seq) + " (" + std::to_string(tokens) + " tokens): " + what;
  };
  if (Status e = rc.pin_prefix(seq, tokens); !e.is_ok()) return fail("reference pin_prefix: " + e.to_string());
  std::normal_distribution<float> normal;
  const float sharp = std::vector<float>{0.5f, 1.5f, 4.0f}[rng() % 3];
  Buffer kbuf(mem, T * hkv * d * 4), vbuf(mem, T * hkv * d * 4), qbuf(mem, T * hq * d * 4), obuf(mem, T * hq * d * 4);
  std::vector<std::uint8_t> qb, ob(T * hq * d * 4);
  std::vector<std::vector<float>> ks(static_cast<std::size_t>(L)), vs(ks.size());
  std::vector<std::vector<std::uint8_t>> kbytes(ks.size()), vbytes(ks.size());
  for (int l = 0; l < L; ++l) {
    std::vector<float> k(T * hkv * d), v(k.size());
    for (auto& x : k) x = normal(rng);
    for (auto& x : v) x = normal(rng);
    ks[static_cast<std::size_t>(l)] = encode(k, o.kv_type, kbytes[static_cast<std::size_t>(l)]);
    vs[static_cast<std::size_t>(l)] = encode(v, o.kv_type, vbytes[static_cast<std::size_t>(l)]);
  }
  // Chunk boundaries: 0 = cut[0] < ... < cut[n] = tokens.
  std::vector<int> cut{0, tokens};
  const int chunks =
      1 + static_cast<int>(rng() % static_cast<unsigned>(std::max(1, std::min(o.prompt_chunks, tokens))));
  while (static_cast<int>(cut.size()) < chunks + 1) {
    const int x = 1 + static_cast<int>(rng() % static_cast<unsigned>(tokens - 1));
    if (std::find(cut.begin(), cut.end(), x) == cut.end()) cut.insert(std::upper_bound(cut.begin(), cut.end(), x), x);
  }
  const double out_eps = o.out_type == ElementType::kF32 ? 0x1p-23 : o.out_type == ElementType::kF16 ? 0x1p-10 : 0x1p-7;
  const int kvb = element_bytes(o.kv_type);
  for (std::size_t ci = 0; ci + 1 < cut.size(); ++ci) {
    const auto c0 = static_cast<std::size_t>(cut[ci]), n = static_cast<std::size_t>(cut[ci + 1]) - c0;
    auto cfail = [&](const std::string& what) {
      return fail("chunk " + std::to_string(c0) + ".." + std::to_string(c0 + n - 1) + ": " + what);
    };
    if (Status e = bc.begin_prompt(seq, static_cast<int>(n)); !e.is_ok())
      return cfail("begin_prompt: " + e.to_string());
    for (int l = 0; l < L; ++l) {
      const auto lu = static_cast<std::size_t>(l);
      std::vector<float> q(n * hq * d);
      for (auto& x : q) x = normal(rng) * sharp;
      const std::vector<float> qr = encode(q, o.q_type, qb);
      const std::size_t row_bytes = static_cast<std::size_t>(hkv) * d * kvb;
      mem.put(kbuf.p, kbytes[lu].data() + c0 * row_bytes, n * row_bytes);
      mem.put(vbuf.p, vbytes[lu].data() + c0 * row_bytes, n * row_bytes);
      mem.put(qbuf.p, qb.data(), qb.size());
      std::vector<std::uint8_t> poison(n * hq * d * 4, 0xFF);  // NaN in every element type
      mem.put(obuf.p, poison.data(), poison.size());
      // What the chunk attends to before its own tokens: each KV head's stored tokens, as stored.
      std::vector<std::vector<float>> sk(static_cast<std::size_t>(hkv)), sv(sk.size());
      for (int h = 0; h < hkv && c0 > 0; ++h) {
        const int st = bc.stream_of(seq, l, h);
        std::vector<float> k1(static_cast<std::size_t>(d)), v1(k1.size());
        auto keep = [&] {
          sk[static_cast<std::size_t>(h)].insert(sk[static_cast<std::size_t>(h)].end(), k1.begin(), k1.end());
          sv[static_cast<std::size_t>(h)].insert(sv[static_cast<std::size_t>(h)].end(), v1.begin(), v1.end());
        };
        for (SlotRef r : bc.paged().table().live_slot_list(st)) {
          if (Status e = bc.paged().read_token(r, k1, v1); !e.is_ok()) return cfail("read_token: " + e.to_string());
          keep();
        }
        for (int row = 0; row < bc.paged().table().staged_count(st); ++row) {
          if (Status e = bc.paged().backend().read_staged(st, row, k1.data(), v1.data()); !e.is_ok()) {
            return cfail("read_staged: " + e.to_string());
          }
          keep();
        }
      }
      if (Status e =
              bc.prefill(l, seq, {qbuf.p, o.q_type}, {kbuf.p, o.kv_type}, {vbuf.p, o.kv_type}, {obuf.p, o.out_type});
          !e.is_ok()) {
        return cfail("prefill layer " + std::to_string(l) + ": " + e.to_string());
      }
      mem.get(ob.data(), obuf.p, n * hq * d * static_cast<std::size_t>(element_bytes(o.out_type)));
      const std::vector<float>& kr = ks[lu];
      const std::vector<float>& vr = vs[lu];
      const double scale = c.softmax_scale > 0 ? c.softmax_scale : 1.0 / std::sqrt(static_cast<double>(d));
      std::vector<double> acc(static_cast<std::size_t>(d));
      for (std::size_t t = 0; t < n; ++t) {
        for (int h = 0; h < hq; ++h) {
          const int kvh = h / G;
          const std::vector<float>& skh = sk[static_cast<std::size_t>(kvh)];
          const std::vector<float>& svh = sv[static_cast<std::size_t>(kvh)];
          const std::size_t ns = skh.size() / static_cast<std::size_t>(d);
          const float* qh = &qr[(t * hq + h) * d];
          // Key/value j: stored token j < ns, then chunk token j - ns.
          auto key = [&](std::size_t j) { return j < ns ? &skh[j * d] : &kr[((c0 + j - ns) * hkv + kvh) * d]; };
          auto val = [&](std::size_t j) { return j < ns ? &svh[j * d] : &vr[((c0 + j - ns) * hkv + kvh) * d]; };
          std::vector<double> sc(ns + t + 1);
          double m = -INFINITY, lsum = 0, vmax = 0;
          for (std::size_t j = 0; j < sc.size(); ++j) {
            double dot = 0;
            for (int x = 0; x < d; ++x) dot += static_cast<double>(qh[x]) * key(j)[x];
            sc[j] = dot * scale;
            m = std::max(m, sc[j]);
          }
          std::fill(acc.begin(), acc.end(), 0.0);
          for (std::size_t j = 0; j < sc.size(); ++j) {
            const double e = std::exp(sc[j] - m);
            lsum += e;
            for (int x = 0; x < d; ++x) {
              const double vx = val(j)[x];
              acc[static_cast<std::size_t>(x)] += e * vx;
              vmax = std::max(vmax, std::fabs(vx));
            }
          }
          double max_ref = 0, max_err = 0;
          for (int x = 0; x < d; ++x) {
            const double want = acc[static_cast<std::size_t>(x)] / lsum;
            const double got = load_element(ob.data(), o.out_type, (t * hq + h) * d + x);
            max_ref = std::max(max_ref, std::fabs(want));
            max_err = std::max(max_err, std::isnan(got) ? INFINITY : std::fabs(got - want));
          }
          const double tol = out_eps * max_ref + 5e-5 * vmax;
          if (!(max_err <= tol)) {
            return cfail("layer " + std::to_string(l) + " token " + std::to_string(c0 + t) + " query head " +
                         std::to_string(h) + ": prefill output differs from float64 by " + std::to_string(max_err) +
                         " (tolerance " + std::to_string(tol) + ")");
          }
          report.worst_prompt_err = std::max(report.worst_prompt_err, max_err / std::max(max_ref, 1e-30));
        }
      }
    }
    if (Status e = bc.end_prompt(seq); !e.is_ok()) return cfail("end_prompt: " + e.to_string());
    ++report.prompt_chunks;
  }
  // The reference stores the same tokens one at a time.
  std::vector<float> out(static_cast<std::size_t>(hq) * d), q1(out.size());
  for (std::size_t t = 0; t < T; ++t) {
    if (Status e = rc.begin_token(seq); !e.is_ok()) return fail("reference begin_token: " + e.to_string());
    for (int l = 0; l < L; ++l) {
      const auto off = static_cast<std::ptrdiff_t>(t * hkv * d);
      const auto n = static_cast<std::size_t>(hkv) * d;
      if (Status e = rc.append(seq, l, std::span<const float>(ks[static_cast<std::size_t>(l)]).subspan(off, n),
                               std::span<const float>(vs[static_cast<std::size_t>(l)]).subspan(off, n));
          !e.is_ok()) {
        return fail("reference append: " + e.to_string());
      }
      if (Status e = rc.attend(seq, l, q1, out); !e.is_ok()) return fail("reference attend: " + e.to_string());
    }
    if (Status e = rc.end_token(seq); !e.is_ok()) return fail("reference end_token: " + e.to_string());
  }
  ++report.prompts;
  report.prompt_tokens += tokens;
  return {};
}

/// Runs the scenario; returns an empty string or the first mismatch, with `report` filled.
template <class Batched, class Reference>
std::string run_batched(Batched& bc, Reference& rc, const TensorMemory& mem, std::mt19937_64& rng, const RunOptions& o,
                        RunReport& report) {
  const ThinKvConfig& c = bc.config();
  const int S = c.num_sequences, L = c.num_layers, hkv = c.num_kv_heads, hq = c.num_q_heads, d = c.head_dim;
  std::vector<std::uint8_t> running(static_cast<std::size_t>(S), 0);
  std::normal_distribution<float> normal;
  std::vector<float> sharp(static_cast<std::size_t>(S), 1.0f);
  const std::size_t kv_rows = static_cast<std::size_t>(S) * hkv, q_rows = static_cast<std::size_t>(S) * hq;
  Buffer kbuf(mem, kv_rows * d * 4), vbuf(mem, kv_rows * d * 4), qbuf(mem, q_rows * d * 4), obuf(mem, q_rows * d * 4);
  std::vector<std::uint8_t> kb, vb, qb, ob(q_rows * d * 4);
  auto fail = [&](const std::string& what) { return "step " + std::to_string(report.steps) + ": " + what; };
  for (int t = 0; t < o.steps; ++t, ++report.steps) {
    // Joins and finishes.
    for (int s = 0; s < S; ++s) {
      auto& r = running[static_cast<std::size_t>(s)];
      if (r != 0 && std::uniform_real_distribution<double>(0, 1)(rng) < o.finish) {
        if (!bc.reset_sequence(s).is_ok() || !rc.reset_sequence(s).is_ok()) return fail("reset failed");
        r = 0;
        ++report.finishes;
      } else if (r == 0 && std::uniform_real_distribution<double>(0, 1)(rng) < o.join) {
        r = 1;
        if (bc.position(s) == 0 && std::uniform_real_distribution<double>(0, 1)(rng) < o.prompt) {
          const int len = 1 + static_cast<int>(rng() % static_cast<unsigned>(std::max(1, o.max_prompt)));
          if (std::string e = run_prompt(bc, rc, mem, rng, o, s, std::min(len, c.max_tokens - 1), report); !e.empty()) {
            return fail(e);
          }
        }
      }
      if (r != 0 && bc.position(s) > 0 && std::uniform_real_distribution<double>(0, 1)(rng) < o.remove) {
        const std::int32_t P = bc.position(s), g = c.group_size;
        std::int32_t p0 = 0, p1 = -1;
        switch (rng() % 4) {
          case 0: p0 = P - 1 - static_cast<std::int32_t>(rng() % static_cast<unsigned>(g)); break;  // short tail
          case 1: p0 = (P - static_cast<std::int32_t>(rng() % static_cast<unsigned>(4 * g))) / g * g; break;
          case 2: p0 = P - 1 - static_cast<std::int32_t>(rng() % static_cast<unsigned>(4 * g)); break;  // any tail
          default:  // a middle range
            p0 = static_cast<std::int32_t>(rng() % static_cast<unsigned>(P));
            p1 = p0 + 1 + static_cast<std::int32_t>(rng() % static_cast<unsigned>(3 * g));
        }
        const Status ea = bc.remove(s, p0, p1), eb = rc.remove(s, p0, p1);
        if (ea.code() != eb.code() || bc.position(s) != rc.position(s)) {
          return fail("remove(" + std::to_string(s) + ", " + std::to_string(p0) + ", " + std::to_string(p1) +
                      "): " + ea.to_string() + " vs the reference's " + eb.to_string());
        }
        if (ea.is_ok()) {
          ++report.removes;
        } else if (ea.code() == StatusCode::kUnsupported) {
          ++report.removes_refused;
        } else {
          return fail("remove: " + ea.to_string());
        }
        if (bc.position(s) == 0) r = 0;  // everything removed: the sequence is free again
      }
      if (r != 0 && bc.position(s) >= c.max_tokens) {
        if (!bc.reset_sequence(s).is_ok() || !rc.reset_sequence(s).is_ok()) return fail("reset failed");
        r = 0;
      }
      if (t % 64 == 0) sharp[static_cast<std::size_t>(s)] = std::vector<float>{0.0f, 1.5f, 6.0f}[rng() % 3];
    }
    std::vector<int> batch;
    for (int s = 0; s < S; ++s) {
      if (running[static_cast<std::size_t>(s)] != 0) batch.push_back(s);
    }
    if (batch.empty()) continue;
    std::shuffle(batch.begin(), batch.end(), rng);
    const std::size_t n = batch.size();
    report.max_batch = std::max<std::int64_t>(report.max_batch, static_cast<std::int64_t>(n));
    if (Status e = bc.begin_step(batch); !e.is_ok()) return fail("begin_step: " + e.to_string());
    for (int s : batch) {
      if (Status e = rc.begin_token(s); !e.is_ok()) return fail("reference begin_token: " + e.to_string());
    }
    // A poisoned row this step: (batch index, head, K or V, channel).
    int poison_b = -1, poison_h = 0, poison_kv = 0, poison_c = 0, poison_layer = 0;
    if (std::uniform_real_distribution<double>(0, 1)(rng) < o.poison) {
      poison_b = static_cast<int>(rng() % n);
      poison_h = static_cast<int>(rng() % static_cast<unsigned>(hkv));
      poison_kv = static_cast<int>(rng() % 2);
      poison_c = static_cast<int>(rng() % static_cast<unsigned>(d));
      poison_layer = static_cast<int>(rng() % static_cast<unsigned>(L));
    }
    std::vector<float> k(n * hkv * d), v(k.size()), q(n * hq * d), ref_out(q.size());
    for (int l = 0; l < L; ++l) {
      for (auto& x : k) x = normal(rng);
      for (auto& x : v) x = normal(rng);
      for (std::size_t b = 0; b < n; ++b) {
        for (std::size_t i = 0; i < static_cast<std::size_t>(hq) * d; ++i) {
          q[b * hq * d + i] = normal(rng) * sharp[static_cast<std::size_t>(batch[b])];
        }
      }
      std::vector<float> kr = encode(k, o.kv_type, kb), vr = encode(v, o.kv_type, vb), qr = encode(q, o.q_type, qb);
      if (l == poison_layer && poison_b >= 0) {
        const std::size_t i = (static_cast<std::size_t>(poison_b) * hkv + poison_h) * d + poison_c;
        const float bad =
            (rng() % 2) != 0 ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
        std::vector<std::uint8_t>& bytes = poison_kv == 0 ? kb : vb;
        store_element(bytes.data(), o.kv_type, i, bad);
        // The backend stores that token (all of the sequence's heads' row) as zeros.
        const std::size_t row0 = (static_cast<std::size_t>(poison_b) * hkv + poison_h) * d;
        std::fill_n(kr.begin() + static_cast<std::ptrdiff_t>(row0), d, 0.0f);
        std::fill_n(vr.begin() + static_cast<std::ptrdiff_t>(row0), d, 0.0f);
      }
      mem.put(kbuf.p, kb.data(), kb.size());
      mem.put(vbuf.p, vb.data(), vb.size());
      mem.put(qbuf.p, qb.data(), qb.size());
      if (Status e = bc.append_batch(l, batch, {kbuf.p, o.kv_type}, {vbuf.p, o.kv_type}); !e.is_ok()) {
        return fail("append_batch: " + e.to_string());
      }
      if (Status e = bc.attend_batch(l, batch, {qbuf.p, o.q_type}, {obuf.p, o.out_type}); !e.is_ok()) {
        return fail("attend_batch: " + e.to_string());
      }
      for (std::size_t b = 0; b < n; ++b) {
        const auto kvs = std::span<const float>(kr).subspan(b * hkv * d, static_cast<std::size_t>(hkv) * d);
        const auto vvs = std::span<const float>(vr).subspan(b * hkv * d, static_cast<std::size_t>(hkv) * d);
        if (Status e = rc.append(batch[b], l, kvs, vvs); !e.is_ok()) return fail("reference append: " + e.to_string());
        if (Status e =
                rc.attend(batch[b], l, std::span<const float>(qr).subspan(b * hq * d, static_cast<std::size_t>(hq) * d),
                          std::span<float>(ref_out).subspan(b * hq * d, static_cast<std::size_t>(hq) * d));
            !e.is_ok()) {
          return fail("reference attend: " + e.to_string());
        }
      }
      mem.get(ob.data(), obuf.p, n * hq * d * static_cast<std::size_t>(element_bytes(o.out_type)));
      for (std::size_t b = 0; b < n; ++b) {
        for (int h = 0; h < hq; ++h) {
          const std::size_t row = (b * hq + h) * d;
          double max_ref = 0, max_err = 0;
          for (int i = 0; i < d; ++i) {
            std::uint8_t tmp[4];
            store_element(tmp, o.out_type, 0, ref_out[row + i]);
            const double want = load_element(tmp, o.out_type, 0);
            const double got = load_element(ob.data(), o.out_type, row + i);
            max_ref = std::max(max_ref, std::fabs(want));
            max_err = std::max(max_err, std::isnan(got) ? INFINITY : std::fabs(got - want));
          }
          const double tol = o.tolerance ? o.tolerance(max_ref, bc.live_tokens(batch[b])) : 0.0;
          if (!(max_err <= tol)) {
            return fail("layer " + std::to_string(l) + " sequence " + std::to_string(batch[b]) + " query head " +
                        std::to_string(h) + ": output differs by " + std::to_string(max_err) + " (tolerance " +
                        std::to_string(tol) + ", max |out| " + std::to_string(max_ref) + ")");
          }
          report.worst_rel_err = std::max(report.worst_rel_err, max_err / std::max(max_ref, 1e-30));
        }
      }
    }
    if (Status e = bc.end_step(batch); !e.is_ok()) return fail("end_step: " + e.to_string());
    for (int s : batch) {
      if (Status e = rc.end_token(s); !e.is_ok()) return fail("reference end_token: " + e.to_string());
    }
    report.tokens += static_cast<std::int64_t>(n);
    if (poison_b >= 0) {
      const int s = batch[static_cast<std::size_t>(poison_b)];
      if (o.wait_faults) {
        if (Status e = bc.poll_faults(true); !e.is_ok()) return fail("poll_faults: " + e.to_string());
      }
      if (!bc.faulted(s)) return fail("sequence " + std::to_string(s) + " got a non-finite K/V but is not faulted");
      // A batch naming it is refused whole, naming it; nothing begins.
      const std::vector<std::int32_t> before = [&] {
        std::vector<std::int32_t> p;
        for (int x : batch) p.push_back(bc.position(x));
        return p;
      }();
      const Status e = bc.begin_step(batch);
      if (e.code() != StatusCode::kNonFinite ||
          e.message().find("sequence " + std::to_string(s)) == std::string::npos) {
        return fail("begin_step with a faulted sequence: " + e.to_string());
      }
      for (std::size_t b = 0; b < n; ++b) {
        if (bc.position(batch[b]) != before[b]) return fail("a refused begin_step moved a sequence");
      }
      ++report.faults;
      if (!bc.reset_sequence(s).is_ok() || !rc.reset_sequence(s).is_ok()) return fail("reset failed");
      if (bc.faulted(s)) return fail("reset_sequence left the fault");
      running[static_cast<std::size_t>(s)] = 0;
    }
    for (int s = 0; s < S; ++s) {
      if (bc.faulted(s)) return fail("sequence " + std::to_string(s) + " faulted without a bad value");
    }
    // Evictions a device backend has not reported to the host yet (the outputs above already saw
    // them on the device) are recorded before the table is compared.
    if (Status e = bc.settle(); !e.is_ok()) return fail("settle: " + e.to_string());
    // Decisions: segments, live slots (block, slot, position) of every stream, counters.
    for (int s : batch) {
      const auto& sa = bc.segments(s);
      const auto& sb = rc.segments(s);
      if (sa.size() != sb.size()) return fail("sequence " + std::to_string(s) + ": segment counts differ");
      for (std::size_t i = 0; i < sa.size(); ++i) {
        if (sa[i].id != sb[i].id || sa[i].type != sb[i].type || sa[i].size != sb[i].size ||
            sa[i].level != sb[i].level || sa[i].start != sb[i].start) {
          return fail("sequence " + std::to_string(s) + ": segment " + std::to_string(i) + " differs");
        }
      }
      const CacheReport ra = bc.report(s), rb = rc.report(s);
      if (ra.tokens_evicted != rb.tokens_evicted || ra.eviction_calls != rb.eviction_calls ||
          ra.live_tokens != rb.live_tokens || ra.held_bytes != rb.held_bytes) {
        return fail("sequence " + std::to_string(s) + ": its report differs");
      }
      if (bc.tracker(s).current() != rc.tracker(s).current()) {
        return fail("sequence " + std::to_string(s) + ": thought types differ");
      }
      for (int l = 0; l < L; ++l) {
        for (int h = 0; h < hkv; ++h) {
          const int st = bc.stream_of(s, l, h);
          const auto& ta = bc.paged().table();
          const auto& tb = rc.paged().table();
          // The positions held, in the stream's slot order (what attention sums over). Block
          // ids may differ: a prefill takes a layer's blocks for the whole prompt at once.
          const auto la = ta.live_slot_list(st);
          const auto lb = tb.live_slot_list(st);
          if (la.size() != lb.size()) return fail("stream " + std::to_string(st) + ": live slot counts differ");
          for (std::size_t i = 0; i < la.size(); ++i) {
            if (ta.slot_position(la[i]) != tb.slot_position(lb[i]) || la[i].slot != lb[i].slot ||
                ta.slot_segment(la[i]) != tb.slot_segment(lb[i]))
              return fail("stream " + std::to_string(st) + ": live slot " + std::to_string(i) + " differs");
          }
          if (ta.staged_count(st) != tb.staged_count(st))
            return fail("stream " + std::to_string(st) + ": staged differ");
          for (int i = 0; i < ta.staged_count(st); ++i) {
            if (ta.staged_segment(st, i) != tb.staged_segment(st, i))
              return fail("stream " + std::to_string(st) + ": staged segments differ");
          }
        }
      }
    }
    const ThinKvStats& xa = bc.stats();
    const ThinKvStats& xb = rc.stats();
    if (xa.steps != xb.steps || xa.tokens_evicted != xb.tokens_evicted || xa.eviction_calls != xb.eviction_calls ||
        xa.refreshes != xb.refreshes || xa.selections != xb.selections ||
        xa.transition_events != xb.transition_events) {
      return fail("counters differ");
    }
    if (!(bc.memory() == rc.memory())) return fail("memory differs");
  }
  return {};
}

}  // namespace bt
