#pragma once
/// \file model.hpp
/// Llama weights as the decoder uses them: a configuration (read from the file, nothing assumed
/// about its size), weight matrices in F32, F16, BF16 or Q8_0 with a matrix-vector product for
/// each, and the model that owns the mapped file the matrices point into.
///
/// A Matrix is `rows x cols`, row-major, one row per output (W x with x of length cols). Q8_0
/// comes in two layouts: llama2.c's v2 export (all int8 codes of the tensor, then one FP32 scale
/// per 32 codes of the flattened tensor; a group may straddle two rows) and GGUF's (per row,
/// blocks of an FP16 scale and 32 int8 codes).

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "model_file.hpp"
#include "thinkv/status.hpp"
#include "tokenizer.hpp"

namespace thinkv::decoder {

enum class WeightType : std::uint8_t { kF32, kF16, kBF16, kQ8_0 };

inline const char* to_string(WeightType t) noexcept {
  switch (t) {
    case WeightType::kF32: return "F32";
    case WeightType::kF16: return "F16";
    case WeightType::kBF16: return "BF16";
    case WeightType::kQ8_0: return "Q8_0";
  }
  return "?";
}

/// IEEE half -> float (all cases: zero, subnormal, normal, inf, NaN).
inline float f16_to_f32(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t exp = (h >> 10) & 0x1Fu;
  std::uint32_t man = h & 0x3FFu;
  std::uint32_t bits = 0;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((man & 0x400u) == 0) {
        man <<= 1;
        --exp;
      }
      man &= 0x3FFu;
      bits = sign | (exp << 23) | (man << 13);
    }
  } else if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f = 0.0f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
