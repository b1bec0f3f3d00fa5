#pragma once
/// \file state_codec.hpp
/// The byte codec of ThinKV's saved sequence state (BasicThinKvCache::save_sequence /
/// load_sequence): little-endian fields behind a versioned header, closed by a CRC-32 of
/// everything before it. docs/formats.md ("Sequence state") specifies the fields.
///
///     offset  size  field
///     0       8     magic "THKVSEQ\0"
///     8       4     u32 version (kSequenceStateVersion)
///     12      4     u32 flags (0)
///     16      8     u64 body bytes (B)
///     24      B     body
///     24 + B  4     u32 CRC-32 (IEEE 802.3, as zlib's crc32) of bytes 0 .. 24 + B - 1
///
/// StateReader never reads past its span: a short read is a kCorruptData status naming the
/// field, so a truncated or damaged state is an error, never a crash or a partial load.

#include <array>
#include <bit>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "thinkv/status.hpp"

namespace thinkv {

inline constexpr std::array<char, 8> kSequenceStateMagic = {'T', 'H', 'K', 'V', 'S', 'E', 'Q', '\0'};
inline constexpr std::uint32_t kSequenceStateVersion = 1;
inline constexpr std::size_t kSequenceStateHeaderBytes = 24;

/// CRC-32 (reflected polynomial 0xEDB88320, initial and final XOR 0xFFFFFFFF): zlib's crc32.
/// `crc` continues an earlier call's result (0 to start). Slicing-by-8: eight bytes per step
/// through eight 256-entry tables (tables[0] is the classic byte table; tables[s][i] is i's CRC
/// followed by s zero bytes), then byte by byte for the tail; ~8x the speed of the byte loop.
inline std::uint32_t crc32(std::span<const std::uint8_t> bytes, std::uint32_t crc = 0) noexcept {
  static constexpr auto kTables = [] {
    std::array<std::array<std::uint32_t, 256>, 8> t{};
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1u) != 0 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[0][i] = c;
    }
    for (std::size_t s = 1; s < 8; ++s) {
      for (std::size_t i = 0; i < 256; ++i) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFFu];
    }
    return t;
  }();
  const auto le32 = [](const std::uint8_t* p) {
    return static_cast<std::uint32_t>(p[0]) | static_cast<std::uint32_t>(p[1]) << 8 |
           static_cast<std::uint32_t>(p[2]) << 16 | static_cast<std::uint32_t>(p[3]) << 24;
  };
  crc = ~crc;
  const std::uint8_t* p = bytes.data();
  std::size_t n = bytes.size();
  for (; n >= 8; n -= 8, p += 8) {
    const std::uint32_t lo = le32(p) ^ crc, hi = le32(p + 4);
    crc = kTables[7][lo & 0xFFu] ^ kTables[6][(lo >> 8) & 0xFFu] ^ kTables[5][(lo >> 16) & 0xFFu] ^
          kTables[4][lo >> 24] ^ kTables[3][hi & 0xFFu] ^ kTables[2][(hi >> 8) & 0xFFu] ^
          kTables[1][(hi >> 16) & 0xFFu] ^ kTables[0][hi >> 24];
  }
  for (; n > 0; --n, ++p) crc = kTables[0][(crc ^ *p) & 0xFFu] ^ (crc >> 8);
  return ~crc;
}

/// Whether values of T are stored as their own bytes (little-endian host, no validation on read):
/// spans of them are copied whole. Enums and bools go value by value (a read checks them).
template <class T>
inline constexpr bool kRawStateField =
    std::endian::native == std::endian::little&& std::is_arithmetic_v<T> && !std::is_same_v<T, bool> &&
    (std::is_integral_v<T> || sizeof(T) == 4 || sizeof(T) == 8);

/// Appends little-endian fields to a byte vector.
class StateWriter {
 public:
  explicit StateWriter(std::vector<std::uint8_t>& out) : out_(out) {}

