// Oracle tests: our FP8 E4M3 / E2M1 / BF16 / FP16 encoders and decoders against NVIDIA's host-side
// conversions from cuda_fp8.h, cuda_fp4.h and cuda_bf16.h, bit for bit. Host-only code (no GPU):
// build with the CUDA toolkit include directory on the include path. The exhaustive sweep over all
// 2^32 float bit patterns is tagged [.exhaustive] (hidden); run it with `test_cuda_oracle
// "[exhaustive]"`. Random inputs use a fresh seed each run (printed on failure); set
// THINKV_TEST_SEED=<n> to pin it.

// cuda_fp4.hpp has unused parameters; keep -Wextra -Werror builds clean even when the CUDA include
// directory is not added as a system directory.
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
#endif
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp4.h>
#include <cuda_fp8.h>
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "thinkv/formats.hpp"

namespace {

using thinkv::bits_to_float;
using thinkv::float_to_bits;

std::uint64_t test_seed() {
  static const std::uint64_t seed = [] {
    if (const char* env = std::getenv("THINKV_TEST_SEED"); env != nullptr && *env != '\0') {
      return static_cast<std::uint64_t>(std::strtoull(env, nullptr, 10));
    }
    std::random_device rd;
    return (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
  }();
  return seed;
}

// ---- NVIDIA references -------------------------------------------------------------------------

std::uint8_t nv_encode_e4m3(float x) {
  return static_cast<std::uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
}
std::uint8_t nv_encode_e2m1(float x) {
  return static_cast<std::uint8_t>(__nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest));
}
std::uint16_t nv_encode_bf16(float x) {
  const __nv_bfloat16_raw r = __float2bfloat16_rn(x);
  return r.x;
}
std::uint16_t nv_encode_fp16(float x) {
  const __half_raw r = __float2half_rn(x);
  return r.x;
}
float half_raw_to_float(__half_raw h) { return __half2float(__half(h)); }
float nv_decode_e4m3(std::uint8_t c) { return half_raw_to_float(__nv_cvt_fp8_to_halfraw(c, __NV_E4M3)); }
float nv_decode_e2m1(std::uint8_t c) { return half_raw_to_float(__nv_cvt_fp4_to_halfraw(c, __NV_E2M1)); }
float nv_decode_bf16(std::uint16_t h) {
  __nv_bfloat16_raw r;
  r.x = h;
  return __bfloat162float(__nv_bfloat16(r));
}

// Same value, or both NaN; +0 and -0 are told apart.
bool same_float(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return float_to_bits(a) == float_to_bits(b);
}

std::string hex(std::uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08X", v);
  return buf;
}

// ---- input sets --------------------------------------------------------------------------------

void push_with_neighbours(std::vector<float>& v, float x) {
  for (float s : {x, -x}) {
    v.push_back(s);
    v.push_back(std::nextafter(s, std::numeric_limits<float>::infinity()));
    v.push_back(std::nextafter(s, -std::numeric_limits<float>::infinity()));
  }
}

void push_specials(std::vector<float>& v) {
  for (std::uint32_t b :
       {0x00000000u, 0x80000000u,                                                                   // +-0
        0x7F800000u, 0xFF800000u,                                                                   // +-Inf
        0x7FC00000u, 0xFFC00000u, 0x7FFFFFFFu, 0xFFFFFFFFu,                                         // quiet NaNs
        0x7F800001u, 0xFF800001u, 0x7FA00000u, 0xFFA00000u,                                         // signalling NaNs
        0x7FBFFFFFu, 0x7FC00001u, 0xFFC12345u, 0x00000001u, 0x80000001u, 0x00400000u, 0x80400000u,  // float subnormals
        0x007FFFFFu, 0x807FFFFFu, 0x00800000u, 0x80800000u,  // largest subnormal, FLT_MIN
        0x7F7FFFFFu, 0xFF7FFFFFu}) {                         // +-FLT_MAX
    v.push_back(bits_to_float(b));
  }
}

// Every exact value of a format (from its decoder over all codes), every midpoint between adjacent
// non-negative values, and +-1 ulp around each, with both signs.
template <typename Decode>
std::vector<float> grid_inputs(int num_codes, Decode decode, std::initializer_list<float> extra) {
  std::vector<float> vals;
  for (int c = 0; c < num_codes; ++c) {
    const float f = decode(static_cast<std::uint8_t>(c));
    if (!std::isnan(f) && !std::signbit(f)) vals.push_back(f);
  }
  std::sort(vals.begin(), vals.end());
  std::vector<float> in;
  for (std::size_t i = 0; i < vals.size(); ++i) {
    push_with_neighbours(in, vals[i]);
    if (i + 1 < vals.size()) {
      const double mid = (static_cast<double>(vals[i]) + vals[i + 1]) / 2.0;
      REQUIRE(static_cast<double>(static_cast<float>(mid)) == mid);  // midpoints are exact floats
      push_with_neighbours(in, static_cast<float>(mid));
    }
  }
  for (float e : extra) push_with_neighbours(in, e);
  push_specials(in);
  return in;
}

// Random floats: sign random, unbiased exponent uniform in [-30, 30], mantissa bits uniform; plus
// the same number of uniformly random 32-bit patterns (all exponents, NaNs, subnormals).
std::vector<float> random_inputs(std::uint64_t seed, int count) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> exp_dist(-30, 30);
  std::uniform_int_distribution<std::uint32_t> bits_dist;
  std::vector<float> in;
  in.reserve(2 * static_cast<std::size_t>(count));
  for (int i = 0; i < count; ++i) {
    const std::uint32_t r = bits_dist(rng);
    const auto e = static_cast<std::uint32_t>(exp_dist(rng) + 127);
    in.push_back(bits_to_float((r & 0x80000000u) | (e << 23) | (r & 0x7FFFFFu)));
    in.push_back(bits_to_float(bits_dist(rng)));
  }
  return in;
}

