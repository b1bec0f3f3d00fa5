#pragma once
/// \file kivi_cache.hpp
/// KIVI (Liu et al. 2024), the tuning-free asymmetric 2-bit KV cache, as a baseline behind the
/// decode protocol (thinkv/decode_cache.hpp). CPU reference implementation.
///
/// Keys are quantized per channel, values per token, both with asymmetric uniform quantization
/// to `bits` bits: a group x_1..x_G gets min m and scale s = (max - m) / (2^bits - 1) (both
/// stored in FP16), codes q_i = clamp(round((x_i - m) / s), 0, 2^bits - 1) (round half away
/// from zero; s = 0 gives code 0), and dequantizes to q_i * s + m in FP32 from the FP16 m and s.
///  - Keys: the newest tokens wait in a full-precision (FP16) residual; when it holds `residual`
///    tokens they are quantized, each channel's `group_size` consecutive tokens one group.
///  - Values: the newest `residual` tokens stay in FP16; the token that leaves that window is
///    quantized on its own, each `group_size` consecutive channels one group.
/// Nothing is evicted: memory grows with the sequence, at about (2 * head_dim * bits / 8 + 4 *
/// head_dim / group_size * 2) bytes per token per stream plus the FP16 residuals.
///
/// Memory (CacheReport): held_bytes counts the codes, mins and scales of quantized tokens and the
/// FP16 residuals in use; allocated_bytes what is reserved for max_tokens per stream.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "thinkv/decode_cache.hpp"
#include "thinkv/formats/fp16.hpp"
#include "thinkv/kv_values.hpp"
#include "thinkv/reference/attention.hpp"
#include "thinkv/status.hpp"

namespace thinkv {

struct KiviConfig {
  CacheShape shape{};
  int max_tokens = 4096;       ///< positions per sequence
  int bits = 2;                ///< 2 (KIVI-2) or 4 (KIVI-4)
  int group_size = 32;         ///< tokens per key group (per channel), channels per value group
  int residual = 32;           ///< FP16 residual length R, a multiple of group_size
  float softmax_scale = 0.0f;  ///< 0 = 1/sqrt(head_dim)