/// f16_to_f32 without branches (the compiler can vectorize it in the F16 matrix-vector inner
/// loop): the exponent is rebiased by a multiplication with 2^112, which is exact for normal and
/// subnormal halves; Inf/NaN get their all-ones exponent back by a select. Same results as
/// f16_to_f32 for all 65536 inputs (checked in test_decoder).
inline float f16_to_f32_fast(std::uint16_t h) noexcept {
  const std::uint32_t em = h & 0x7FFFu;
  float f = std::bit_cast<float>(em << 13) * 0x1p112f;
  std::uint32_t r = std::bit_cast<std::uint32_t>(f);
  r |= em >= 0x7C00u ? 0x7F800000u : 0u;
  r |= static_cast<std::uint32_t>(h & 0x8000u) << 16;
  return std::bit_cast<float>(r);
}
inline float bf16_to_f32(std::uint16_t h) noexcept {
  const std::uint32_t bits = static_cast<std::uint32_t>(h) << 16;
  float f = 0.0f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline constexpr int kQ8Group = 32;                   ///< codes per Q8_0 scale (both layouts)
inline constexpr std::size_t kGgufQ8BlockBytes = 34;  ///< fp16 scale + 32 int8

/// Runs fn(begin, end) over [0, n) split across threads when `work` (multiply-adds) is large
/// enough to pay for starting them; otherwise on the calling thread.
template <class Fn>
void parallel_rows(std::int64_t n, std::int64_t work, int max_threads, Fn&& fn) {
  constexpr std::int64_t kMinWorkPerThread = std::int64_t{1} << 18;
  int threads = std::max(1, max_threads);
  threads = static_cast<int>(std::min<std::int64_t>(threads, std::max<std::int64_t>(1, work / kMinWorkPerThread)));
  threads = static_cast<int>(std::min<std::int64_t>(threads, n));
  if (threads <= 1) {
    fn(std::int64_t{0}, n);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(static_cast<std::size_t>(threads - 1));
  const std::int64_t chunk = (n + threads - 1) / threads;
  for (int t = 1; t < threads; ++t) {
    const std::int64_t b = t * chunk, e = std::min(n, b + chunk);
    if (b < e) pool.emplace_back([&fn, b, e] { fn(b, e); });
  }
  fn(std::int64_t{0}, std::min(n, chunk));
  for (auto& th : pool) th.join();
}

/// A weight matrix viewed in place (the bytes live in the model's mapped file or owned buffers).
struct Matrix {
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  WeightType type = WeightType::kF32;
  const float* f32 = nullptr;              ///< kF32
  const std::uint16_t* u16 = nullptr;      ///< kF16 / kBF16
  const std::int8_t* q = nullptr;          ///< kQ8_0, llama2.c layout: rows*cols codes
  const std::uint8_t* q_scales = nullptr;  ///< kQ8_0, llama2.c layout: FP32 scale per `group` codes (unaligned-safe)
  int group = 32;                          ///< kQ8_0, llama2.c layout: codes per scale (the file's group_size)
  const std::uint8_t* blocks = nullptr;    ///< kQ8_0, GGUF layout: rows * cols/32 blocks of 34 bytes

  [[nodiscard]] bool empty() const noexcept { return rows == 0; }

  /// Bytes of the weights (for reports).
  [[nodiscard]] std::int64_t bytes() const noexcept {
    const std::int64_t n = rows * cols;
    switch (type) {
      case WeightType::kF32: return 4 * n;
      case WeightType::kF16:
      case WeightType::kBF16: return 2 * n;
      case WeightType::kQ8_0: return blocks ? n + 2 * (n / kQ8Group) : n + 4 * (n / group);
    }
    return 0;
  }

  /// y[r] = sum_c W[r][c] x[c] for r in [r0, r1).
  void matvec_rows(const float* x, float* y, std::int64_t r0, std::int64_t r1) const noexcept {
    for (std::int64_t r = r0; r < r1; ++r) y[r] = dot_row(r, x);
  }
  /// y = W x (y has rows entries, x has cols).
  void matvec(const float* x, float* y, int threads = 1) const {
    parallel_rows(rows, rows * cols, threads, [&](std::int64_t b, std::int64_t e) { matvec_rows(x, y, b, e); });
  }

  /// Dequantizes row r into out[cols].
  void row(std::int64_t r, float* out) const noexcept {
    switch (type) {
      case WeightType::kF32: std::memcpy(out, f32 + r * cols, static_cast<std::size_t>(cols) * sizeof(float)); return;
      case WeightType::kF16:
        for (std::int64_t c = 0; c < cols; ++c) out[c] = f16_to_f32(u16[r * cols + c]);
        return;
      case WeightType::kBF16:
        for (std::int64_t c = 0; c < cols; ++c) out[c] = bf16_to_f32(u16[r * cols + c]);
        return;
      case WeightType::kQ8_0:
        if (blocks != nullptr) {
          const std::uint8_t* b = blocks + static_cast<std::size_t>(r * (cols / kQ8Group)) * kGgufQ8BlockBytes;
          for (std::int64_t c = 0; c < cols; c += kQ8Group, b += kGgufQ8BlockBytes) {
            const float d = f16_to_f32(load_u16(b));
            const auto* qs = reinterpret_cast<const std::int8_t*>(b + 2);
            for (int k = 0; k < kQ8Group; ++k) out[c + k] = d * static_cast<float>(qs[k]);
          }
        } else {
          for (std::int64_t c = 0; c < cols; ++c) {
            const std::int64_t i = r * cols + c;
            out[c] = static_cast<float>(q[i]) * scale(i / group);
          }
        }
        return;
    }
  }

 private:
  static std::uint16_t load_u16(const std::uint8_t* p) noexcept {
    std::uint16_t v = 0;
    std::memcpy(&v, p, 2);
    return v;
  }
  [[nodiscard]] float scale(std::int64_t g) const noexcept {
    float s = 0.0f;
    std::memcpy(&s, q_scales + 4 * g, 4);
    return s;
  }

  // Dot products with 8 independent partial sums (vectorizable without -ffast-math).
  template <class Load>
  static float dot8(std::int64_t n, const float* x, Load&& w) noexcept {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::int64_t c = 0;
    for (; c + 8 <= n; c += 8) {
      for (int k = 0; k < 8; ++k) acc[k] += w(c + k) * x[c + k];
    }
    float tail = 0.0f;
    for (; c < n; ++c) tail += w(c) * x[c];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) + tail;
  }

  /// One GGUF Q8_0 block: sum of 32 codes times 32 activations.
  static float dot_block32(const std::int8_t* qs, const float* x) noexcept {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int c = 0; c < kQ8Group; c += 8) {
      for (int k = 0; k < 8; ++k) acc[k] += static_cast<float>(qs[c + k]) * x[c + k];
    }
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  }

  [[nodiscard]] float dot_row(std::int64_t r, const float* x) const noexcept {
    switch (type) {
      case WeightType::kF32: {
        const float* w = f32 + r * cols;
        return dot8(cols, x, [w](std::int64_t c) { return w[c]; });
      }
      case WeightType::kF16: {
        const std::uint16_t* w = u16 + r * cols;
        return dot8(cols, x, [w](std::int64_t c) { return f16_to_f32_fast(w[c]); });
      }
      case WeightType::kBF16: {
        const std::uint16_t* w = u16 + r * cols;
        return dot8(cols, x, [w](std::int64_t c) { return bf16_to_f32(w[c]); });
      }
      case WeightType::kQ8_0: {
        float sum = 0.0f;
        if (blocks != nullptr) {
          const std::uint8_t* b = blocks + static_cast<std::size_t>(r * (cols / kQ8Group)) * kGgufQ8BlockBytes;
          for (std::int64_t c = 0; c < cols; c += kQ8Group, b += kGgufQ8BlockBytes) {
            const auto* qs = reinterpret_cast<const std::int8_t*>(b + 2);
            sum += dot_block32(qs, x + c) * f16_to_f32(load_u16(b));
          }
          return sum;
        }
        // llama2.c layout: groups over the flattened tensor, possibly crossing rows.
        std::int64_t i = r * cols;
        const std::int64_t end = i + cols;
        while (i < end) {
          const std::int64_t g = i / group;
          const std::int64_t gend = std::min(end, (g + 1) * group);
          const std::int8_t* qs = q + i;
          const float* xs = x + (i - r * cols);
          const float part = dot8(gend - i, xs, [qs](std::int64_t k) { return static_cast<float>(qs[k]); });
          sum += part * scale(g);
          i = gend;
        }
        return sum;
      }
    }
    return 0.0f;
  }
};

