// Unit tests for include/thinkv/formats/: the FP8 E4M3, E2M1 and BF16 encoders against independent
// brute-force references, packing, the stream/group scale rules, the ternary optimum, and the
// round-trip error bounds and NMSE stated in docs/formats.md. Host-only (no CUDA headers).
//
// Random groups are drawn fresh each run from a seed printed with every failure (and once as a
// warning); set THINKV_TEST_SEED=<n> to reproduce a run.

#include <algorithm>
#include <array>
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
using thinkv::Precision;

constexpr std::array<Precision, 3> kQuantized = {Precision::kFp8E4M3, Precision::kNvfp4, Precision::kTernary};

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

#define THINKV_SEED_INFO() INFO("seed " << test_seed() << " (set THINKV_TEST_SEED to reproduce)")

// ---- brute-force references (independent of the bit tricks under test) ------------------------

// Nearest of the sorted non-negative values vals[0..] (code i has value vals[i]), ties to the even
// code, magnitudes above vals.back() saturate; sign goes to `sign_bit`.
std::uint8_t nearest_code(const std::vector<double>& vals, double x, std::uint8_t sign_bit) {
  const double a = std::fabs(x);
  std::size_t best = 0;
  for (std::size_t i = 1; i < vals.size(); ++i) {
    const double di = std::fabs(vals[i] - a);
    const double db = std::fabs(vals[best] - a);
    if (di < db || (di == db && (i % 2 == 0))) best = i;
  }
  return static_cast<std::uint8_t>(best | (std::signbit(x) ? sign_bit : 0u));
}

const std::vector<double>& e4m3_values() {  // codes 0x00..0x7E
  static const std::vector<double> v = [] {
    std::vector<double> r;
    for (int c = 0; c <= 0x7E; ++c) {
      const int e = c >> 3;
      const int m = c & 7;
      r.push_back(e == 0 ? m * std::ldexp(1.0, -9) : (1.0 + m / 8.0) * std::ldexp(1.0, e - 7));
    }
    return r;
  }();
  return v;
}

const std::vector<double>& e2m1_values() {  // codes 0..7
  static const std::vector<double> v = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};
  return v;
}

std::uint16_t reference_bf16(float x) {
  const std::uint32_t u = float_to_bits(x);
  const std::uint32_t lo = u & 0xFFFF0000u;
  if ((u & 0xFFFFu) == 0) return static_cast<std::uint16_t>(u >> 16);
  const std::uint32_t hi = lo + 0x10000u;  // next bf16 away from zero (may be Inf)
  const double dx = x;
  const double dl = std::fabs(static_cast<double>(bits_to_float(lo)) - dx);
  // Distance to the next value computed from the ulp so that "Inf" works as 2^128.
  const int exp = static_cast<int>((lo >> 23) & 0xFF);
  const double ulp = std::ldexp(1.0, (exp == 0 ? 1 : exp) - 127 - 7);
  const double dh = ulp - dl;
  if (dl < dh) return static_cast<std::uint16_t>(lo >> 16);
  if (dh < dl) return static_cast<std::uint16_t>(hi >> 16);
  return static_cast<std::uint16_t>(((lo >> 16) & 1u) != 0 ? hi >> 16 : lo >> 16);
}

// Random finite floats: sign random, exponent in [emin, emax], mantissa bits uniform.
float random_float(std::mt19937_64& rng, int emin, int emax) {
  std::uniform_int_distribution<int> ed(emin, emax);
  const auto r = static_cast<std::uint32_t>(rng());
  const auto e = static_cast<std::uint32_t>(ed(rng) + 127);
  return bits_to_float((r & 0x80000000u) | (e << 23) | (r & 0x7FFFFFu));
}

// ---- constexpr checks --------------------------------------------------------------------------

static_assert(thinkv::encode_e4m3(448.0f) == 0x7E);
static_assert(thinkv::encode_e4m3(-448.0f) == 0xFE);
static_assert(thinkv::encode_e4m3(1.0f) == 0x38);
static_assert(thinkv::encode_e4m3(0x1p-9f) == 0x01);
static_assert(thinkv::decode_e4m3(0x38) == 1.0f);
static_assert(thinkv::decode_e4m3(0x7E) == 448.0f);
static_assert(thinkv::encode_e2m1(6.0f) == 0x7);
static_assert(thinkv::encode_e2m1(-0.5f) == 0x9);
static_assert(thinkv::decode_e2m1(0xF) == -6.0f);
static_assert(thinkv::encode_bf16(1.0f) == 0x3F80);
static_assert(thinkv::decode_bf16(0xC000) == -2.0f);
static_assert(thinkv::packed_row_bytes(Precision::kNvfp4, 16) == 8);
static_assert(thinkv::packed_row_bytes(Precision::kTernary, 16) == 4);
static_assert(thinkv::packed_row_bytes(Precision::kTernary, 6) == 2);
static_assert(thinkv::packed_row_bytes(Precision::kFp8E4M3, 16) == 16);
static_assert(thinkv::packed_row_bytes(Precision::kBf16, 16) == 32);
static_assert(thinkv::choose_stream_scale(Precision::kNvfp4, 6.0f * 8.0f) == 1.0f);

// ---- round-trip statistics ----------------------------------------------------------------------

enum class Dist { kGaussian, kStudentT3, kLaplace, kOutlier };
constexpr std::array<Dist, 4> kDists = {Dist::kGaussian, Dist::kStudentT3, Dist::kLaplace, Dist::kOutlier};
const char* dist_name(Dist d) {
  switch (d) {
    case Dist::kGaussian: return "gaussian";
    case Dist::kStudentT3: return "student_t3";
    case Dist::kLaplace: return "laplace";
    case Dist::kOutlier: return "gaussian+100x_outlier";
  }
  return "?";
}

void draw_group(std::mt19937_64& rng, Dist d, float sigma, int n, float* x) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::student_t_distribution<float> student(3.0f);
  std::exponential_distribution<float> expo(1.0f);
  for (int i = 0; i < n; ++i) {
    float v = 0.0f;
    switch (d) {
      case Dist::kGaussian:
      case Dist::kOutlier: v = normal(rng); break;
      case Dist::kStudentT3: v = student(rng); break;
      case Dist::kLaplace: v = (rng() & 1u) != 0 ? expo(rng) : -expo(rng); break;
    }
    x[i] = v * sigma;
  }
  if (d == Dist::kOutlier) {
    const auto j = static_cast<int>(rng() % static_cast<std::uint64_t>(n));
    x[j] = ((rng() & 1u) != 0 ? 100.0f : -100.0f) * sigma;
  }
}

struct GroupResult {
  double sse = 0.0;     // sum of squared errors
  double energy = 0.0;  // sum of x^2
  bool saturated = false;
};