  [[nodiscard]] Status validate() const {
    auto bad = [](std::string m) { return Status(StatusCode::kInvalidArgument, std::move(m)); };
    THINKV_RETURN_IF_ERROR(shape.validate());
    if (max_tokens < 1 || max_tokens > (1 << 24))
      return bad("kivi: max_tokens " + std::to_string(max_tokens) + " is out of range; allowed: 1..16777216");
    if (bits != 2 && bits != 4) return bad("kivi: bits " + std::to_string(bits) + " is not supported; allowed: 2, 4");
    if (group_size < 1 || group_size > 1024 || shape.head_dim % group_size != 0) {
      return bad("kivi: group_size " + std::to_string(group_size) + " must divide head_dim " +
                 std::to_string(shape.head_dim));
    }
    if (residual < group_size || residual % group_size != 0 || residual > (1 << 16)) {
      return bad("kivi: residual " + std::to_string(residual) + " must be a positive multiple of group_size " +
                 std::to_string(group_size) + " (at most 65536)");
    }
    if (!(softmax_scale >= 0.0f) || std::isinf(softmax_scale))
      return bad("kivi: softmax_scale " + std::to_string(softmax_scale) + " must be finite and >= 0");
    const std::int64_t elems =
        std::int64_t{max_tokens} * shape.num_sequences * shape.streams_per_sequence() * shape.head_dim;
    if (elems > (std::int64_t{1} << 40))
      return bad("kivi: the cache would reserve too much; lower max_tokens or num_sequences");
    return Status::ok();
  }
};

/// One KIVI group's asymmetric quantization (exposed for tests): codes of x[i * stride] for i in
/// [0, n) into `codes` (one code per byte) and the FP16 min and scale.
inline void kivi_quantize_group(const float* x, int stride, int n, int bits, std::uint8_t* codes, std::uint16_t& min16,
                                std::uint16_t& scale16) {
  float mn = x[0], mx = x[0];
  for (int i = 1; i < n; ++i) {
    mn = std::min(mn, x[i * stride]);
    mx = std::max(mx, x[i * stride]);
  }
  const int levels = (1 << bits) - 1;
  min16 = encode_fp16(mn);
  scale16 = encode_fp16((mx - mn) / static_cast<float>(levels));
  const float m = decode_fp16(min16), s = decode_fp16(scale16);
  for (int i = 0; i < n; ++i) {
    int q = 0;
    if (s > 0.0f) q = static_cast<int>(std::lround((x[i * stride] - m) / s));
    codes[i] = static_cast<std::uint8_t>(std::clamp(q, 0, levels));
  }
}

class KiviCache {
 public:
  /// Throws ConfigError naming the bad value.
  explicit KiviCache(const KiviConfig& config) : config_(checked(config)) {
    const CacheShape& sh = config_.shape;
    protocol_ = TokenProtocol(sh.num_sequences, sh.num_layers);
    const std::size_t d = static_cast<std::size_t>(sh.head_dim);
    const std::size_t T = static_cast<std::size_t>(config_.max_tokens);
    const std::size_t G = static_cast<std::size_t>(config_.group_size);
    streams_.resize(static_cast<std::size_t>(sh.num_sequences) * sh.streams_per_sequence());
    for (Stream& s : streams_) {
      s.kcodes.assign(T * row_bytes(), 0);
      s.vcodes.assign(T * row_bytes(), 0);
      s.kmin.assign((T / G + 1) * d, 0);
      s.kscale.assign((T / G + 1) * d, 0);
      s.vmin.assign(T * (d / G), 0);
      s.vscale.assign(T * (d / G), 0);
      s.kres.assign(static_cast<std::size_t>(config_.residual) * d, 0);
      s.vres.assign(static_cast<std::size_t>(config_.residual) * d, 0);
    }
  }

  [[nodiscard]] const KiviConfig& config() const noexcept { return config_; }
  [[nodiscard]] CacheShape shape() const { return config_.shape; }
  [[nodiscard]] std::string method_name() const {
    return "kivi" + std::to_string(config_.bits) + " (group " + std::to_string(config_.group_size) + ", residual " +
           std::to_string(config_.residual) + ")";
  }
  [[nodiscard]] std::int32_t position(int seq) const { return protocol_.position(seq); }
  [[nodiscard]] int stream_of(int seq, int layer, int kv_head) const noexcept {
    return (seq * config_.shape.num_layers + layer) * config_.shape.num_kv_heads + kv_head;
  }

  [[nodiscard]] Status begin_token(int seq) {
    THINKV_RETURN_IF_ERROR(protocol_.check_begin(seq));
    if (protocol_.position(seq) >= config_.max_tokens) {
      return {StatusCode::kOutOfRange,
              "sequence " + std::to_string(seq) + " reached max_tokens " + std::to_string(config_.max_tokens)};
    }
    protocol_.mark_begin(seq);
    return Status::ok();
  }