  template <class T>
  requires(std::is_arithmetic_v<T> || std::is_enum_v<T>) void put(T value) {
    if constexpr (std::is_enum_v<T>) {
      put(static_cast<std::underlying_type_t<T>>(value));
    } else if constexpr (std::is_same_v<T, bool>) {
      put(static_cast<std::uint8_t>(value ? 1 : 0));
    } else if constexpr (std::is_floating_point_v<T>) {
      static_assert(sizeof(T) == 4 || sizeof(T) == 8);
      using U = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>;
      put(std::bit_cast<U>(value));
    } else {
      using U = std::make_unsigned_t<T>;
      const U u = static_cast<U>(value);
      for (std::size_t i = 0; i < sizeof(T); ++i) out_.push_back(static_cast<std::uint8_t>(u >> (8 * i)));
    }
  }
  template <class T>
  void put_span(std::span<const T> values) {
    if constexpr (kRawStateField<T>) {
      const auto* b = reinterpret_cast<const std::uint8_t*>(values.data());
      out_.insert(out_.end(), b, b + values.size_bytes());
    } else {
      for (const T& v : values) put(v);
    }
  }
  void put_bytes(std::span<const std::uint8_t> bytes) { out_.insert(out_.end(), bytes.begin(), bytes.end()); }
  [[nodiscard]] std::size_t size() const noexcept { return out_.size(); }

 private:
  std::vector<std::uint8_t>& out_;
};

/// Reads little-endian fields from a span; every read is checked against the end.
class StateReader {
 public:
  explicit StateReader(std::span<const std::uint8_t> in) : in_(in) {}

  template <class T>
  requires(std::is_arithmetic_v<T> || std::is_enum_v<T>) [[nodiscard]] Status get(T& value, const char* field) {
    if constexpr (std::is_enum_v<T>) {
      std::underlying_type_t<T> u{};
      THINKV_RETURN_IF_ERROR(get(u, field));
      value = static_cast<T>(u);
    } else if constexpr (std::is_same_v<T, bool>) {
      std::uint8_t u = 0;
      THINKV_RETURN_IF_ERROR(get(u, field));
      if (u > 1) return bad(field, "is " + std::to_string(u) + ", not 0 or 1");
      value = u != 0;
    } else if constexpr (std::is_floating_point_v<T>) {
      using U = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>;
      U u = 0;
      THINKV_RETURN_IF_ERROR(get(u, field));
      value = std::bit_cast<T>(u);
    } else {
      THINKV_RETURN_IF_ERROR(need(sizeof(T), field));
      using U = std::make_unsigned_t<T>;
      U u = 0;
      for (std::size_t i = 0; i < sizeof(T); ++i) u = static_cast<U>(u | (static_cast<U>(in_[at_ + i]) << (8 * i)));
      at_ += sizeof(T);
      value = static_cast<T>(u);
    }
    return Status::ok();
  }
  /// Reads n values into `out` (resized), after checking that n of them fit in what is left.
  template <class T>
  [[nodiscard]] Status get_vector(std::vector<T>& out, std::size_t n, const char* field) {
    if (n > left() / sizeof(T)) {  // (n * sizeof(T) could wrap)
      return {StatusCode::kCorruptData, std::string("sequence state: truncated at ") + field + " (byte " +
                                            std::to_string(at_) + " needs " + std::to_string(n) + " values of " +
                                            std::to_string(sizeof(T)) + " bytes, " + std::to_string(left()) +
                                            " bytes left)"};
    }
    out.resize(n);
    if constexpr (kRawStateField<T>) {
      if (n != 0) std::memcpy(out.data(), in_.data() + at_, n * sizeof(T));
      at_ += n * sizeof(T);
    } else {
      for (T& v : out) THINKV_RETURN_IF_ERROR(get(v, field));
    }
    return Status::ok();
  }
  [[nodiscard]] Status get_bytes(std::vector<std::uint8_t>& out, std::size_t n, const char* field) {
    THINKV_RETURN_IF_ERROR(need(n, field));
    out.assign(in_.begin() + static_cast<std::ptrdiff_t>(at_), in_.begin() + static_cast<std::ptrdiff_t>(at_ + n));
    at_ += n;
    return Status::ok();
  }
  [[nodiscard]] std::size_t left() const noexcept { return in_.size() - at_; }
  [[nodiscard]] std::size_t offset() const noexcept { return at_; }
  [[nodiscard]] Status bad(const char* field, const std::string& what) const {
    return {StatusCode::kCorruptData, std::string("sequence state: ") + field + " " + what};
  }