// Quantizes one group, checks every rule and per-element bound of docs/formats.md, returns errors.
GroupResult quantize_and_check(Precision p, const float* x, int n, float s2) {
  std::uint8_t codes[thinkv::kMaxGroupSize];
  const std::uint8_t sc = thinkv::quantize_group(p, x, 1, n, s2, codes, 1);
  const float amax = thinkv::group_amax(x, 1, n);
  const float q = thinkv::quant_max(p);
  const float S = thinkv::decode_e4m3(sc) * s2;
  const double dS = S;
  GroupResult r;
  r.saturated = thinkv::group_scale_saturates(p, amax, s2);
  INFO("precision " << p << " n " << n << " s2 " << s2 << " amax " << amax << " scale code " << int(sc));
  REQUIRE(sc != thinkv::kE4M3NanCode);
  REQUIRE((sc & 0x80) == 0);  // scales are non-negative
  if (p != Precision::kTernary) {
    if (amax == 0.0f) {
      REQUIRE(sc == 0);
    } else {
      REQUIRE(sc != 0);
      // Scale rule: never below amax / Q unless saturated; saturated <=> code pinned at 448.
      if (r.saturated) {
        REQUIRE(sc == thinkv::kE4M3MaxCode);
      } else {
        REQUIRE(dS * q >= amax);
        const double d = static_cast<double>(amax) / q / s2;
        const double upper = std::max(d * (1.0 + 0x1p-3), d + 0x1p-9) * (1.0 + 0x1p-20);
        REQUIRE(dS / s2 <= upper);
      }
    }
  }
  // The scale code is exactly the one the rule of docs/formats.md gives.
  if (p == Precision::kTernary) {
    REQUIRE(sc == thinkv::encode_e4m3(thinkv::ternary_optimal_scale(x, 1, n) / s2));
  } else if (amax > 0.0f) {
    std::uint8_t want = thinkv::encode_e4m3(amax / (q * s2));
    if (thinkv::decode_e4m3(want) * s2 * q < amax && want < 0x7E) ++want;
    REQUIRE(sc == want);
  }
  const float a = S;  // ternary: the decoded group scale `a`
  for (int i = 0; i < n; ++i) {
    const std::uint8_t c = codes[i];
    REQUIRE(c < (1u << thinkv::bits_of(p)));
    const float xhat = thinkv::dequantize(p, c, sc, s2);
    REQUIRE(xhat == thinkv::decode_element(p, c) * (thinkv::decode_e4m3(sc) * s2));
    const double xi = x[i];
    const double err = std::fabs(static_cast<double>(xhat) - xi);
    r.sse += err * err;
    r.energy += xi * xi;
    INFO("element " << i << " x " << x[i] << " code " << int(c) << " xhat " << xhat);
    const double slack = (std::fabs(xi) + dS) * 0x1p-21;  // the one float rounding: x / S
    switch (p) {
      case Precision::kFp8E4M3:
        REQUIRE(c == thinkv::encode_e4m3(x[i] / S));
        if (!r.saturated) REQUIRE(err <= std::fabs(xi) * 0x1p-4 + dS * 0x1p-10 + slack);
        break;
      case Precision::kNvfp4:
        REQUIRE(c == thinkv::encode_e2m1(x[i] / S));
        if (!r.saturated) REQUIRE(err <= std::max(0.25 * dS, std::fabs(xi) / 4.0) + slack);
        break;
      case Precision::kTernary:
        REQUIRE(c != 0x2);
        // Nearest of {-a, 0, +a}, ties to 0; hence |err| <= max(a/2, |x| - a) exactly.
        if (a > 0.0f && std::fabs(x[i]) > 0.5f * a) {
          REQUIRE(c == (x[i] > 0 ? thinkv::kTernaryPlus : thinkv::kTernaryMinus));
        } else {
          REQUIRE(c == thinkv::kTernaryZero);
        }
        REQUIRE(err <= std::max(0.5 * dS, std::fabs(xi) - dS));
        break;
      case Precision::kBf16: break;
    }
  }
  return r;
}

struct Nmse {
  double sum = 0.0;
  int groups = 0;
  int saturated = 0;
  void add(const GroupResult& g) {  // the mean is over unsaturated nonzero groups
    if (g.saturated) {
      ++saturated;
    } else if (g.energy > 0.0) {
      sum += g.sse / g.energy;
      ++groups;
    }
  }
  [[nodiscard]] double mean() const { return groups > 0 ? sum / groups : 0.0; }
};

// Runs `streams` streams of `groups_per_stream` groups: s2 is chosen from the stream's first group
// (amax of a group at scale sigma), later groups are drawn at sigma * rel.
Nmse run_streams(std::mt19937_64& rng, Precision p, Dist d, int n, float rel, int streams, int groups_per_stream) {
  Nmse out;
  std::uniform_real_distribution<float> log_sigma(-4.0f, 4.0f);
  float x[thinkv::kMaxGroupSize];
  for (int s = 0; s < streams; ++s) {
    const float sigma = std::pow(10.0f, log_sigma(rng));
    draw_group(rng, d, sigma, n, x);
    const float s2 = thinkv::choose_stream_scale(p, thinkv::group_amax(x, 1, n));
    out.add(quantize_and_check(p, x, n, s2));
    for (int k = 1; k < groups_per_stream; ++k) {
      draw_group(rng, d, sigma * rel, n, x);
      out.add(quantize_and_check(p, x, n, s2));
    }
  }
  return out;
}

// Measured mean per-group NMSE at g = 16, relative scale 1 (docs/formats.md table), times ~1.5.
double nmse_limit(Precision p, Dist d) {
  constexpr double kMargin = 1.5;
  // rows: precision (fp8, nvfp4, ternary); columns: gaussian, student_t3, laplace, outlier
  constexpr double kMeasured[3][4] = {
      {6.4e-4, 6.0e-4, 6.1e-4, 4.4e-4},  // fp8_e4m3
      {1.0e-2, 9.9e-3, 1.0e-2, 4.7e-3},  // nvfp4
      {0.164, 0.200, 0.194, 2.2e-3},     // ternary
  };
  const int row = p == Precision::kFp8E4M3 ? 0 : (p == Precision::kNvfp4 ? 1 : 2);
  return kMargin * kMeasured[row][static_cast<int>(d)];
}

}  // namespace

// ==== E4M3 =======================================================================================

TEST_CASE("E4M3 decode: layout, special codes, monotone", "[formats][e4m3]") {
  for (int c = 0; c <= 0x7E; ++c) {
    const auto code = static_cast<std::uint8_t>(c);
    INFO("code " << c);
    CHECK(static_cast<double>(thinkv::decode_e4m3(code)) == e4m3_values()[static_cast<std::size_t>(c)]);
    CHECK(thinkv::decode_e4m3(static_cast<std::uint8_t>(c | 0x80)) == -thinkv::decode_e4m3(code));
    CHECK(thinkv::encode_e4m3(thinkv::decode_e4m3(code)) == code);  // exact values round-trip
    if (c > 0) CHECK(thinkv::decode_e4m3(code) > thinkv::decode_e4m3(static_cast<std::uint8_t>(c - 1)));
  }
  CHECK(std::isnan(thinkv::decode_e4m3(0x7F)));
  CHECK(std::isnan(thinkv::decode_e4m3(0xFF)));
  CHECK(std::signbit(thinkv::decode_e4m3(0x80)));
  CHECK(thinkv::decode_e4m3(0x80) == 0.0f);
  CHECK(thinkv::decode_e4m3(0x08) == thinkv::kE4M3MinNormal);
  CHECK(thinkv::decode_e4m3(0x07) == 7 * 0x1p-9f);
}