  /// Stores the current token of one layer ([num_kv_heads, head_dim] K and V). All-or-nothing.
  [[nodiscard]] Status append(int seq, int layer, std::span<const float> k, std::span<const float> v) {
    THINKV_RETURN_IF_ERROR(protocol_.check_append(seq, layer));
    const CacheShape& sh = config_.shape;
    THINKV_RETURN_IF_ERROR(sh.check_append(layer, k, v));
    THINKV_RETURN_IF_ERROR(check_kv_values(k, v,
                                           "layer " + std::to_string(layer) + " of sequence " + std::to_string(seq),
                                           kFp16Max, "the largest FP16 value, 65504"));
    const std::size_t d = static_cast<std::size_t>(sh.head_dim);
    const std::int32_t pos = protocol_.position(seq);
    const int R = config_.residual;
    for (int h = 0; h < sh.num_kv_heads; ++h) {
      Stream& s = streams_[static_cast<std::size_t>(stream_of(seq, layer, h))];
      const float* kh = k.data() + static_cast<std::size_t>(h) * d;
      const float* vh = v.data() + static_cast<std::size_t>(h) * d;
      // Keys: into the residual; a full residual is quantized per channel.
      const std::size_t kr = static_cast<std::size_t>(pos - s.kq);
      for (std::size_t c = 0; c < d; ++c) s.kres[kr * d + c] = encode_fp16(kh[c]);
      if (static_cast<int>(kr) + 1 == R) flush_keys(s);
      // Values: the newest R stay in FP16 (a ring); the one leaving the window is quantized.
      if (pos >= R) quantize_value(s, pos - R);
      const std::size_t vr = static_cast<std::size_t>(pos % R);
      for (std::size_t c = 0; c < d; ++c) s.vres[vr * d + c] = encode_fp16(vh[c]);
    }
    protocol_.mark_append(seq, layer);
    return Status::ok();
  }

  [[nodiscard]] Status attend(int seq, int layer, std::span<const float> q, std::span<float> out) {
    THINKV_RETURN_IF_ERROR(protocol_.check_attend(seq, layer));
    const CacheShape& sh = config_.shape;
    if (q.size() != sh.q_size() || out.size() != sh.q_size()) {
      return {StatusCode::kShapeMismatch,
              "attend layer " + std::to_string(layer) +
                  ": q and out need num_q_heads * head_dim = " + std::to_string(sh.q_size()) + " floats"};
    }
    for (float x : q) {
      if (!std::isfinite(x)) {
        return {StatusCode::kNonFinite,
                "attend layer " + std::to_string(layer) + ": the query holds a non-finite value"};
      }
    }
    const int d = sh.head_dim, group = sh.num_q_heads / sh.num_kv_heads;
    const int n = protocol_.position(seq) + 1;  // the current token is appended
    const float scale = config_.softmax_scale > 0.0f ? config_.softmax_scale : 1.0f / std::sqrt(static_cast<float>(d));
    kf_.resize(static_cast<std::size_t>(n) * d);
    vf_.resize(kf_.size());
    for (int h = 0; h < sh.num_kv_heads; ++h) {
      const Stream& s = streams_[static_cast<std::size_t>(stream_of(seq, layer, h))];
      for (int j = 0; j < n; ++j) {
        read_key(s, j, kf_.data() + static_cast<std::size_t>(j) * d);
        read_value(s, j, n, vf_.data() + static_cast<std::size_t>(j) * d);
      }
      reference::attend_tokens(q.data() + static_cast<std::ptrdiff_t>(h) * group * d, group, kf_.data(), vf_.data(), n,
                               d, scale, out.data() + static_cast<std::ptrdiff_t>(h) * group * d);
    }
    return Status::ok();
  }

  [[nodiscard]] Status end_token(int seq) {
    THINKV_RETURN_IF_ERROR(protocol_.check_end(seq));
    protocol_.mark_end(seq);
    return Status::ok();
  }

  [[nodiscard]] Status reset_sequence(int seq) {
    THINKV_RETURN_IF_ERROR(protocol_.check_seq(seq));
    for (int st = stream_of(seq, 0, 0); st < stream_of(seq + 1, 0, 0); ++st) {
      Stream& s = streams_[static_cast<std::size_t>(st)];
      s.kq = 0;
    }
    protocol_.reset(seq);
    return Status::ok();
  }

  [[nodiscard]] CacheReport report(int seq) const {
    const CacheShape& sh = config_.shape;
    CacheReport r;
    r.positions = protocol_.position(seq);
    const std::int64_t streams = sh.streams_per_sequence();
    r.live_tokens = r.positions * streams;
    r.held_bytes = held_bytes_per_stream(r.positions) * streams;
    r.allocated_bytes = allocated_bytes_per_stream() * streams;
    r.fullkv_fp16_bytes = sh.fullkv_fp16_bytes(r.positions);
    return r;
  }