template <typename Ours, typename Theirs>
void check_encoder(const std::vector<float>& inputs, Ours ours, Theirs theirs) {
  std::size_t mismatches = 0;
  std::uint32_t first_bits = 0;
  unsigned first_ours = 0;
  unsigned first_theirs = 0;
  for (float x : inputs) {
    const unsigned a = ours(x);
    const unsigned b = theirs(x);
    if (a != b) {
      if (mismatches == 0) {
        first_bits = float_to_bits(x);
        first_ours = a;
        first_theirs = b;
      }
      ++mismatches;
    }
  }
  INFO("inputs: " << inputs.size() << ", first mismatch: x bits " << hex(first_bits) << " ours " << hex(first_ours)
                  << " nvidia " << hex(first_theirs));
  CHECK(mismatches == 0);
}

}  // namespace

TEST_CASE("E4M3 decode of all 256 codes matches __nv_cvt_fp8_to_halfraw", "[oracle][e4m3]") {
  for (int c = 0; c < 256; ++c) {
    const auto code = static_cast<std::uint8_t>(c);
    INFO("code " << c);
    CHECK(same_float(thinkv::decode_e4m3(code), nv_decode_e4m3(code)));
  }
  CHECK(std::isnan(thinkv::decode_e4m3(0x7F)));
  CHECK(std::isnan(thinkv::decode_e4m3(0xFF)));
  CHECK(thinkv::decode_e4m3(0x7E) == 448.0f);
  CHECK(thinkv::decode_e4m3(0x01) == 0x1p-9f);
}

TEST_CASE("E2M1 decode of all 16 codes matches __nv_cvt_fp4_to_halfraw", "[oracle][e2m1]") {
  for (int c = 0; c < 16; ++c) {
    const auto code = static_cast<std::uint8_t>(c);
    INFO("code " << c);
    CHECK(same_float(thinkv::decode_e2m1(code), nv_decode_e2m1(code)));
  }
}