TEST_CASE("E4M3 encode: nearest-even, saturating, specials", "[formats][e4m3]") {
  THINKV_SEED_INFO();
  const auto inf = std::numeric_limits<float>::infinity();
  CHECK(thinkv::encode_e4m3(464.0f) == 0x7E);  // tie between 448 and (nonexistent) 480 -> 448
  CHECK(thinkv::encode_e4m3(std::nextafter(464.0f, inf)) == 0x7E);
  CHECK(thinkv::encode_e4m3(1e30f) == 0x7E);
  CHECK(thinkv::encode_e4m3(-1e30f) == 0xFE);
  CHECK(thinkv::encode_e4m3(inf) == 0x7E);
  CHECK(thinkv::encode_e4m3(-inf) == 0xFE);
  CHECK(thinkv::encode_e4m3(std::numeric_limits<float>::quiet_NaN()) == 0x7F);
  CHECK(thinkv::encode_e4m3(-std::numeric_limits<float>::quiet_NaN()) == 0x7F);
  CHECK(thinkv::encode_e4m3(std::numeric_limits<float>::signaling_NaN()) == 0x7F);
  CHECK(thinkv::encode_e4m3(0.0f) == 0x00);
  CHECK(thinkv::encode_e4m3(-0.0f) == 0x80);
  CHECK(thinkv::encode_e4m3(0x1p-10f) == 0x00);  // tie between 0 and 2^-9 -> 0 (even)
  CHECK(thinkv::encode_e4m3(-0x1p-10f) == 0x80);
  CHECK(thinkv::encode_e4m3(std::nextafter(0x1p-10f, 1.0f)) == 0x01);
  CHECK(thinkv::encode_e4m3(3 * 0x1p-10f) == 0x02);  // tie 1 vs 2 units -> 2 (even)
  CHECK(thinkv::encode_e4m3(1.0625f) == 0x38);       // tie 1 vs 1.125 -> 1 (even)
  CHECK(thinkv::encode_e4m3(1.1875f) == 0x3A);       // tie 1.125 vs 1.25 -> 1.25 (even)
  CHECK(thinkv::encode_e4m3(std::numeric_limits<float>::denorm_min()) == 0x00);
  std::mt19937_64 rng(test_seed());
  int mismatches = 0;
  for (int i = 0; i < 200000; ++i) {
    const float x = random_float(rng, -14, 10);
    if (thinkv::encode_e4m3(x) != nearest_code(e4m3_values(), x, 0x80)) ++mismatches;
  }
  CHECK(mismatches == 0);
}

// ==== E2M1 =======================================================================================