  /// Bytes one stream holds after `positions` tokens: codes, FP16 mins and scales of the
  /// quantized keys and values, the FP16 residuals in use.
  [[nodiscard]] std::int64_t held_bytes_per_stream(std::int64_t positions) const {
    const std::int64_t d = config_.shape.head_dim, G = config_.group_size, R = config_.residual;
    const std::int64_t kq = positions / R * R;                           // keys quantized
    const std::int64_t vq = std::max<std::int64_t>(0, positions - R);    // values quantized
    const std::int64_t res = (positions - kq) + std::min(positions, R);  // FP16 residual rows
    return (kq + vq) * row_bytes() + kq / G * d * 4 + vq * (d / G) * 4 + res * d * 2;
  }
  /// Bytes one stream reserves (every buffer, sized for max_tokens).
  [[nodiscard]] std::int64_t allocated_bytes_per_stream() const {
    const Stream& s = streams_.front();
    return static_cast<std::int64_t>(s.kcodes.size() + s.vcodes.size()) +
           2 * static_cast<std::int64_t>(s.kmin.size() + s.kscale.size() + s.vmin.size() + s.vscale.size() +
                                         s.kres.size() + s.vres.size());
  }
  /// Packed code bytes of one token's key (or value) row.
  [[nodiscard]] std::int64_t row_bytes() const noexcept {
    return (std::int64_t{config_.shape.head_dim} * config_.bits + 7) / 8;
  }
  /// The key and value KIVI attends to for position j of a stream (dequantized), for tests.
  void read_token(int seq, int layer, int kv_head, int j, std::span<float> k, std::span<float> v) const {
    const Stream& s = streams_[static_cast<std::size_t>(stream_of(seq, layer, kv_head))];
    read_key(s, j, k.data());
    read_value(s, j, protocol_.position(seq) + (protocol_.in_token(seq) && protocol_.appended(seq, layer) ? 1 : 0),
               v.data());
  }

 private:
  struct Stream {
    std::vector<std::uint8_t> kcodes, vcodes;  // [max_tokens, row_bytes] packed codes
    std::vector<std::uint16_t> kmin, kscale;   // [key groups, head_dim] FP16
    std::vector<std::uint16_t> vmin, vscale;   // [max_tokens, head_dim / group] FP16
    std::vector<std::uint16_t> kres, vres;     // [residual, head_dim] FP16 (values: a ring)
    int kq = 0;                                // keys quantized so far (a multiple of residual)
  };