/// The model's shape and numerics, all read from the file.
struct ModelConfig {
  int dim = 0;
  int hidden_dim = 0;
  int n_layers = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int vocab_size = 0;
  int seq_len = 0;  ///< context length the file states
  int head_dim = 0;
  int rope_dim = 0;  ///< rotated channels per head (= head_dim for llama)
  float rope_theta = 10000.0f;
  float rms_eps = 1e-5f;
  bool tied_output = false;  ///< classifier shares the token embedding

  [[nodiscard]] int q_dim() const noexcept { return n_heads * head_dim; }
  [[nodiscard]] int kv_dim() const noexcept { return n_kv_heads * head_dim; }

  /// Checks internal consistency; `source` prefixes the message.
  [[nodiscard]] Status validate(const std::string& source) const {
    auto bad = [&](const std::string& m) {
      return Status(StatusCode::kInvalidArgument, source + ": invalid model configuration: " + m);
    };
    constexpr int kMax = 1 << 20;
    auto in = [&](int v, int lo, int hi) { return v >= lo && v <= hi; };
    if (!in(dim, 1, kMax)) return bad("dim " + std::to_string(dim) + " out of range 1.." + std::to_string(kMax));
    if (!in(hidden_dim, 1, kMax)) return bad("hidden_dim " + std::to_string(hidden_dim) + " out of range");
    if (!in(n_layers, 1, 4096)) return bad("n_layers " + std::to_string(n_layers) + " out of range 1..4096");
    if (!in(n_heads, 1, 4096)) return bad("n_heads " + std::to_string(n_heads) + " out of range 1..4096");
    if (!in(n_kv_heads, 1, n_heads) || n_heads % n_kv_heads != 0) {
      return bad("n_kv_heads " + std::to_string(n_kv_heads) + " must divide n_heads " + std::to_string(n_heads));
    }
    if (!in(vocab_size, 1, 1 << 24)) return bad("vocab_size " + std::to_string(vocab_size) + " out of range");
    if (!in(seq_len, 1, 1 << 24)) return bad("seq_len " + std::to_string(seq_len) + " out of range");
    if (!in(head_dim, 2, 4096) || head_dim % 2 != 0) {
      return bad("head_dim " + std::to_string(head_dim) + " must be even and >= 2");
    }
    if (rope_dim < 0 || rope_dim > head_dim || rope_dim % 2 != 0) {
      return bad("rope dimension " + std::to_string(rope_dim) + " must be even and <= head_dim " +
                 std::to_string(head_dim));
    }
    if (!(rope_theta > 0.0f) || !std::isfinite(rope_theta)) return bad("rope theta must be positive");
    if (!(rms_eps > 0.0f) || !std::isfinite(rms_eps)) return bad("rms epsilon must be positive");
    return Status::ok();
  }

  [[nodiscard]] std::string to_string() const {
    return "dim=" + std::to_string(dim) + " hidden=" + std::to_string(hidden_dim) +
           " layers=" + std::to_string(n_layers) + " heads=" + std::to_string(n_heads) +
           " kv_heads=" + std::to_string(n_kv_heads) + " head_dim=" + std::to_string(head_dim) +
           " vocab=" + std::to_string(vocab_size) + " seq_len=" + std::to_string(seq_len);
  }
};

struct LayerWeights {
  const float* attn_norm = nullptr;  ///< [dim]
  const float* ffn_norm = nullptr;   ///< [dim]
  Matrix wq, wk, wv, wo;             ///< [q_dim x dim], [kv_dim x dim] x2, [dim x q_dim]
  Matrix w1, w2, w3;                 ///< gate [hidden x dim], down [dim x hidden], up [hidden x dim]
};

