#pragma once
/// \file llama2c.hpp
/// Loaders for llama2.c checkpoints (karpathy/llama2.c):
///  - legacy v0 (run.c): 7 x int32 header (dim, hidden_dim, n_layers, n_heads, n_kv_heads,
///    vocab_size, seq_len; a negative vocab_size means a separate classifier), then FP32 weights
///    in run.c's order: token embedding, rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3, rms_final,
///    the legacy freq_cis block (2 x seq_len x head_dim/2 floats, unused), then the classifier
///    when not shared;
///  - v2 (runq.c, "Q8_0"): 256-byte header (uint32 magic 0x616b3432 "ak42", int32 version 2, the
///    7 params, uint8 shared_classifier, int32 group_size, zero padding), FP32 norms (rms_att of
///    all layers, rms_ffn of all layers, rms_final), then each matrix as int8 codes followed by
///    one FP32 scale per group_size codes: token embedding, wq, wk, wv, wo, w1, w2, w3 (per layer),
///    then the classifier when not shared.
/// Other export versions (1: FP32 with header) are refused with a message. The file size must be
/// exactly what the header implies, so a truncated or padded file is refused before any weight
/// is touched.

#include <cstdint>
#include <limits>
#include <memory>
#include <string>

#include "model.hpp"
#include "model_file.hpp"
#include "thinkv/status.hpp"