TEST_CASE("BF16 decode matches __bfloat162float on all 65536 codes", "[oracle][bf16]") {
  std::size_t mismatches = 0;
  for (std::uint32_t h = 0; h < 65536u; ++h) {
    const auto code = static_cast<std::uint16_t>(h);
    if (!same_float(thinkv::decode_bf16(code), nv_decode_bf16(code))) ++mismatches;
  }
  CHECK(mismatches == 0);
}

TEST_CASE("FP16 decode (bit-placement dequant's reference) matches __half2float on all 65536 codes", "[oracle][fp16]") {
  int bad = 0;
  for (std::uint32_t c = 0; c < 65536; ++c) {
    __half_raw raw;
    raw.x = static_cast<unsigned short>(c);
    const float want = __half2float(__half(raw));
    const float got = thinkv::decode_fp16(static_cast<std::uint16_t>(c));
    const bool same = std::isnan(want) ? std::isnan(got) : thinkv::float_to_bits(got) == thinkv::float_to_bits(want);
    bad += !same;
  }
  CHECK(bad == 0);
}

TEST_CASE("E4M3 encode matches __nv_cvt_float_to_fp8(SATFINITE, E4M3) bit for bit", "[oracle][e4m3]") {
  const auto ours = [](float x) { return thinkv::encode_e4m3(x); };
  SECTION("codes, midpoints, +-1 ulp, subnormals, saturation, specials") {
    check_encoder(grid_inputs(256, thinkv::decode_e4m3,
                              {464.0f, 480.0f, 496.0f, 512.0f, 1e6f, 0x1p-10f, 0x1p-11f, 0x1.8p-10f, 0x1p-7f, 0x1p-6f}),
                  ours, nv_encode_e4m3);
  }
  SECTION("random floats") {
    INFO("seed " << test_seed() << " (set THINKV_TEST_SEED to reproduce)");
    check_encoder(random_inputs(test_seed(), 1000000), ours, nv_encode_e4m3);
  }
  SECTION("documented special cases") {
    CHECK(thinkv::encode_e4m3(-0.0f) == 0x80);
    CHECK(nv_encode_e4m3(-0.0f) == 0x80);
    CHECK(thinkv::encode_e4m3(bits_to_float(0xFFC00000u)) == 0x7F);  // NaN sign dropped
    CHECK(nv_encode_e4m3(bits_to_float(0xFFC00000u)) == 0x7F);
    CHECK(nv_encode_e4m3(-std::numeric_limits<float>::infinity()) == 0xFE);
    CHECK(nv_encode_e4m3(464.0f) == 0x7E);     // tie rounds to even (448)
    CHECK(nv_encode_e4m3(-0x1p-11f) == 0x80);  // underflow keeps the sign
  }
}

TEST_CASE("E2M1 encode matches __nv_cvt_float_to_fp4(E2M1, cudaRoundNearest) bit for bit", "[oracle][e2m1]") {
  const auto ours = [](float x) { return thinkv::encode_e2m1(x); };
  SECTION("codes, midpoints, +-1 ulp, subnormals, saturation, specials") {
    check_encoder(grid_inputs(16, thinkv::decode_e2m1, {6.5f, 7.0f, 8.0f, 12.0f, 1e6f, 0.25f, 0.125f, 0.75f}), ours,
                  nv_encode_e2m1);
  }
  SECTION("random floats") {
    INFO("seed " << test_seed() << " (set THINKV_TEST_SEED to reproduce)");
    check_encoder(random_inputs(test_seed() + 1, 1000000), ours, nv_encode_e2m1);
  }
  SECTION("documented special cases") {
    CHECK(nv_encode_e2m1(-0.0f) == 0x8);
    CHECK(nv_encode_e2m1(bits_to_float(0xFFC00000u)) == 0x7);  // NaN -> +6
    CHECK(nv_encode_e2m1(std::numeric_limits<float>::infinity()) == 0x7);
    CHECK(nv_encode_e2m1(-std::numeric_limits<float>::infinity()) == 0xF);
    CHECK(nv_encode_e2m1(-0.25f) == 0x8);  // tie to even (zero), sign kept
  }
}