TEST_CASE("E2M1 decode: value table", "[formats][e2m1]") {
  constexpr float kTable[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  for (int c = 0; c < 8; ++c) {
    const auto code = static_cast<std::uint8_t>(c);
    CHECK(thinkv::decode_e2m1(code) == kTable[c]);
    CHECK(thinkv::decode_e2m1(static_cast<std::uint8_t>(c | 8)) == -kTable[c]);
    CHECK(thinkv::encode_e2m1(kTable[c]) == code);
    CHECK(thinkv::encode_e2m1(-kTable[c]) == (c | 8));
    CHECK(thinkv::decode_e2m1(static_cast<std::uint8_t>(c | 0xF0)) == thinkv::decode_e2m1(code));
  }
  CHECK(std::signbit(thinkv::decode_e2m1(0x8)));
}

TEST_CASE("E2M1 encode: nearest-even, saturating, specials", "[formats][e2m1]") {
  THINKV_SEED_INFO();
  const auto inf = std::numeric_limits<float>::infinity();
  CHECK(thinkv::encode_e2m1(0.25f) == 0x0);  // ties go to the even code
  CHECK(thinkv::encode_e2m1(0.75f) == 0x2);
  CHECK(thinkv::encode_e2m1(1.25f) == 0x2);
  CHECK(thinkv::encode_e2m1(1.75f) == 0x4);
  CHECK(thinkv::encode_e2m1(2.5f) == 0x4);
  CHECK(thinkv::encode_e2m1(3.5f) == 0x6);
  CHECK(thinkv::encode_e2m1(5.0f) == 0x6);
  CHECK(thinkv::encode_e2m1(std::nextafter(5.0f, inf)) == 0x7);
  CHECK(thinkv::encode_e2m1(7.0f) == 0x7);
  CHECK(thinkv::encode_e2m1(-8.0f) == 0xF);
  CHECK(thinkv::encode_e2m1(inf) == 0x7);
  CHECK(thinkv::encode_e2m1(-inf) == 0xF);
  CHECK(thinkv::encode_e2m1(std::numeric_limits<float>::quiet_NaN()) == 0x7);
  CHECK(thinkv::encode_e2m1(-std::numeric_limits<float>::quiet_NaN()) == 0x7);
  CHECK(thinkv::encode_e2m1(-0.0f) == 0x8);
  CHECK(thinkv::encode_e2m1(-0.1f) == 0x8);
  std::mt19937_64 rng(test_seed() + 1);
  int mismatches = 0;
  for (int i = 0; i < 200000; ++i) {
    const float x = random_float(rng, -4, 4);
    if (thinkv::encode_e2m1(x) != nearest_code(e2m1_values(), x, 0x8)) ++mismatches;
  }
  CHECK(mismatches == 0);
}

// ==== Branch-free encoders against their branchy definitions ==================================

namespace {

/// encode_e4m3 as first written (branches per range): the definition the branch-free encoder
/// must reproduce for every float.
std::uint8_t branchy_encode_e4m3(float x) {
  const std::uint32_t u = float_to_bits(x);
  const std::uint32_t a = u & thinkv::kFloatAbsMask;
  if (a > thinkv::kFloatInfBits) return thinkv::kE4M3NanCode;
  const auto sign = static_cast<std::uint8_t>((u >> 24) & 0x80u);
  if (a == thinkv::kFloatInfBits) return static_cast<std::uint8_t>(sign | thinkv::kE4M3MaxCode);
  const std::uint32_t fe = a >> 23;
  if (fe >= 121u) {
    const std::uint32_t code = thinkv::shift_right_round_even(a, 20) - ((127u - 7u) << 3);
    return static_cast<std::uint8_t>(sign | (code > thinkv::kE4M3MaxCode ? thinkv::kE4M3MaxCode : code));
  }
  if (fe == 0u) return sign;
  const std::uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
  return static_cast<std::uint8_t>(sign | thinkv::shift_right_round_even(m, 141 - static_cast<int>(fe)));
}

/// encode_e2m1 as first written (branches per range).
std::uint8_t branchy_encode_e2m1(float x) {
  const std::uint32_t u = float_to_bits(x);
  const std::uint32_t a = u & thinkv::kFloatAbsMask;
  if (a > thinkv::kFloatInfBits) return thinkv::kE2M1MaxCode;
  const auto sign = static_cast<std::uint8_t>((u >> 28) & 0x8u);
  const std::uint32_t fe = a >> 23;
  if (fe >= 127u) {
    const std::uint32_t code = thinkv::shift_right_round_even(a, 22) - ((127u - 1u) << 1);
    return static_cast<std::uint8_t>(sign | (code > thinkv::kE2M1MaxCode ? thinkv::kE2M1MaxCode : code));
  }
  if (fe == 0u) return sign;
  const std::uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
  return static_cast<std::uint8_t>(sign | thinkv::shift_right_round_even(m, 149 - static_cast<int>(fe)));
}

/// Floats whose bits are `stride`-spaced from `offset`, plus every float whose low 12 mantissa
/// bits are one of the rounding-boundary patterns (0, 1, 0x7FF, 0x800, 0x801, 0xFFF) with all
/// other bits enumerated: every exponent, sign and tie of both encoders. Returns mismatches.
std::uint64_t compare_encoders(std::uint64_t stride, std::uint64_t offset) {
  std::uint64_t bad = 0;
  auto check = [&](std::uint32_t bits) {
    const float x = thinkv::bits_to_float(bits);
    if (thinkv::encode_e4m3(x) != branchy_encode_e4m3(x)) ++bad;
    if (thinkv::encode_e2m1(x) != branchy_encode_e2m1(x)) ++bad;
  };
  for (std::uint64_t b = offset; b <= 0xFFFFFFFFull; b += stride) check(static_cast<std::uint32_t>(b));
  for (std::uint32_t hi = 0; hi < (1u << 20); ++hi) {
    for (std::uint32_t lo : {0x000u, 0x001u, 0x7FFu, 0x800u, 0x801u, 0xFFFu}) check((hi << 12) | lo);
  }
  return bad;
}

}  // namespace

TEST_CASE("branch-free E4M3 and E2M1 encoders equal their branchy definitions", "[formats][encode]") {
  // Sampled: 1 float in 4099 (a random offset per run) and all rounding-boundary patterns. The
  // [.exhaustive] case below checks all 2^32 floats.
  THINKV_SEED_INFO();
  std::mt19937_64 rng(test_seed() + 12);
  CHECK(compare_encoders(4099, rng() % 4099) == 0);
}

TEST_CASE("branch-free encoders: every float", "[.exhaustive][formats][encode]") { CHECK(compare_encoders(1, 0) == 0); }

// ==== BF16 =======================================================================================

TEST_CASE("BF16 encode/decode", "[formats][bf16]") {
  THINKV_SEED_INFO();
  const auto inf = std::numeric_limits<float>::infinity();
  CHECK(thinkv::encode_bf16(inf) == 0x7F80);
  CHECK(thinkv::encode_bf16(-inf) == 0xFF80);
  CHECK(thinkv::encode_bf16(std::numeric_limits<float>::max()) == 0x7F80);  // overflows to Inf
  CHECK(thinkv::encode_bf16(-0.0f) == 0x8000);
  CHECK(thinkv::encode_bf16(std::numeric_limits<float>::quiet_NaN()) == 0x7FFF);
  CHECK(thinkv::encode_bf16(-std::numeric_limits<float>::quiet_NaN()) == 0x7FFF);
  CHECK(thinkv::encode_bf16(bits_to_float(0x7F800001u)) == 0x7FFF);
  CHECK(thinkv::encode_bf16(bits_to_float(0x3F808000u)) == 0x3F80);  // tie, even stays
  CHECK(thinkv::encode_bf16(bits_to_float(0x3F818000u)) == 0x3F82);  // tie, odd rounds up
  CHECK(thinkv::encode_bf16(bits_to_float(0x00008000u)) == 0x0000);  // subnormal tie, not flushed
  CHECK(thinkv::encode_bf16(bits_to_float(0x00018000u)) == 0x0002);
  std::mt19937_64 rng(test_seed() + 2);
  int mismatches = 0;
  for (int i = 0; i < 200000; ++i) {
    const auto u = static_cast<std::uint32_t>(rng());
    const float x = bits_to_float(u);
    if (!thinkv::is_finite_float(x)) continue;
    if (thinkv::encode_bf16(x) != reference_bf16(x)) ++mismatches;
  }
  CHECK(mismatches == 0);
  for (std::uint32_t h = 0; h < 65536u; ++h) {
    const float f = thinkv::decode_bf16(static_cast<std::uint16_t>(h));
    if (std::isnan(f)) continue;
    if (thinkv::encode_bf16(f) != h) ++mismatches;  // decode is exact, so it round-trips
  }
  CHECK(mismatches == 0);
}

// ==== packing ====================================================================================

TEST_CASE("packing: little-end-first bit layout and round trip", "[formats][packing]") {
  THINKV_SEED_INFO();
  SECTION("documented layouts") {
    std::uint8_t row[4] = {};
    thinkv::store_code(Precision::kNvfp4, row, 0, 0x3);
    thinkv::store_code(Precision::kNvfp4, row, 1, 0xA);
    thinkv::store_code(Precision::kNvfp4, row, 2, 0xF);
    CHECK(row[0] == 0xA3);
    CHECK(row[1] == 0x0F);
    std::uint8_t t[2] = {};
    thinkv::store_code(Precision::kTernary, t, 0, thinkv::kTernaryPlus);
    thinkv::store_code(Precision::kTernary, t, 1, thinkv::kTernaryMinus);
    thinkv::store_code(Precision::kTernary, t, 3, thinkv::kTernaryPlus);
    thinkv::store_code(Precision::kTernary, t, 5, thinkv::kTernaryMinus);
    CHECK(t[0] == 0x4D);  // 01 | 11<<2 | 00<<4 | 01<<6
    CHECK(t[1] == 0x0C);
    std::uint8_t f[2] = {};
    thinkv::store_code(Precision::kFp8E4M3, f, 1, 0xFE);
    CHECK(f[0] == 0x00);
    CHECK(f[1] == 0xFE);
    thinkv::store_code(Precision::kNvfp4, row, 1, 0x1F);  // only the low 4 bits are stored
    CHECK(row[0] == 0xF3);
    CHECK(thinkv::load_code(Precision::kBf16, row, 0) == 0);
  }
  SECTION("random rows round-trip and preserve neighbours") {
    std::mt19937_64 rng(test_seed() + 3);
    for (Precision p : kQuantized) {
      const int bits = thinkv::bits_of(p);
      for (int trial = 0; trial < 200; ++trial) {
        const int n = 1 + static_cast<int>(rng() % 64);
        std::vector<std::uint8_t> row(static_cast<std::size_t>(thinkv::packed_row_bytes(p, n)) + 1, 0xA5);
        std::vector<std::uint8_t> want(static_cast<std::size_t>(n));
        for (int i = 0; i < n; ++i) {
          want[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(rng() & ((1u << bits) - 1u));
          thinkv::store_code(p, row.data(), i, want[static_cast<std::size_t>(i)]);
        }
        for (int i = 0; i < n; ++i) {
          REQUIRE(thinkv::load_code(p, row.data(), i) == want[static_cast<std::size_t>(i)]);
        }
        CHECK(row.back() == 0xA5);  // nothing written past packed_row_bytes
        const int idx = static_cast<int>(rng() % static_cast<std::uint64_t>(n));
        thinkv::store_code(p, row.data(), idx, 0);
        for (int i = 0; i < n; ++i) {
          REQUIRE(thinkv::load_code(p, row.data(), i) == (i == idx ? 0 : want[static_cast<std::size_t>(i)]));
        }
      }
    }
  }
}

// ==== scales =====================================================================================

TEST_CASE("choose_stream_scale: power of two with d in 8..16", "[formats][scale]") {
  THINKV_SEED_INFO();
  for (Precision p : kQuantized) {
    INFO("precision " << p);
    CHECK(thinkv::choose_stream_scale(p, 0.0f) == 1.0f);
    CHECK(thinkv::choose_stream_scale(p, 1e-40f) == 1.0f);  // float subnormal
    CHECK(thinkv::choose_stream_scale(p, std::numeric_limits<float>::quiet_NaN()) == 1.0f);
    CHECK(thinkv::choose_stream_scale(p, std::numeric_limits<float>::infinity()) == 1.0f);
  }
  CHECK(thinkv::choose_stream_scale(Precision::kBf16, 3.0f) == 1.0f);
  CHECK(thinkv::choose_stream_scale(Precision::kFp8E4M3, 448.0f * 8.0f) == 1.0f);
  CHECK(thinkv::choose_stream_scale(Precision::kFp8E4M3, std::nextafter(448.0f * 8.0f, 0.0f)) == 0.5f);
  CHECK(thinkv::choose_stream_scale(Precision::kTernary, 16.0f) == 2.0f);
  std::mt19937_64 rng(test_seed() + 4);
  for (Precision p : kQuantized) {
    const float q = thinkv::quant_max(p);
    for (int i = 0; i < 20000; ++i) {
      const float amax = std::fabs(random_float(rng, -100, 100));
      const float s2 = thinkv::choose_stream_scale(p, amax);
      INFO("precision " << p << " amax " << amax << " s2 " << s2);
      int e = 0;
      REQUIRE(std::frexp(s2, &e) == 0.5f);  // a power of two
      const float d = amax / (q * s2);
      REQUIRE(d >= 8.0f);
      REQUIRE(d < 16.0f);
      REQUIRE_FALSE(thinkv::group_scale_saturates(p, amax * 28.0f, s2));  // >= 28x headroom
    }
  }
}

TEST_CASE("quantize_group: rules, strides, edge cases", "[formats][group]") {
  THINKV_SEED_INFO();
  std::uint8_t codes[2 * thinkv::kMaxGroupSize];
  SECTION("all-zero groups: scale code 0, codes +0") {
    const float zeros[16] = {};
    for (Precision p : kQuantized) {
      std::fill(std::begin(codes), std::end(codes), 0xEE);
      CHECK(thinkv::quantize_group(p, zeros, 1, 16, 1.0f, codes, 1) == 0);
      for (int i = 0; i < 16; ++i) CHECK(codes[i] == 0);
      CHECK(codes[16] == 0xEE);
      CHECK(thinkv::dequantize(p, 0, 0, 1.0f) == 0.0f);
    }
  }
  SECTION("kBf16 and out-of-range n write nothing and return 0") {
    const float x[thinkv::kMaxGroupSize + 1] = {1.0f, 2.0f};
    for (Precision p : thinkv::kAllPrecisions) {
      std::fill(std::begin(codes), std::end(codes), 0xEE);
      if (p == Precision::kBf16) CHECK(thinkv::quantize_group(p, x, 1, 2, 1.0f, codes, 1) == 0);
      CHECK(thinkv::quantize_group(p, x, 1, 0, 1.0f, codes, 1) == 0);
      CHECK(thinkv::quantize_group(p, x, 1, thinkv::kMaxGroupSize + 1, 1.0f, codes, 1) == 0);
      CHECK(codes[0] == 0xEE);
    }
    CHECK(thinkv::dequantize(Precision::kBf16, 0x12, 0x38, 1.0f) == 0.0f);
  }
  SECTION("tiny group against a large stream scale: scale code rounds up, never 0") {
    const float x[4] = {1e-6f, -2e-6f, 0.0f, 5e-7f};
    for (Precision p : {Precision::kFp8E4M3, Precision::kNvfp4}) {
      const std::uint8_t sc = thinkv::quantize_group(p, x, 1, 4, 1.0f, codes, 1);
      CHECK(sc == 0x01);  // d << 2^-9
    }
  }
  SECTION("ternary 0b10 decodes as 0; ternary ties go to 0") {
    CHECK(thinkv::decode_element(Precision::kTernary, 0x2) == 0.0f);
    const float x[2] = {1.0f, 0.5f};  // k=1: S^2/1 = 1; k=2: 2.25/2 = 1.125 -> alpha 0.75
    const std::uint8_t sc = thinkv::quantize_group(Precision::kTernary, x, 1, 2, 1.0f, codes, 1);
    CHECK(thinkv::decode_e4m3(sc) == 0.75f);
    CHECK(codes[0] == thinkv::kTernaryPlus);
    CHECK(codes[1] == thinkv::kTernaryPlus);
    const float y[2] = {1.0f, -0.25f};  // alpha 1 (k=1); |-0.25| <= 0.5 -> 0
    const std::uint8_t sy = thinkv::quantize_group(Precision::kTernary, y, 1, 2, 1.0f, codes, 1);
    CHECK(thinkv::decode_e4m3(sy) == 1.0f);
    CHECK(codes[1] == thinkv::kTernaryZero);
    const float z[2] = {-1.0f, 0.5f};  // |0.5| == 0.5 * a exactly: tie goes to 0
    const std::uint8_t sz = thinkv::quantize_group(Precision::kTernary, z, 1, 2, 1.0f, codes, 1);
    CHECK(thinkv::decode_e4m3(sz) == 0.75f);  // k=2 wins: (1.5)^2/2 = 1.125 > 1
    CHECK(codes[0] == thinkv::kTernaryMinus);
    CHECK(codes[1] == thinkv::kTernaryPlus);  // 0.5 > 0.375
    // Exact score tie between k = 1 (9/1) and k = 4 (36/4): the first maximum (k = 1) wins.
    const float t[4] = {1.0f, -3.0f, 1.0f, 1.0f};
    CHECK(thinkv::ternary_optimal_scale(t, 1, 4) == 3.0f);
    const std::uint8_t st = thinkv::quantize_group(Precision::kTernary, t, 1, 4, 1.0f, codes, 1);
    CHECK(thinkv::decode_e4m3(st) == 3.0f);
    CHECK(codes[0] == thinkv::kTernaryZero);
    CHECK(codes[1] == thinkv::kTernaryMinus);
    // alpha = 5.2 (k = 8) rounds down to a = 5, so the ninth element, 2.5, sits exactly on a / 2
    // (outside the optimal support since 2.5 < 5.2 * (sqrt(72) - 8)): the tie goes to 0.
    float w[9];
    for (float& v : w) v = 5.2f;
    w[8] = -2.5f;
    const std::uint8_t sw = thinkv::quantize_group(Precision::kTernary, w, 1, 9, 1.0f, codes, 1);
    CHECK(thinkv::decode_e4m3(sw) == 5.0f);
    CHECK(codes[0] == thinkv::kTernaryPlus);
    CHECK(codes[8] == thinkv::kTernaryZero);
  }
  SECTION("element codes use x / S (IEEE division): exact ties round to even") {
    // S = 1.875 (code 0x3F): x / S lands exactly on midpoints, where x * (1 / S) would land one
    // ulp above them and round the other way.
    const float x[4] = {11.25f, 1.25f * 1.875f, -2.5f * 1.875f, 5.0f * 1.875f};
    CHECK(thinkv::quantize_group(Precision::kNvfp4, x, 1, 4, 1.0f, codes, 1) == 0x3F);
    CHECK(codes[0] == 0x7);
    CHECK(codes[1] == 0x2);  // 1.25 -> 1
    CHECK(codes[2] == 0xC);  // -2.5 -> -2
    CHECK(codes[3] == 0x6);  // 5 -> 4
    const float y[2] = {448.0f * 1.875f, -1.3125f * 1.875f};
    CHECK(thinkv::quantize_group(Precision::kFp8E4M3, y, 1, 2, 1.0f, codes, 1) == 0x3F);
    CHECK(codes[0] == 0x7E);
    CHECK(codes[1] == 0xBA);  // -1.3125 -> -1.25
  }
  SECTION("strides: same codes as a contiguous copy, for every n in 1..64") {
    std::mt19937_64 rng(test_seed() + 5);
    std::normal_distribution<float> normal;
    for (Precision p : kQuantized) {
      for (int n = 1; n <= thinkv::kMaxGroupSize; ++n) {
        float strided[3 * thinkv::kMaxGroupSize];
        float dense[thinkv::kMaxGroupSize];
        for (int i = 0; i < n; ++i) dense[i] = strided[3 * i] = normal(rng);
        std::uint8_t c1[thinkv::kMaxGroupSize];
        const float s2 = thinkv::choose_stream_scale(p, 3.0f);
        const std::uint8_t a = thinkv::quantize_group(p, dense, 1, n, s2, c1, 1);
        const std::uint8_t b = thinkv::quantize_group(p, strided, 3, n, s2, codes, 2);
        REQUIRE(a == b);
        for (int i = 0; i < n; ++i) REQUIRE(c1[i] == codes[2 * i]);
        quantize_and_check(p, dense, n, s2);
      }
    }
  }
  SECTION("saturation: groups beyond the headroom are flagged and clipped at scale 448") {
    const float s2 = thinkv::choose_stream_scale(Precision::kNvfp4, 1.0f);  // 2^-6
    float x[16];
    for (int i = 0; i < 16; ++i) x[i] = static_cast<float>(i) - 7.5f;
    x[3] = 1000.0f;
    CHECK(thinkv::group_scale_saturates(Precision::kNvfp4, 1000.0f, s2));
    CHECK(thinkv::quantize_group(Precision::kNvfp4, x, 1, 16, s2, codes, 1) == 0x7E);
    CHECK(codes[3] == 0x7);  // clipped to 6 * 448 * s2 = 42
    CHECK(thinkv::dequantize(Precision::kNvfp4, codes[3], 0x7E, s2) == 42.0f);
    CHECK_FALSE(thinkv::group_scale_saturates(Precision::kNvfp4, 42.0f, s2));
    CHECK(thinkv::group_scale_saturates(Precision::kNvfp4, std::nextafter(42.0f, 100.0f), s2));
  }
}

TEST_CASE("ternary scale is the L2 optimum", "[formats][ternary]") {
  THINKV_SEED_INFO();
  std::mt19937_64 rng(test_seed() + 6);
  double twn_nmse = 0.0;
  double ours_nmse = 0.0;
  int groups = 0;
  for (Dist d : kDists) {
    for (int trial = 0; trial < 1500; ++trial) {
      const int n = 1 + static_cast<int>(rng() % thinkv::kMaxGroupSize);
      float x[thinkv::kMaxGroupSize];
      draw_group(rng, d, 1.0f, n, x);
      // Brute force in double: every support size k of the k largest |x|.
      std::vector<double> mags(static_cast<std::size_t>(n));
      double energy = 0.0;
      for (int i = 0; i < n; ++i) {
        mags[static_cast<std::size_t>(i)] = std::fabs(static_cast<double>(x[i]));
        energy += static_cast<double>(x[i]) * x[i];
      }
      std::sort(mags.rbegin(), mags.rend());
      double best_sse = energy;
      double best_alpha = 0.0;
      int best_k = 0;
      double sum = 0.0;
      for (int k = 1; k <= n; ++k) {
        sum += mags[static_cast<std::size_t>(k - 1)];
        const double sse = energy - sum * sum / k;
        if (sse < best_sse) {
          best_sse = sse;
          best_alpha = sum / k;
          best_k = k;
        }
      }
      // Our alpha (float sums) may pick another support size than the double brute force when
      // two are within float rounding of each other, so compare the errors they achieve: with
      // scale alpha and the nearest-of-{-alpha, 0, +alpha} rule (the optimal assignment for a fixed
      // scale), the error must be the optimum.
      const float alpha = thinkv::ternary_optimal_scale(x, 1, n);
      INFO(dist_name(d) << " n " << n << " alpha " << alpha << " brute force " << best_alpha << " k " << best_k);
      const auto sse_at = [&](double scale) {
        double e2 = 0.0;
        for (double m : mags) {
          const double e = m > 0.5 * scale ? m - scale : m;
          e2 += e * e;
        }
        return e2;
      };
      REQUIRE(sse_at(alpha) <= best_sse + 1e-6 * energy);
      REQUIRE(alpha <= mags[0]);
      REQUIRE(alpha >= mags[0] / std::sqrt(static_cast<double>(n)) * (1 - 1e-6));
      // With the E4M3-rounded scale a, quantize_group's codes give the best error any assignment
      // can reach with that scale: min over supports (k largest) of energy - S^2/k + k (a - S/k)^2.
      std::uint8_t codes[thinkv::kMaxGroupSize];
      const float s2 = thinkv::choose_stream_scale(Precision::kTernary, thinkv::group_amax(x, 1, n));
      const std::uint8_t sc = thinkv::quantize_group(Precision::kTernary, x, 1, n, s2, codes, 1);
      const double a = static_cast<double>(thinkv::decode_e4m3(sc)) * s2;
      double sse = 0.0;
      for (int i = 0; i < n; ++i) {
        const double e = thinkv::dequantize(Precision::kTernary, codes[i], sc, s2) - static_cast<double>(x[i]);
        sse += e * e;
      }
      double best_with_a = energy;
      sum = 0.0;
      for (int k = 1; k <= n; ++k) {
        sum += mags[static_cast<std::size_t>(k - 1)];
        best_with_a = std::min(best_with_a, energy - sum * sum / k + k * (a - sum / k) * (a - sum / k));
      }
      REQUIRE(sse <= best_with_a + 1e-9 * energy);
      REQUIRE(std::fabs(sse - sse_at(a)) <= 1e-9 * energy);
      // TWN heuristic: threshold 0.7 * mean|x|, scale = mean |x| over the support.
      double mean_abs = 0.0;
      for (double m : mags) mean_abs += m;
      mean_abs /= n;
      double sup_sum = 0.0;
      int sup_n = 0;
      for (double m : mags) {
        if (m > 0.7 * mean_abs) {
          sup_sum += m;
          ++sup_n;
        }
      }
      const double twn_alpha = sup_n > 0 ? sup_sum / sup_n : 0.0;
      double twn_sse = 0.0;
      for (double m : mags) {
        const double e = m > 0.7 * mean_abs ? m - twn_alpha : m;
        twn_sse += e * e;
      }
      REQUIRE(best_sse <= twn_sse + 1e-9 * energy);  // best_sse carries cancellation error
      if (energy > 0.0) {
        twn_nmse += twn_sse / energy;
        ours_nmse += sse / energy;
        ++groups;
      }
    }
  }
  INFO("mean NMSE over all groups: ours " << ours_nmse / groups << " TWN " << twn_nmse / groups);
  CHECK(ours_nmse < twn_nmse);
}

namespace {
/// The sorting network on |x| (N elements) then ternary_scale_of_sorted, as the quantize-append
/// kernel computes the ternary scale.
template <int N>
float network_ternary_scale(const float* x) {
  float v[N];
  for (int i = 0; i < N; ++i) v[i] = std::fabs(x[i]);
  thinkv::sort_descending_network(v);
  for (int i = 1; i < N; ++i) REQUIRE(v[i - 1] >= v[i]);
  return thinkv::ternary_scale_of_sorted(v, N);
}
}  // namespace

TEST_CASE("the kernel's pieces of quantize_group give its results bit for bit", "[formats][group]") {
  // The quantize-append kernel does not call quantize_group: it sorts with a network, computes
  // the scale once per group and codes the elements one at a time (fp_group_scale_code,
  // fp_element_code, ternary_element_code). Those pieces must give quantize_group's bits, also
  // on ties, zeros and repeated values.
  THINKV_SEED_INFO();
  std::mt19937_64 rng(test_seed() + 11);
  int checked = 0;
  for (Dist d : kDists) {
    for (int trial = 0; trial < 3000; ++trial) {
      float x[32];
      const int n = trial % 3 == 0 ? 8 : trial % 3 == 1 ? 16 : 32;
      draw_group(rng, d, 1.0f, n, x);
      if (trial % 5 == 1) {  // ties and zeros: a few values repeated, some zeroed, signs mixed
        for (int i = 0; i < n; ++i) {
          if (rng() % 3 == 0) x[i] = x[rng() % static_cast<unsigned>(n)];
          if (rng() % 7 == 0) x[i] = 0.0f;
          if (rng() % 2 == 0) x[i] = -x[i];
        }
      }
      if (trial % 97 == 3) {
        for (int i = 0; i < n; ++i) x[i] = 0.0f;
      }
      const float want = thinkv::ternary_optimal_scale(x, 1, n);
      const float got = n == 8    ? network_ternary_scale<8>(x)
                        : n == 16 ? network_ternary_scale<16>(x)
                                  : network_ternary_scale<32>(x);
      INFO(dist_name(d) << " trial " << trial << " n " << n);
      REQUIRE(float_to_bits(got) == float_to_bits(want));
      for (Precision p : {Precision::kFp8E4M3, Precision::kNvfp4, Precision::kTernary}) {
        const float s2 = thinkv::choose_stream_scale(p, thinkv::group_amax(x, 1, n) * (trial % 4 == 0 ? 0.25f : 1.0f));
        std::uint8_t codes[32];
        const std::uint8_t scale = thinkv::quantize_group(p, x, 1, n, s2, codes, 1);
        const float amax = thinkv::group_amax(x, 1, n);
        std::uint8_t piece_scale = 0;
        if (p == Precision::kTernary) {
          piece_scale = thinkv::encode_e4m3(got / s2);
        } else if (amax != 0.0f) {
          piece_scale = thinkv::fp_group_scale_code(p, amax, s2);
        }
        REQUIRE(piece_scale == scale);
        const float use = thinkv::decode_e4m3(piece_scale) * s2;
        for (int i = 0; i < n; ++i) {
          std::uint8_t c = 0;
          if (p == Precision::kTernary) {
            c = thinkv::ternary_element_code(x[i], use);
          } else if (amax != 0.0f) {
            c = thinkv::fp_element_code(p, x[i], use);
          }
          REQUIRE(c == codes[i]);
        }
        ++checked;
      }
    }
  }
  CHECK(checked == 3 * 3000 * static_cast<int>(std::size(kDists)));
}

TEST_CASE("round-trip bounds and NMSE on random groups", "[formats][roundtrip]") {
  THINKV_SEED_INFO();
  WARN("test_formats random seed: " << test_seed() << " (THINKV_TEST_SEED pins it)");
  std::mt19937_64 rng(test_seed() + 7);
  for (Precision p : kQuantized) {
    for (Dist d : kDists) {
      // Same-scale streams at g = 16: per-element bounds + NMSE against the documented numbers.
      const Nmse same = run_streams(rng, p, d, 16, 1.0f, 250, 16);
      INFO(p << " " << dist_name(d) << " g=16 mean NMSE " << same.mean() << " over " << same.groups
             << " groups, saturated " << same.saturated);
      CHECK(same.mean() <= nmse_limit(p, d));
      // A heavy-tailed (Student-t, 3 dof) group can exceed a small first group by more than the
      // 28x headroom; Gaussian, Laplace and outlier streams essentially never do.
      if (d == Dist::kStudentT3) {
        CHECK(same.saturated <= same.groups / 100);
      } else {
        CHECK(same.saturated == 0);
      }
      // Other group sizes (bounds only), and later groups 100x / 10x smaller or 4x / 20x larger
      // than the first: bounds always (clipped elements of saturated groups excepted), NMSE for
      // relative scales up to 4x (at 20x heavy-tailed streams saturate often: docs/formats.md).
      for (int g : {8, 32}) {
        const Nmse other = run_streams(rng, p, d, g, 1.0f, 60, 8);
        CHECK(other.groups > 0);
      }
      for (float rel : {0.01f, 0.1f, 4.0f, 20.0f}) {
        const Nmse scaled = run_streams(rng, p, d, 16, rel, 60, 8);
        INFO("relative scale " << rel << " mean NMSE " << scaled.mean() << " saturated " << scaled.saturated);
        if (rel <= 4.0f) CHECK(scaled.mean() <= 2.0 * nmse_limit(p, d));
      }
    }
  }
}

TEST_CASE("report: NMSE table for docs/formats.md", "[.report]") {
  std::mt19937_64 rng(test_seed() + 8);
  std::printf("seed %llu; mean per-group NMSE over unsaturated groups (saturated/total)\n",
              static_cast<unsigned long long>(test_seed()));
  for (Precision p : kQuantized) {
    for (Dist d : kDists) {
      std::printf("%-8s %-22s", std::string(thinkv::to_string(p)).c_str(), dist_name(d));
      for (int g : {8, 16, 32}) {
        const Nmse r = run_streams(rng, p, d, g, 1.0f, 1000, 16);
        std::printf("  g=%d %.3g (%d)", g, r.mean(), r.saturated);
      }
      for (float rel : {0.01f, 0.1f, 4.0f, 20.0f}) {
        const Nmse r = run_streams(rng, p, d, 16, rel, 500, 16);
        std::printf("  rel%g %.3g (%d/%d)", static_cast<double>(rel), r.mean(), r.saturated, r.saturated + r.groups);
      }
      std::printf("\n");
    }
  }
  // Ternary: TWN heuristic (threshold 0.7 mean|x|, exact float scale) at g = 16.
  for (Dist d : kDists) {
    double twn = 0.0;
    double opt = 0.0;
    int groups = 0;
    float x[16];
    for (int t = 0; t < 16000; ++t) {
      draw_group(rng, d, 1.0f, 16, x);
      double mean_abs = 0.0;
      double energy = 0.0;
      for (float v : x) {
        mean_abs += std::fabs(v);
        energy += static_cast<double>(v) * v;
      }
      mean_abs /= 16;
      double sup = 0.0;
      int k = 0;
      for (float v : x) {
        if (std::fabs(v) > 0.7 * mean_abs) {
          sup += std::fabs(v);
          ++k;
        }
      }
      const double alpha = k > 0 ? sup / k : 0.0;
      double sse = 0.0;
      for (float v : x) {
        const double e = std::fabs(v) > 0.7 * mean_abs ? std::fabs(v) - alpha : std::fabs(v);
        sse += e * e;
      }
      twn += sse / energy;
      const double ours = thinkv::ternary_optimal_scale(x, 1, 16);
      double sse_ours = 0.0;
      for (float v : x) {
        const double e = std::fabs(v) > 0.5 * ours ? std::fabs(v) - ours : std::fabs(v);
        sse_ours += e * e;
      }
      opt += sse_ours / energy;
      ++groups;
    }
    std::printf("ternary g=16 %-22s TWN %.3g  L2-optimal (unrounded scale) %.3g\n", dist_name(d), twn / groups,
                opt / groups);
  }
}

TEST_CASE("FP16 bit placement of E4M3 and E2M1 codes is exact (the attention kernel's dequant)",
          "[formats][fp16_placement]") {
  // Every finite E4M3 code, alone and in both halves of a pair: value / 256, bit for bit.
  int checked = 0;
  for (unsigned lo = 0; lo < 256; ++lo) {
    for (unsigned hi = 0; hi < 256; ++hi) {
      if ((lo & 0x7F) == 0x7F || (hi & 0x7F) == 0x7F) continue;                        // NaN codes: never stored
      const std::uint32_t h = thinkv::e4m3x2_to_fp16x2(lo | (hi << 8) | 0xABCD0000u);  // upper bytes ignored
      const float flo = thinkv::decode_fp16(static_cast<std::uint16_t>(h & 0xFFFF));
      const float fhi = thinkv::decode_fp16(static_cast<std::uint16_t>(h >> 16));
      const float want_lo = thinkv::decode_e4m3(static_cast<std::uint8_t>(lo)) / thinkv::kE4M3Fp16Unscale;
      const float want_hi = thinkv::decode_e4m3(static_cast<std::uint8_t>(hi)) / thinkv::kE4M3Fp16Unscale;
      if (float_to_bits(flo) != float_to_bits(want_lo) || float_to_bits(fhi) != float_to_bits(want_hi)) {
        FAIL("E4M3 codes " << lo << ", " << hi << ": FP16 gives " << flo << ", " << fhi << ", want " << want_lo << ", "
                           << want_hi);
      }
      ++checked;
    }
  }
  CHECK(checked == 254 * 254);
  // Every pair of E2M1 codes: value / 16384, bit for bit (signed zeros included).
  for (unsigned lo = 0; lo < 16; ++lo) {
    for (unsigned hi = 0; hi < 16; ++hi) {
      const std::uint32_t h = thinkv::e2m1x2_to_fp16x2(lo | (hi << 4) | 0xFFFFFF00u);  // other nibbles ignored
      const float flo = thinkv::decode_fp16(static_cast<std::uint16_t>(h & 0xFFFF));
      const float fhi = thinkv::decode_fp16(static_cast<std::uint16_t>(h >> 16));
      CHECK(float_to_bits(flo) ==
            float_to_bits(thinkv::decode_e2m1(static_cast<std::uint8_t>(lo)) / thinkv::kE2M1Fp16Unscale));
      CHECK(float_to_bits(fhi) ==
            float_to_bits(thinkv::decode_e2m1(static_cast<std::uint8_t>(hi)) / thinkv::kE2M1Fp16Unscale));
    }
  }
  // decode_fp16 itself: a few hand-checked patterns (the oracle test compares all 65,536).
  CHECK(thinkv::decode_fp16(0x3C00) == 1.0f);
  CHECK(thinkv::decode_fp16(0xC000) == -2.0f);
  CHECK(thinkv::decode_fp16(0x0001) == 0x1p-24f);
  CHECK(thinkv::decode_fp16(0x7BFF) == 65504.0f);
  CHECK(std::isinf(thinkv::decode_fp16(0xFC00)));
  CHECK(std::isnan(thinkv::decode_fp16(0x7E00)));
  CHECK(std::signbit(thinkv::decode_fp16(0x8000)));
}

namespace {

/// x is exactly representable in IEEE binary16 (subnormals included): |x| <= 65504, a multiple of
/// 2^-24, and at most 11 significant bits.
bool fp16_exact(double x) {
  x = std::fabs(x);
  if (x == 0.0) return true;
  if (x > 65504.0) return false;
  const double q = std::ldexp(x, 24);  // in units of the smallest subnormal
  if (q != std::floor(q)) return false;
  int e = 0;
  (void)std::frexp(x, &e);                 // x = f * 2^e, f in [0.5, 1)
  const double m = std::ldexp(x, 11 - e);  // 11 significant bits: an integer
  return m == std::floor(m);
}

}  // namespace

TEST_CASE("FP16 products of the tensor-core attention pass are exact", "[formats][fp16_placement]") {
  // paged_attention_tc.cu multiplies, in FP16, a code pair (E2M1 value x 2^-14 by bit placement;
  // ternary +-2^-14 / 0 from a byte table; FP8 value) by its E4M3 group scale (FP8: scale
  // x 2^-4) and relies on every product being exact. Checked here for every code and every
  // positive finite scale code (scales are never negative or NaN).
  auto scale_codes = [] {
    std::vector<std::uint8_t> s;
    for (unsigned c = 0; c < 0x7F; ++c) s.push_back(static_cast<std::uint8_t>(c));
    return s;
  }();
  int checked = 0;
  for (std::uint8_t sc : scale_codes) {
    const double s = thinkv::decode_e4m3(sc);
    REQUIRE(fp16_exact(s));              // the hardware E4M3 -> FP16 conversion is exact
    REQUIRE(fp16_exact(s * 0x1p-4));     // FP8's scale x 2^-4
    for (unsigned c = 0; c < 16; ++c) {  // NVFP4: value x 2^-14 x scale
      const double v = thinkv::decode_e2m1(static_cast<std::uint8_t>(c));
      if (!fp16_exact(v * 0x1p-14 * s)) FAIL("E2M1 code " << c << " x scale code " << int{sc} << " not exact in FP16");
      ++checked;
    }
    for (unsigned c = 0; c < 4; ++c) {  // ternary: +-2^-14 / 0 x scale
      const double v = thinkv::decode_element(thinkv::Precision::kTernary, static_cast<std::uint8_t>(c));
      if (!fp16_exact(v * 0x1p-14 * s))
        FAIL("ternary code " << c << " x scale code " << int{sc} << " not exact in FP16");
      ++checked;
    }
    for (unsigned c = 0; c < 256; ++c) {  // FP8: value x (scale x 2^-4)
      if ((c & 0x7F) == 0x7F) continue;   // NaN codes: never stored
      const double v = thinkv::decode_e4m3(static_cast<std::uint8_t>(c));
      if (!fp16_exact(v * (s * 0x1p-4))) FAIL("E4M3 code " << c << " x scale code " << int{sc} << " not exact in FP16");
      ++checked;
    }
  }
  CHECK(checked == 127 * (16 + 4 + 254));
  // The factors are tight: FP8 with scale x 2^-1 overflows FP16 (448 x 448 / 2), with 2^-7 the
  // smallest products fall below FP16's subnormal spacing.
  CHECK_FALSE(fp16_exact(448.0 * 448.0 * 0x1p-1));
  CHECK_FALSE(fp16_exact(0x1p-9 * 0x1p-9 * 0x1p-7 * 3.0));
  // The kernel's ternary table: byte c, as the high byte of an FP16 (low byte 0), is code c x 2^-14
  // (signed zero included).
  for (unsigned c = 0; c < 4; ++c) {
    const unsigned high = (thinkv::kTernaryFp16HighBytes >> (8 * c)) & 0xFFu;
    const float f = thinkv::decode_fp16(static_cast<std::uint16_t>(high << 8));
    const float want = thinkv::decode_element(thinkv::Precision::kTernary, static_cast<std::uint8_t>(c)) * 0x1p-14f;
    CHECK(float_to_bits(f) == float_to_bits(want));
  }
}

TEST_CASE("E2M1 high-byte decode of the tensor-core pass matches the bit placement", "[formats][fp16_placement]") {
  // paged_attention_tc.cu decodes a word of 8 E2M1 codes into the FP16 high bytes of its even and
  // odd nibbles (e2m1_*_fp16_high_bytes), then permutes bytes into FP16 pairs with zero low
  // bytes. Every byte must be the high byte of e2m1x2_to_fp16x2's placement (low byte 0) and
  // decode to code x 2^-14; checked for every 16-bit pattern in both halves of the word, with
  // random other halves (neighbouring nibbles must not leak in).
  std::mt19937 rng(1234);
  long checked = 0;
  for (std::uint32_t p = 0; p < 0x10000u; ++p) {
    for (int half = 0; half < 2; ++half) {
      const std::uint32_t other = rng() & 0xFFFFu;
      const std::uint32_t w = half == 0 ? (p | (other << 16)) : ((p << 16) | other);
      const std::uint32_t even = thinkv::e2m1_even_fp16_high_bytes(w);
      const std::uint32_t odd = thinkv::e2m1_odd_fp16_high_bytes(w);
      for (int n = 0; n < 8; ++n) {
        const std::uint32_t code = (w >> (4 * n)) & 0xFu;
        const std::uint32_t high = ((n % 2 == 0 ? even : odd) >> (8 * (n / 2))) & 0xFFu;
        const std::uint32_t placed = thinkv::e2m1x2_to_fp16x2(code) & 0xFFFFu;  // low half: this code
        if ((high << 8) != placed) FAIL("word " << std::hex << w << " nibble " << n << ": byte " << high);
        const float f = thinkv::decode_fp16(static_cast<std::uint16_t>(high << 8));
        const float want = thinkv::decode_e2m1(static_cast<std::uint8_t>(code)) * 0x1p-14f;
        if (float_to_bits(f) != float_to_bits(want)) FAIL("nibble " << code << " decodes to " << f);
        ++checked;
      }
    }
  }
  CHECK(checked == 0x10000L * 2 * 8);
  // Negative control: a magnitude mask two bits too wide lets the neighbouring nibble in.
  const std::uint32_t w = 0x00000010u;  // nibble 1 = 0b0001, nibble 0 = 0
  CHECK((thinkv::e2m1_even_fp16_high_bytes(w) & 0xFFu) == 0u);
  CHECK((((w << 1) & 0x3E3E3E3Eu) & 0xFFu) != 0u);
}