 private:
  [[nodiscard]] Status need(std::size_t n, const char* field) const {
    if (n <= left()) return Status::ok();
    return {StatusCode::kCorruptData, std::string("sequence state: truncated at ") + field + " (byte " +
                                          std::to_string(at_) + " needs " + std::to_string(n) + " more, " +
                                          std::to_string(left()) + " left)"};
  }
  std::span<const std::uint8_t> in_;
  std::size_t at_ = 0;
};

/// Writes the header with a body size to fill in later (finish_state).
inline void begin_state(std::vector<std::uint8_t>& out) {
  out.clear();
  StateWriter w(out);
  for (char c : kSequenceStateMagic) w.put(static_cast<std::uint8_t>(c));
  w.put(kSequenceStateVersion);
  w.put(std::uint32_t{0});
  w.put(std::uint64_t{0});
}
/// Fills in the body size and appends the CRC.
inline void finish_state(std::vector<std::uint8_t>& out) {
  const std::uint64_t body = out.size() - kSequenceStateHeaderBytes;
  for (int i = 0; i < 8; ++i) out[16 + static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(body >> (8 * i));
  const std::uint32_t crc = crc32(out);
  StateWriter(out).put(crc);
}
/// Checks the header, the size and the CRC; on success `body` is the body's bytes.
[[nodiscard]] inline Status open_state(std::span<const std::uint8_t> in, std::span<const std::uint8_t>& body) {
  if (in.size() < kSequenceStateHeaderBytes + 4) {
    return {StatusCode::kCorruptData, "sequence state: " + std::to_string(in.size()) +
                                          " bytes, fewer than a header and a checksum (" +
                                          std::to_string(kSequenceStateHeaderBytes + 4) + ")"};
  }
  if (std::memcmp(in.data(), kSequenceStateMagic.data(), kSequenceStateMagic.size()) != 0) {
    return {StatusCode::kCorruptData, "sequence state: the bytes do not start with the magic \"THKVSEQ\""};
  }
  StateReader r(in.subspan(8, 16));
  std::uint32_t version = 0, flags = 0;
  std::uint64_t size = 0;
  THINKV_RETURN_IF_ERROR(r.get(version, "version"));
  THINKV_RETURN_IF_ERROR(r.get(flags, "flags"));
  THINKV_RETURN_IF_ERROR(r.get(size, "body size"));
  if (version != kSequenceStateVersion) {
    return {StatusCode::kUnsupported, "sequence state: version " + std::to_string(version) +
                                          "; this library reads version " + std::to_string(kSequenceStateVersion)};
  }
  if (flags != 0) return {StatusCode::kUnsupported, "sequence state: flags " + std::to_string(flags) + " not known"};
  if (size != in.size() - kSequenceStateHeaderBytes - 4) {
    return {StatusCode::kCorruptData,
            "sequence state: the header says " + std::to_string(size) + " body bytes, the data holds " +
                std::to_string(in.size() - kSequenceStateHeaderBytes - 4) + " (truncated or extended)"};
  }
  StateReader tail(in.subspan(in.size() - 4));
  std::uint32_t stored = 0;
  THINKV_RETURN_IF_ERROR(tail.get(stored, "checksum"));
  const std::uint32_t crc = crc32(in.first(in.size() - 4));
  if (crc != stored) {
    return {StatusCode::kCorruptData, "sequence state: checksum mismatch (stored " + std::to_string(stored) +
                                          ", computed " + std::to_string(crc) + "): the data is damaged"};
  }
  body = in.subspan(kSequenceStateHeaderBytes, static_cast<std::size_t>(size));
  return Status::ok();
}

}  // namespace thinkv