TEST_CASE("BF16 encode matches __float2bfloat16_rn bit for bit", "[oracle][bf16]") {
  const auto ours = [](float x) { return thinkv::encode_bf16(x); };
  SECTION("every exponent: exact, ties, tie +-1, random low bits; specials") {
    std::mt19937_64 rng(test_seed() + 2);
    std::uniform_int_distribution<std::uint32_t> bits_dist;
    std::vector<float> in;
    for (std::uint32_t sign = 0; sign < 2; ++sign) {
      for (std::uint32_t e = 0; e < 256; ++e) {
        for (std::uint32_t hi : {0x00u, 0x01u, 0x7Eu, 0x7Fu, 0x40u, 0x41u}) {  // bf16 mantissa
          for (std::uint32_t lo : {0x0000u, 0x0001u, 0x7FFFu, 0x8000u, 0x8001u, 0xFFFFu, bits_dist(rng) & 0xFFFFu}) {
            in.push_back(bits_to_float((sign << 31) | (e << 23) | (hi << 16) | lo));
          }
        }
      }
    }
    push_specials(in);
    check_encoder(in, ours, nv_encode_bf16);
  }
  SECTION("random floats") {
    INFO("seed " << test_seed() << " (set THINKV_TEST_SEED to reproduce)");
    check_encoder(random_inputs(test_seed() + 3, 1000000), ours, nv_encode_bf16);
  }
  SECTION("documented special cases") {
    CHECK(nv_encode_bf16(bits_to_float(0xFFC00000u)) == 0x7FFF);  // every NaN -> 0x7FFF
    CHECK(nv_encode_bf16(bits_to_float(0x7F800001u)) == 0x7FFF);
    CHECK(nv_encode_bf16(-0.0f) == 0x8000);
    CHECK(nv_encode_bf16(bits_to_float(0x7F7FFFFFu)) == 0x7F80);  // overflow to +Inf
  }
}

TEST_CASE("FP16 encode matches __float2half_rn bit for bit", "[oracle][fp16]") {
  const auto ours = [](float x) { return thinkv::encode_fp16(x); };
  SECTION("every float exponent: exact, ties, tie +-1, random low bits; specials") {
    // FP16 keeps 10 of the 23 mantissa bits in its normal range and fewer below 2^-14: the low
    // 13 bits (or more) decide the rounding. Each exponent gets exact values, ties, tie +-1 and
    // random low bits with even and odd kept mantissas.
    std::mt19937_64 rng(test_seed() + 5);
    std::uniform_int_distribution<std::uint32_t> bits_dist;
    std::vector<float> in;
    for (std::uint32_t sign = 0; sign < 2; ++sign) {
      for (std::uint32_t e = 0; e < 256; ++e) {
        for (std::uint32_t m = 0; m < 64; ++m) {
          const std::uint32_t man = m < 8 ? (m << 20) | (m & 1u) << 13  // a few kept patterns
                                          : bits_dist(rng) & 0x7FFFFFu;
          for (std::uint32_t lo_shift : {0u, 1u, 13u, 14u, 17u, 20u}) {
            const std::uint32_t half = lo_shift ? 1u << (lo_shift - 1) : 0u;
            const std::uint32_t keep = man & ~((1u << lo_shift) - 1u);
            for (std::uint32_t lo : {0u, half, half - (half ? 1u : 0u), half + 1u}) {
              in.push_back(bits_to_float((sign << 31) | (e << 23) | ((keep | lo) & 0x7FFFFFu)));
            }
          }
        }
      }
    }
    for (float x : {65504.0f, 65519.0f, 65519.996f, 65520.0f, 65536.0f, 0x1p-24f, 0x1p-25f, 0x1.8p-25f,
                    0x1.0000002p-25f, 0x1p-14f, 0x1.ff8p-15f, 0x1.ffcp-15f}) {
      push_with_neighbours(in, x);
    }
    push_specials(in);
    check_encoder(in, ours, nv_encode_fp16);
  }
  SECTION("random floats") {
    INFO("seed " << test_seed() << " (set THINKV_TEST_SEED to reproduce)");
    check_encoder(random_inputs(test_seed() + 6, 1000000), ours, nv_encode_fp16);
  }
  SECTION("encode then decode is the identity on every non-NaN FP16 code") {
    int bad = 0;
    for (std::uint32_t c = 0; c < 65536; ++c) {
      const auto code = static_cast<std::uint16_t>(c);
      const float x = thinkv::decode_fp16(code);
      if (!std::isnan(x)) bad += thinkv::encode_fp16(x) != code;
    }
    CHECK(bad == 0);
  }
  SECTION("documented special cases") {
    CHECK(nv_encode_fp16(bits_to_float(0xFFC00000u)) == thinkv::kFp16CanonicalNan);
    CHECK(nv_encode_fp16(65520.0f) == 0x7C00);  // the tie above 65504 overflows to +Inf
    CHECK(nv_encode_fp16(-0.0f) == 0x8000);
  }
}

