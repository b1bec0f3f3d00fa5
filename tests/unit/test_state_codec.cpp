// The sequence-state codec's primitives (include/thinkv/seq/state_codec.hpp): CRC-32 against its
// published check values and a bit-by-bit oracle written from the definition; StateWriter /
// StateReader round trips of every field kind, spans copied whole or value by value, their byte
// layout (little-endian), and the reader's refusals (truncation, a bad bool, an impossible count).

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "thinkv/seq/state_codec.hpp"
#include "thinkv/types.hpp"

#include "test_util.hpp"

using thinkv::StatusCode;

namespace {

/// CRC-32 from its definition: reflected, polynomial 0xEDB88320, one bit at a time.
std::uint32_t crc32_bitwise(const std::uint8_t* p, std::size_t n, std::uint32_t crc = 0) {
  crc = ~crc;
  for (std::size_t i = 0; i < n; ++i) {
    crc ^= p[i];
    for (int k = 0; k < 8; ++k) crc = (crc & 1u) != 0 ? (crc >> 1) ^ 0xEDB88320u : crc >> 1;
  }
  return ~crc;
}

std::vector<std::uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }

}  // namespace

TEST_CASE("crc32: published check values", "[state_codec]") {
  CHECK(thinkv::crc32({}) == 0u);
  CHECK(thinkv::crc32(bytes_of("123456789")) == 0xCBF43926u);  // the CRC-32/ISO-HDLC check value
  CHECK(thinkv::crc32(bytes_of("The quick brown fox jumps over the lazy dog")) == 0x414FA339u);
  CHECK(thinkv::crc32(std::vector<std::uint8_t>(32, 0)) == 0x190A55ADu);
  CHECK(thinkv::crc32(std::vector<std::uint8_t>(32, 0xFF)) == 0xFF6CAB0Bu);
}

TEST_CASE("crc32: equals the bitwise definition for every length, alignment and continuation", "[state_codec]") {
  auto rng = tt::make_rng("crc32");
  std::vector<std::uint8_t> buf(4096 + 16);
  for (auto& b : buf) b = static_cast<std::uint8_t>(tt::uniform_int(rng, 0, 255));
  for (std::size_t len = 0; len <= 80; ++len) {
    for (std::size_t off = 0; off < 8; ++off) {
      INFO("length " << len << " offset " << off);
      REQUIRE(thinkv::crc32(std::span(buf).subspan(off, len)) == crc32_bitwise(buf.data() + off, len));
    }
  }
  for (int i = 0; i < 200; ++i) {
    const auto off = static_cast<std::size_t>(tt::uniform_int(rng, 0, 15));
    const auto len = static_cast<std::size_t>(tt::uniform_int(rng, 0, 4096));
    const auto cut = static_cast<std::size_t>(tt::uniform_int(rng, 0, static_cast<int>(len)));
    const std::span<const std::uint8_t> all = std::span(buf).subspan(off, len);
    INFO("length " << len << " offset " << off << " split at " << cut);
    const std::uint32_t whole = crc32_bitwise(all.data(), all.size());
    REQUIRE(thinkv::crc32(all) == whole);
    REQUIRE(thinkv::crc32(all.subspan(cut), thinkv::crc32(all.first(cut))) == whole);  // continued
  }
}