  static const KiviConfig& checked(const KiviConfig& c) {
    if (Status s = c.validate(); !s.is_ok()) throw ConfigError(s);
    return c;
  }
  void put_code(std::vector<std::uint8_t>& row, std::size_t token, int c, std::uint8_t code) const {
    const int per = 8 / config_.bits;
    std::uint8_t& b = row[token * static_cast<std::size_t>(row_bytes()) + static_cast<std::size_t>(c / per)];
    const int shift = (c % per) * config_.bits;
    b = static_cast<std::uint8_t>((b & ~(((1 << config_.bits) - 1) << shift)) | (code << shift));
  }
  [[nodiscard]] int get_code(const std::vector<std::uint8_t>& row, std::size_t token, int c) const {
    const int per = 8 / config_.bits;
    const std::uint8_t b = row[token * static_cast<std::size_t>(row_bytes()) + static_cast<std::size_t>(c / per)];
    return (b >> ((c % per) * config_.bits)) & ((1 << config_.bits) - 1);
  }
  void flush_keys(Stream& s) {
    const int d = config_.shape.head_dim, G = config_.group_size, R = config_.residual;
    std::vector<float> x(static_cast<std::size_t>(R) * d);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = decode_fp16(s.kres[i]);
    std::vector<std::uint8_t> codes(static_cast<std::size_t>(G));
    for (int g0 = 0; g0 < R; g0 += G) {
      const std::size_t grp = static_cast<std::size_t>((s.kq + g0) / G);
      for (int c = 0; c < d; ++c) {
        kivi_quantize_group(x.data() + static_cast<std::size_t>(g0) * d + c, d, G, config_.bits, codes.data(),
                            s.kmin[grp * d + c], s.kscale[grp * d + c]);
        for (int i = 0; i < G; ++i)
          put_code(s.kcodes, static_cast<std::size_t>(s.kq + g0 + i), c, codes[static_cast<std::size_t>(i)]);
      }
    }
    s.kq += R;
  }
  void quantize_value(Stream& s, int token) {
    const int d = config_.shape.head_dim, G = config_.group_size;
    const std::size_t slot = static_cast<std::size_t>(token % config_.residual);
    std::vector<float> x(static_cast<std::size_t>(d));
    for (int c = 0; c < d; ++c)
      x[static_cast<std::size_t>(c)] = decode_fp16(s.vres[slot * d + static_cast<std::size_t>(c)]);
    std::vector<std::uint8_t> codes(static_cast<std::size_t>(G));
    for (int g = 0; g < d / G; ++g) {
      const std::size_t idx =
          static_cast<std::size_t>(token) * static_cast<std::size_t>(d / G) + static_cast<std::size_t>(g);
      kivi_quantize_group(x.data() + static_cast<std::size_t>(g) * G, 1, G, config_.bits, codes.data(), s.vmin[idx],
                          s.vscale[idx]);
      for (int i = 0; i < G; ++i)
        put_code(s.vcodes, static_cast<std::size_t>(token), g * G + i, codes[static_cast<std::size_t>(i)]);
    }
  }
  static const std::vector<float>& fp16_table() {
    static const std::vector<float> t = [] {
      std::vector<float> x(65536);
      for (std::uint32_t i = 0; i < 65536u; ++i) x[i] = decode_fp16(static_cast<std::uint16_t>(i));
      return x;
    }();
    return t;
  }
  void read_key(const Stream& s, int j, float* out) const {
    const int d = config_.shape.head_dim;
    const std::vector<float>& h = fp16_table();
    if (j < s.kq) {
      const std::size_t grp = static_cast<std::size_t>(j / config_.group_size);
      for (int c = 0; c < d; ++c) {
        out[c] = static_cast<float>(get_code(s.kcodes, static_cast<std::size_t>(j), c)) * h[s.kscale[grp * d + c]] +
                 h[s.kmin[grp * d + c]];
      }
    } else {
      const std::size_t r = static_cast<std::size_t>(j - s.kq);
      for (int c = 0; c < d; ++c) out[c] = h[s.kres[r * d + static_cast<std::size_t>(c)]];
    }
  }
  /// Value of position j when the stream holds n tokens (the newest R in FP16).
  void read_value(const Stream& s, int j, int n, float* out) const {
    const int d = config_.shape.head_dim, G = config_.group_size, R = config_.residual;
    const std::vector<float>& h = fp16_table();
    if (j < n - R) {
      for (int c = 0; c < d; ++c) {
        const std::size_t idx =
            static_cast<std::size_t>(j) * static_cast<std::size_t>(d / G) + static_cast<std::size_t>(c / G);
        out[c] =
            static_cast<float>(get_code(s.vcodes, static_cast<std::size_t>(j), c)) * h[s.vscale[idx]] + h[s.vmin[idx]];
      }
    } else {
      const std::size_t r = static_cast<std::size_t>(j % R);
      for (int c = 0; c < d; ++c) out[c] = h[s.vres[r * d + static_cast<std::size_t>(c)]];
    }
  }

  KiviConfig config_;
  TokenProtocol protocol_;
  std::vector<Stream> streams_;
  std::vector<float> kf_, vf_;
};
static_assert(decode_cache<KiviCache>);

}  // namespace thinkv