TEST_CASE("NVFP4 packing matches __nv_cvt_float2_to_fp4x2 (element 2j = low nibble)", "[oracle][packing]") {
  INFO("seed " << test_seed() << " (set THINKV_TEST_SEED to reproduce)");
  std::mt19937_64 rng(test_seed() + 4);
  std::uniform_real_distribution<float> dist(-7.0f, 7.0f);
  constexpr int kN = 64;
  for (int trial = 0; trial < 200; ++trial) {
    float x[kN];
    for (float& v : x) v = dist(rng);
    std::uint8_t row[kN / 2] = {};
    for (int i = 0; i < kN; ++i) { thinkv::store_code(thinkv::Precision::kNvfp4, row, i, thinkv::encode_e2m1(x[i])); }
    for (int j = 0; j < kN / 2; ++j) {
      const float2 pair = make_float2(x[2 * j], x[2 * j + 1]);
      const auto nv = static_cast<std::uint8_t>(__nv_cvt_float2_to_fp4x2(pair, __NV_E2M1, cudaRoundNearest));
      INFO("trial " << trial << " byte " << j);
      REQUIRE(row[j] == nv);
      const __half2_raw h2 = __nv_cvt_fp4x2_to_halfraw2(row[j], __NV_E2M1);
      __half_raw lo;
      lo.x = h2.x;
      __half_raw hi;
      hi.x = h2.y;
      CHECK(same_float(half_raw_to_float(lo),
                       thinkv::decode_e2m1(thinkv::load_code(thinkv::Precision::kNvfp4, row, 2 * j))));
      CHECK(same_float(half_raw_to_float(hi),
                       thinkv::decode_e2m1(thinkv::load_code(thinkv::Precision::kNvfp4, row, 2 * j + 1))));
    }
  }
}

TEST_CASE("exhaustive: all 2^32 floats through E4M3, E2M1, BF16 and FP16 encoders", "[.exhaustive][oracle]") {
  std::uint64_t bad_e4m3 = 0;
  std::uint64_t bad_e2m1 = 0;
  std::uint64_t bad_bf16 = 0;
  std::uint64_t bad_fp16 = 0;
  std::uint32_t u = 0;
  do {
    const float x = bits_to_float(u);
    bad_e4m3 += thinkv::encode_e4m3(x) != nv_encode_e4m3(x);
    bad_e2m1 += thinkv::encode_e2m1(x) != nv_encode_e2m1(x);
    bad_bf16 += thinkv::encode_bf16(x) != nv_encode_bf16(x);
    bad_fp16 += thinkv::encode_fp16(x) != nv_encode_fp16(x);
    ++u;
  } while (u != 0u);
  CHECK(bad_e4m3 == 0);
  CHECK(bad_e2m1 == 0);
  CHECK(bad_bf16 == 0);
  CHECK(bad_fp16 == 0);
}