namespace thinkv::decoder {

inline constexpr std::uint32_t kLlama2cMagic = 0x616b3432;  // "ak42"
inline constexpr std::size_t kLlama2cV2HeaderBytes = 256;

namespace llama2c_detail {

/// Fills the 7 header ints into a ModelConfig (run.c's conventions); checks ranges.
inline Status config_from_header(const std::int32_t h[7], const std::string& path, ModelConfig& c, bool& shared) {
  shared = h[5] > 0;
  c.dim = h[0];
  c.hidden_dim = h[1];
  c.n_layers = h[2];
  c.n_heads = h[3];
  c.n_kv_heads = h[4];
  // -INT_MIN overflows: a vocabulary that large is refused by validate() anyway, so keep it at
  // INT_MIN's magnitude minus one (still refused, with the header in the message).
  c.vocab_size = h[5] == std::numeric_limits<std::int32_t>::min() ? std::numeric_limits<std::int32_t>::max()
                 : h[5] < 0                                       ? -h[5]
                                                                  : h[5];
  c.seq_len = h[6];
  const std::string hdr = " (header: dim=" + std::to_string(h[0]) + " hidden_dim=" + std::to_string(h[1]) +
                          " n_layers=" + std::to_string(h[2]) + " n_heads=" + std::to_string(h[3]) +
                          " n_kv_heads=" + std::to_string(h[4]) + " vocab_size=" + std::to_string(h[5]) +
                          " seq_len=" + std::to_string(h[6]) + ")";
  if (c.n_heads <= 0 || c.dim <= 0 || c.dim % c.n_heads != 0) {
    return {StatusCode::kInvalidArgument,
            path + ": not a llama2.c checkpoint, or corrupt: dim must be a positive multiple of n_heads" + hdr};
  }
  c.head_dim = c.dim / c.n_heads;
  c.rope_dim = c.head_dim;
  c.tied_output = shared;
  Status s = c.validate(path);
  if (!s.is_ok()) return {s.code(), s.message() + hdr};
  return Status::ok();
}

/// A matrix of `rows x cols` FP32 values at the reader's position.
inline Status f32_matrix(ByteReader& r, std::int64_t rows, std::int64_t cols, const std::string& what, Matrix& m) {
  const std::uint8_t* p = nullptr;
  THINKV_RETURN_IF_ERROR(r.take(static_cast<std::size_t>(rows * cols) * 4, p, what));
  m = Matrix{};
  m.rows = rows;
  m.cols = cols;
  m.type = WeightType::kF32;
  m.f32 = reinterpret_cast<const float*>(p);  // 4-aligned: a page-aligned map, offsets multiple of 4
  return Status::ok();
}

inline Status q8_matrix(ByteReader& r, std::int64_t rows, std::int64_t cols, int group, const std::string& what,
                        Matrix& m) {
  const std::int64_t n = rows * cols;
  if (n % group != 0) {
    return r.corrupt(what + " has " + std::to_string(n) + " values, not a multiple of group_size " +
                     std::to_string(group));
  }
  const std::uint8_t* q = nullptr;
  const std::uint8_t* s = nullptr;
  THINKV_RETURN_IF_ERROR(r.take(static_cast<std::size_t>(n), q, "int8 codes of " + what));
  THINKV_RETURN_IF_ERROR(r.take(static_cast<std::size_t>(n / group) * 4, s, "FP32 scales of " + what));
  m = Matrix{};
  m.rows = rows;
  m.cols = cols;
  m.type = WeightType::kQ8_0;
  m.q = reinterpret_cast<const std::int8_t*>(q);
  m.q_scales = s;
  m.group = group;
  return Status::ok();
}

}  // namespace llama2c_detail

/// Loads a legacy v0 checkpoint from a mapped file.
inline Status load_llama2c_v0(std::shared_ptr<const MappedFile> file, Model& out) {
  using namespace llama2c_detail;
  const std::string& path = file->path();
  ByteReader r(file->bytes(), path);
  std::int32_t h[7];
  for (int i = 0; i < 7; ++i) {
    THINKV_RETURN_IF_ERROR(r.read(h[i], "int32 header field " + std::to_string(i) + " of 7 (llama2.c v0 checkpoint)"));
  }
  Model m;
  bool shared = false;
  THINKV_RETURN_IF_ERROR(config_from_header(h, path, m.config, shared));
  const ModelConfig& c = m.config;
  const std::int64_t L = c.n_layers, D = c.dim, H = c.hidden_dim, V = c.vocab_size, Q = c.q_dim(), K = c.kv_dim();
  const std::int64_t floats = V * D + L * D + L * Q * D + 2 * L * K * D + L * D * Q + L * D + 3 * L * H * D + D +
                              std::int64_t{c.seq_len} * c.head_dim + (shared ? 0 : V * D);
  const std::int64_t expect = 28 + 4 * floats;
  if (static_cast<std::int64_t>(file->size()) != expect) {
    return {StatusCode::kInvalidArgument,
            path + ": " + (static_cast<std::int64_t>(file->size()) < expect ? "truncated" : "unexpected size") +
                ": a llama2.c v0 checkpoint with " + c.to_string() + (shared ? " (shared classifier)" : "") + " has " +
                std::to_string(expect) + " bytes, the file has " + std::to_string(file->size()) +
                (static_cast<std::int64_t>(file->size()) < expect ? " (re-download it)" : " (not a v0 checkpoint?)")};
  }
  THINKV_RETURN_IF_ERROR(f32_matrix(r, V, D, "token embedding", m.tok_embeddings));
  m.layers.resize(static_cast<std::size_t>(L));
  auto norms = [&](bool attn) -> Status {
    for (std::int64_t l = 0; l < L; ++l) {
      const std::uint8_t* p = nullptr;
      THINKV_RETURN_IF_ERROR(r.take(static_cast<std::size_t>(D) * 4, p,
                                    (attn ? "rms_att of layer " : "rms_ffn of layer ") + std::to_string(l)));
      (attn ? m.layers[static_cast<std::size_t>(l)].attn_norm : m.layers[static_cast<std::size_t>(l)].ffn_norm) =
          reinterpret_cast<const float*>(p);
    }
    return Status::ok();
  };
  auto mats = [&](Matrix LayerWeights::*field, std::int64_t rows, std::int64_t cols, const char* what) -> Status {
    for (std::int64_t l = 0; l < L; ++l) {
      THINKV_RETURN_IF_ERROR(f32_matrix(r, rows, cols, std::string(what) + " of layer " + std::to_string(l),
                                        m.layers[static_cast<std::size_t>(l)].*field));
    }
    return Status::ok();
  };
  THINKV_RETURN_IF_ERROR(norms(true));
  THINKV_RETURN_IF_ERROR(mats(&LayerWeights::wq, Q, D, "wq"));
  THINKV_RETURN_IF_ERROR(mats(&LayerWeights::wk, K, D, "wk"));
  THINKV_RETURN_IF_ERROR(mats(&LayerWeights::wv, K, D, "wv"));
  THINKV_RETURN_IF_ERROR(mats(&LayerWeights::wo, D, Q, "wo"));
  THINKV_RETURN_IF_ERROR(norms(false));
  THINKV_RETURN_IF_ERROR(mats(&LayerWeights::w1, H, D, "w1"));
  THINKV_RETURN_IF_ERROR(mats(&LayerWeights::w2, D, H, "w2"));
  THINKV_RETURN_IF_ERROR(mats(&LayerWeights::w3, H, D, "w3"));
  const std::uint8_t* p = nullptr;
  THINKV_RETURN_IF_ERROR(r.take(static_cast<std::size_t>(D) * 4, p, "rms_final"));
  m.final_norm = reinterpret_cast<const float*>(p);
  THINKV_RETURN_IF_ERROR(
      r.skip(static_cast<std::size_t>(c.seq_len) * static_cast<std::size_t>(c.head_dim) * 4, "legacy freq_cis block"));
  if (shared) {
    m.output = m.tok_embeddings;
  } else {
    THINKV_RETURN_IF_ERROR(f32_matrix(r, V, D, "classifier", m.output));
  }
  m.name = file_stem(path);
  m.path = path;
  m.format = "llama2c-v0";
  m.weight_type = WeightType::kF32;
  m.file = std::move(file);
  THINKV_RETURN_IF_ERROR(m.check_shapes());
  out = std::move(m);
  return Status::ok();
}

/// Loads a versioned export (magic "ak42"); only version 2 (Q8_0) is supported.
inline Status load_llama2c_v2(std::shared_ptr<const MappedFile> file, Model& out) {
  using namespace llama2c_detail;
  const std::string& path = file->path();
  ByteReader r(file->bytes(), path);
  std::uint32_t magic = 0;
  std::int32_t version = 0;
  THINKV_RETURN_IF_ERROR(r.read(magic, "uint32 magic"));
  if (magic != kLlama2cMagic) return r.corrupt_at(0, "bad magic; not a llama2.c versioned export");
  THINKV_RETURN_IF_ERROR(r.read(version, "int32 version"));
  if (version != 2) {
    return {StatusCode::kUnsupported,
            path + ": llama2.c export version " + std::to_string(version) +
                " is not supported; supported: the legacy v0 checkpoint (run.c) and version 2 "
                "(Q8_0, runq.c)" +
                (version == 1 ? " — re-export with `export.py --version 0` or `--version 2`" : "")};
  }
  std::int32_t h[7];
  for (int i = 0; i < 7; ++i) THINKV_RETURN_IF_ERROR(r.read(h[i], "int32 header param " + std::to_string(i) + " of 7"));
  std::uint8_t shared_flag = 0;
  std::int32_t group = 0;
  THINKV_RETURN_IF_ERROR(r.read(shared_flag, "uint8 shared_classifier"));
  THINKV_RETURN_IF_ERROR(r.read(group, "int32 group_size"));
  if (shared_flag > 1)
    return r.corrupt_at(36, "shared_classifier is " + std::to_string(shared_flag) + ", expected 0 or 1");
  if (group < 1 || group > (1 << 16))
    return r.corrupt_at(37, "group_size " + std::to_string(group) + " is out of range 1..65536");
  if (h[5] <= 0) return r.corrupt_at(28, "vocab_size " + std::to_string(h[5]) + " must be positive in a v2 export");
  Model m;
  bool shared_from_sign = false;
  THINKV_RETURN_IF_ERROR(config_from_header(h, path, m.config, shared_from_sign));
  const bool shared = shared_flag == 1;
  m.config.tied_output = shared;
  const ModelConfig& c = m.config;
  const std::int64_t L = c.n_layers, D = c.dim, H = c.hidden_dim, V = c.vocab_size, Q = c.q_dim(), K = c.kv_dim();
  // export.py quantizes every matrix, flattened, in whole groups (it asserts numel % group_size
  // == 0): a group size that does not divide a matrix is a corrupt header, whatever the size.
  for (const auto& [what, n] : {std::pair<const char*, std::int64_t>{"the token embedding", V * D},
                                {"wq", Q * D},
                                {"wk", K * D},
                                {"w1", H * D}}) {
    if (n % group != 0) {
      return r.corrupt_at(37, "group_size " + std::to_string(group) + " does not divide the " + std::to_string(n) +
                                  " weights of " + what + " (export.py quantizes whole groups): the header is corrupt");
    }
  }
  // Exact size: header, norms, then per matrix n codes + n/group scales.
  auto qbytes = [&](std::int64_t n) { return n + 4 * (n / group); };
  const std::int64_t expect = static_cast<std::int64_t>(kLlama2cV2HeaderBytes) + 4 * (2 * L * D + D) + qbytes(V * D) +
                              L * (qbytes(Q * D) + 2 * qbytes(K * D) + qbytes(D * Q) + 3 * qbytes(H * D)) +
                              (shared ? 0 : qbytes(V * D));
  if (static_cast<std::int64_t>(file->size()) != expect) {
    return {StatusCode::kInvalidArgument,
            path + ": " +
                (static_cast<std::int64_t>(file->size()) < expect ? "truncated, or its header is corrupt"
                                                                  : "longer than its header says (corrupt header?)") +
                ": a llama2.c v2 (Q8_0, group_size " + std::to_string(group) + ") export with " + c.to_string() +
                " has " + std::to_string(expect) + " bytes, the file has " + std::to_string(file->size())};
  }
  THINKV_RETURN_IF_ERROR(r.seek(kLlama2cV2HeaderBytes, "the weights after the 256-byte header"));
  m.layers.resize(static_cast<std::size_t>(L));
  for (int pass = 0; pass < 2; ++pass) {
    for (std::int64_t l = 0; l < L; ++l) {
      const std::uint8_t* p = nullptr;
      THINKV_RETURN_IF_ERROR(r.take(static_cast<std::size_t>(D) * 4, p,
                                    (pass == 0 ? "rms_att of layer " : "rms_ffn of layer ") + std::to_string(l)));
      (pass == 0 ? m.layers[static_cast<std::size_t>(l)].attn_norm : m.layers[static_cast<std::size_t>(l)].ffn_norm) =
          reinterpret_cast<const float*>(p);
    }
  }
  const std::uint8_t* p = nullptr;
  THINKV_RETURN_IF_ERROR(r.take(static_cast<std::size_t>(D) * 4, p, "rms_final"));
  m.final_norm = reinterpret_cast<const float*>(p);
  THINKV_RETURN_IF_ERROR(q8_matrix(r, V, D, group, "token embedding", m.tok_embeddings));
  auto mats = [&](Matrix LayerWeights::*field, std::int64_t rows, std::int64_t cols, const char* what) -> Status {
    for (std::int64_t l = 0; l < L; ++l) {
      THINKV_RETURN_IF_ERROR(q8_matrix(r, rows, cols, group, std::string(what) + " of layer " + std::to_string(l),
                                       m.layers[static_cast<std::size_t>(l)].*field));
    }
    return Status::ok();
  };
  THINKV_RETURN_IF_ERROR(mats(&LayerWeights::wq, Q, D, "wq"));
  THINKV_RETURN_IF_ERROR(mats(&LayerWeights::wk, K, D, "wk"));
  THINKV_RETURN_IF_ERROR(mats(&LayerWeights::wv, K, D, "wv"));
  THINKV_RETURN_IF_ERROR(mats(&LayerWeights::wo, D, Q, "wo"));
  THINKV_RETURN_IF_ERROR(mats(&LayerWeights::w1, H, D, "w1"));
  THINKV_RETURN_IF_ERROR(mats(&LayerWeights::w2, D, H, "w2"));
  THINKV_RETURN_IF_ERROR(mats(&LayerWeights::w3, H, D, "w3"));
  if (shared) {
    m.output = m.tok_embeddings;
  } else {
    THINKV_RETURN_IF_ERROR(q8_matrix(r, V, D, group, "classifier", m.output));
  }
  m.name = file_stem(path);
  m.path = path;
  m.format = "llama2c-v2-q8_0";
  m.weight_type = WeightType::kQ8_0;
  m.file = std::move(file);
  THINKV_RETURN_IF_ERROR(m.check_shapes());
  out = std::move(m);
  return Status::ok();
}

/// Loads a llama2.c checkpoint of either supported version (by its first 4 bytes).
inline Status load_llama2c(std::shared_ptr<const MappedFile> file, Model& out) {
  std::uint32_t magic = 0;
  if (file->size() >= 4) std::memcpy(&magic, file->data(), 4);
  if (magic == kLlama2cMagic) return load_llama2c_v2(std::move(file), out);
  return load_llama2c_v0(std::move(file), out);
}

}  // namespace thinkv::decoder