/// A loaded model. Move-only: the matrices point into `file` and `owned`.
struct Model {
  ModelConfig config;
  std::string name;  ///< file stem, e.g. "stories260K"
  std::string path;
  std::string format;                         ///< "llama2c-v0", "llama2c-v2-q8_0", "gguf-v3"
  WeightType weight_type = WeightType::kF32;  ///< of the large matrices
  Matrix tok_embeddings;                      ///< [vocab x dim]
  std::vector<LayerWeights> layers;
  const float* final_norm = nullptr;     ///< [dim]
  Matrix output;                         ///< [vocab x dim]
  std::vector<float> rope_freq_factors;  ///< empty, or [rope_dim / 2] divisors of the frequencies
  std::shared_ptr<Tokenizer> tokenizer;  ///< embedded tokenizer (GGUF), else null
  std::shared_ptr<const MappedFile> file;
  std::vector<std::vector<float>> owned;  ///< converted copies (e.g. F16 norms), stable buffers

  Model() = default;
  Model(Model&&) = default;
  Model& operator=(Model&&) = default;
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  [[nodiscard]] std::int64_t weight_bytes() const noexcept {
    std::int64_t n = tok_embeddings.bytes() + (config.tied_output ? 0 : output.bytes());
    for (const auto& l : layers) {
      n += l.wq.bytes() + l.wk.bytes() + l.wv.bytes() + l.wo.bytes() + l.w1.bytes() + l.w2.bytes() + l.w3.bytes();
    }
    return n;
  }

  /// Checks every matrix against the configuration (what the forward pass relies on).
  [[nodiscard]] Status check_shapes() const {
    const ModelConfig& c = config;
    auto want = [&](const Matrix& m, std::int64_t r, std::int64_t k, const std::string& what) -> Status {
      if (m.rows != r || m.cols != k) {
        return {StatusCode::kInvalidArgument, path + ": tensor " + what + " is " + std::to_string(m.rows) + " x " +
                                                  std::to_string(m.cols) + ", expected " + std::to_string(r) + " x " +
                                                  std::to_string(k)};
      }
      return Status::ok();
    };
    THINKV_RETURN_IF_ERROR(want(tok_embeddings, c.vocab_size, c.dim, "token embedding"));
    THINKV_RETURN_IF_ERROR(want(output, c.vocab_size, c.dim, "output (classifier)"));
    if (static_cast<int>(layers.size()) != c.n_layers) {
      return {StatusCode::kInternal, path + ": layer count mismatch"};
    }
    for (int i = 0; i < c.n_layers; ++i) {
      const LayerWeights& l = layers[static_cast<std::size_t>(i)];
      const std::string p = "layer " + std::to_string(i) + " ";
      THINKV_RETURN_IF_ERROR(want(l.wq, c.q_dim(), c.dim, p + "wq"));
      THINKV_RETURN_IF_ERROR(want(l.wk, c.kv_dim(), c.dim, p + "wk"));
      THINKV_RETURN_IF_ERROR(want(l.wv, c.kv_dim(), c.dim, p + "wv"));
      THINKV_RETURN_IF_ERROR(want(l.wo, c.dim, c.q_dim(), p + "wo"));
      THINKV_RETURN_IF_ERROR(want(l.w1, c.hidden_dim, c.dim, p + "w1 (gate)"));
      THINKV_RETURN_IF_ERROR(want(l.w2, c.dim, c.hidden_dim, p + "w2 (down)"));
      THINKV_RETURN_IF_ERROR(want(l.w3, c.hidden_dim, c.dim, p + "w3 (up)"));
      if (l.attn_norm == nullptr || l.ffn_norm == nullptr) {
        return {StatusCode::kInternal, path + ": " + p + "norm weights missing"};
      }
    }
    if (final_norm == nullptr) return {StatusCode::kInternal, path + ": final norm missing"};
    if (!rope_freq_factors.empty() && static_cast<int>(rope_freq_factors.size()) != c.rope_dim / 2) {
      return {StatusCode::kInvalidArgument, path + ": rope frequency factors have " +
                                                std::to_string(rope_freq_factors.size()) +
                                                " entries, expected rope_dim/2 = " + std::to_string(c.rope_dim / 2)};
    }
    return Status::ok();
  }
};

/// Stem of a path: "/a/b/stories260K.bin" -> "stories260K".
inline std::string file_stem(const std::string& path) {
  std::size_t s = path.find_last_of('/');
  std::string base = s == std::string::npos ? path : path.substr(s + 1);
  const std::size_t dot = base.find_last_of('.');
  if (dot != std::string::npos && dot > 0) base.resize(dot);
  return base;
}

}  // namespace thinkv::decoder