TEST_CASE("StateWriter / StateReader: fields round trip little-endian, spans whole or value by value",
          "[state_codec]") {
  auto rng = tt::make_rng("state_codec_fields");
  std::vector<std::uint8_t> out;
  thinkv::StateWriter w(out);
  w.put(std::uint32_t{0x01020304u});
  REQUIRE(out == std::vector<std::uint8_t>{0x04, 0x03, 0x02, 0x01});
  w.put(-2.0f);  // 0xC0000000
  REQUIRE(std::vector<std::uint8_t>(out.begin() + 4, out.end()) == std::vector<std::uint8_t>{0, 0, 0, 0xC0});

  std::vector<std::int32_t> i32(1000);
  std::vector<std::uint16_t> u16(333);
  std::vector<std::uint64_t> u64(77);
  std::vector<float> f32(513);
  std::vector<double> f64(65);
  std::vector<thinkv::ThoughtType> types(40);
  std::vector<std::uint8_t> raw(123);
  for (auto& x : i32) x = tt::uniform_int(rng, std::numeric_limits<int>::min(), std::numeric_limits<int>::max());
  for (auto& x : u16) x = static_cast<std::uint16_t>(tt::uniform_int(rng, 0, 65535));
  for (auto& x : u64) x = rng();
  for (auto& x : f32) x = std::bit_cast<float>(static_cast<std::uint32_t>(rng()));  // NaN payloads, -0, inf too
  for (auto& x : f64) x = std::bit_cast<double>(rng());
  for (auto& x : types) x = static_cast<thinkv::ThoughtType>(tt::uniform_int(rng, 0, 2));
  for (auto& x : raw) x = static_cast<std::uint8_t>(rng());
  f32[0] = -0.0f;
  f32[1] = std::numeric_limits<float>::quiet_NaN();
  w.put_span(std::span<const std::int32_t>(i32));
  w.put_span(std::span<const std::uint16_t>(u16));
  w.put_span(std::span<const std::uint64_t>(u64));
  w.put_span(std::span<const float>(f32));
  w.put_span(std::span<const double>(f64));
  w.put_span(std::span<const thinkv::ThoughtType>(types));
  w.put(true);
  w.put(false);
  w.put_bytes(raw);
  // A span's bytes are its values' bytes, value after value (the element-wise layout).
  std::vector<std::uint8_t> one_by_one;
  thinkv::StateWriter w1(one_by_one);
  for (std::int32_t x : i32) w1.put(x);
  REQUIRE(std::equal(one_by_one.begin(), one_by_one.end(), out.begin() + 8));

  thinkv::StateReader r(out);
  std::uint32_t u = 0;
  float f = 0;
  REQUIRE(r.get(u, "u").is_ok());
  REQUIRE(u == 0x01020304u);
  REQUIRE(r.get(f, "f").is_ok());
  REQUIRE(f == -2.0f);
  std::vector<std::int32_t> i32b;
  std::vector<std::uint16_t> u16b;
  std::vector<std::uint64_t> u64b;
  std::vector<float> f32b;
  std::vector<double> f64b;
  std::vector<thinkv::ThoughtType> typesb;
  std::vector<std::uint8_t> rawb;
  bool t = false, fa = true;
  REQUIRE(r.get_vector(i32b, i32.size(), "i32").is_ok());
  REQUIRE(r.get_vector(u16b, u16.size(), "u16").is_ok());
  REQUIRE(r.get_vector(u64b, u64.size(), "u64").is_ok());
  REQUIRE(r.get_vector(f32b, f32.size(), "f32").is_ok());
  REQUIRE(r.get_vector(f64b, f64.size(), "f64").is_ok());
  REQUIRE(r.get_vector(typesb, types.size(), "types").is_ok());
  REQUIRE(r.get(t, "t").is_ok());
  REQUIRE(r.get(fa, "fa").is_ok());
  REQUIRE(r.get_bytes(rawb, raw.size(), "raw").is_ok());
  REQUIRE(r.left() == 0);
  REQUIRE(i32b == i32);
  REQUIRE(u16b == u16);
  REQUIRE(u64b == u64);
  REQUIRE(std::memcmp(f32b.data(), f32.data(), f32.size() * sizeof(float)) == 0);  // bits, NaN included
  REQUIRE(std::memcmp(f64b.data(), f64.data(), f64.size() * sizeof(double)) == 0);
  REQUIRE(typesb == types);
  REQUIRE(t);
  REQUIRE_FALSE(fa);
  REQUIRE(rawb == raw);
}

TEST_CASE("StateReader: truncation, a bad bool and an impossible count are kCorruptData naming the field",
          "[state_codec]") {
  std::vector<std::uint8_t> out;
  thinkv::StateWriter w(out);
  w.put(std::uint16_t{7});
  w.put(std::uint8_t{2});  // not a bool
  {
    thinkv::StateReader r(out);
    std::uint32_t u = 0;
    const thinkv::Status s = r.get(u, "block count");
    REQUIRE(s.code() == StatusCode::kCorruptData);
    CHECK(s.message().find("block count") != std::string::npos);
    REQUIRE(r.left() == 3);  // nothing consumed
  }
  {
    thinkv::StateReader r(out);
    std::uint16_t u = 0;
    bool b = false;
    REQUIRE(r.get(u, "u").is_ok());
    const thinkv::Status s = r.get(b, "segment closed");
    REQUIRE(s.code() == StatusCode::kCorruptData);
    CHECK(s.message().find("segment closed") != std::string::npos);
  }
  {
    thinkv::StateReader r(out);
    std::vector<std::uint32_t> v;
    // A count whose byte size wraps around: refused before anything is allocated.
    const thinkv::Status s = r.get_vector(v, std::numeric_limits<std::size_t>::max() / 2 + 1, "slot positions");
    REQUIRE(s.code() == StatusCode::kCorruptData);
    CHECK(s.message().find("slot positions") != std::string::npos);
    CHECK(v.empty());
    const thinkv::Status s2 = r.get_vector(v, 1, "slot records");  // 4 bytes wanted, 3 left
    REQUIRE(s2.code() == StatusCode::kCorruptData);
    REQUIRE(r.left() == 3);
  }
}
