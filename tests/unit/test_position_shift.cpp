// Position shifts (llama.cpp's seq_add) over the compressed cache: ThinKvCache::shift_positions
// re-rotates the stored post-RoPE keys of the moved tokens. Checked against an independent float64
// RoPE written here from the rotation's definition (pair i of channels turns by position *
// theta^(-2i/n)): every stored key after a context shift is the single BF16 rounding of the old
// stored key turned by the shift, attention afterwards matches float64 attention over the keys
// rotated to their new positions (with the bound of two BF16 roundings), and every refusal the
// header documents changes nothing. The randomized cell-model runs of test_sequence_ops.cpp
// shift too.

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "../../examples/decoder/thinkv_spec.hpp"
#include "thinkv/seq/rope.hpp"
#include "thinkv/thinkv_cache.hpp"

#include "sequence_test_util.hpp"
#include "test_util.hpp"

using thinkv::RopeSpec;
using thinkv::RopeStyle;
using thinkv::Status;
using thinkv::StatusCode;
using thinkv::decoder::CacheMode;
using thinkv::decoder::ThinKvSpec;
using thinkv::decoder::with_cache;

namespace {

std::vector<double> to_double(const float* p, int n) { return std::vector<double>(p, p + n); }

/// A decoder's view of one sequence: per decoded token (in decode order) and layer the unrotated
/// key it computed ([num_kv_heads][head_dim], float64) and the value it handed the cache; `at`:
/// the token each held position holds now.
struct Tokens {
  std::vector<std::vector<std::vector<double>>> raw;
  std::vector<std::vector<std::vector<float>>> v;
  std::map<std::int32_t, int> at;
};

/// Decodes one token at the cache's next position with keys turned to that position.
template <class Cache>
void decode_rope(Cache& cache, int seq, Tokens& t, const RopeSpec& rope, std::mt19937_64& rng,
                 std::vector<std::vector<float>>* outs = nullptr, std::vector<std::vector<float>>* queries = nullptr) {
  const auto& c = cache.config();
  const int d = c.head_dim, hkv = c.num_kv_heads, hq = c.num_q_heads;
  const std::int32_t pos = cache.position(seq);
  REQUIRE(cache.begin_token(seq).is_ok());
  t.at[pos] = static_cast<int>(t.raw.size());
  auto& raws = t.raw.emplace_back();
  auto& vals = t.v.emplace_back();
  for (int l = 0; l < c.num_layers; ++l) {
    std::vector<double> raw(static_cast<std::size_t>(hkv * d));
    std::vector<float> k(static_cast<std::size_t>(hkv * d));
    const std::vector<float> r = tt::random_row(rng, hkv * d, 1.0, false);
    for (int h = 0; h < hkv; ++h) {
      const std::vector<double> x = to_double(r.data() + h * d, d);
      const std::vector<double> y = tt::rope64(x, pos, rope);
      for (int j = 0; j < d; ++j) {
        raw[static_cast<std::size_t>(h * d + j)] = x[static_cast<std::size_t>(j)];
        k[static_cast<std::size_t>(h * d + j)] = static_cast<float>(y[static_cast<std::size_t>(j)]);
      }
    }
    const std::vector<float> v = tt::random_row(rng, hkv * d, 1.0, false);
    std::vector<float> q = tt::random_row(rng, hq * d, 1.0, false), out(static_cast<std::size_t>(hq * d), NAN);
    REQUIRE(cache.append(seq, l, k, v).is_ok());
    REQUIRE(cache.attend(seq, l, q, out).is_ok());
    raws.push_back(raw);
    vals.push_back(v);
    if (outs != nullptr) outs->push_back(out);
    if (queries != nullptr) queries->push_back(q);
  }
  REQUIRE(cache.end_token(seq).is_ok());
}

/// The stored key of every live slot and staged row of (seq, layer, kv head), by position.
template <class Cache>
std::map<std::int32_t, std::vector<float>> stored_keys(const Cache& cache, int seq, int layer, int head) {
  const auto& table = cache.paged().table();
  const int d = cache.config().head_dim;
  const int st = cache.stream_of(seq, layer, head);
  std::map<std::int32_t, std::vector<float>> out;
  std::vector<float> k(static_cast<std::size_t>(d)), v(static_cast<std::size_t>(d));
  for (const thinkv::SlotRef r : table.live_slot_list(st)) {
    REQUIRE(cache.paged().backend().read_token(table.token_ref(r), k.data(), v.data()).is_ok());
    out[table.slot_position(r)] = k;
  }
  for (int row = 0; row < table.staged_count(st); ++row) {
    REQUIRE(cache.paged().backend().read_staged(st, row, k.data(), v.data()).is_ok());
    out[table.staged_position(st, row)] = k;
  }
  return out;
}

/// Attention of one new token of `seq` at every layer against float64 attention over the keys
/// each held position should have now (t.at: the unrotated key of the token there turned to the
/// position), values as BF16 stores them. Shifted keys went
/// through two BF16 roundings (at decode and after the rotation): each is within 2^-8 |k| of
/// exact, so each score moves by at most scale |q| 2^-8 |k| =: E' and the output by at most
/// max|v| (e^(2E') - 1), added to attention_error_bound's FP32 bound.
template <class Cache>
void check_attention(Cache& cache, int seq, Tokens& t, const RopeSpec& rope, std::mt19937_64& rng) {
  const auto& c = cache.config();
  const int d = c.head_dim, hkv = c.num_kv_heads, hq = c.num_q_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<std::vector<float>> outs, queries;
  const std::int32_t pos = cache.position(seq);
  decode_rope(cache, seq, t, rope, rng, &outs, &queries);
  for (int l = 0; l < c.num_layers; ++l) {
    for (int h = 0; h < hq; ++h) {
      const int kvh = h / (hq / hkv);
      const float* q = queries[static_cast<std::size_t>(l)].data() + h * d;
      std::vector<float> ks, vs;
      double qn = 0, kmax = 0, vmax = 0;
      for (int j = 0; j < d; ++j) qn += static_cast<double>(q[j]) * q[j];
      for (const auto& [p, id] : t.at) {
        const auto& raw = t.raw[static_cast<std::size_t>(id)][static_cast<std::size_t>(l)];
        const std::vector<double> y =
            tt::rope64(std::vector<double>(raw.begin() + kvh * d, raw.begin() + (kvh + 1) * d), p, rope);
        double kn = 0;
        for (int j = 0; j < d; ++j) {
          ks.push_back(static_cast<float>(y[static_cast<std::size_t>(j)]));
          kn += y[static_cast<std::size_t>(j)] * y[static_cast<std::size_t>(j)];
          const float vv = tt::bf16_round(
              t.v[static_cast<std::size_t>(id)][static_cast<std::size_t>(l)][static_cast<std::size_t>(kvh * d + j)]);
          vs.push_back(vv);
          vmax = std::max(vmax, static_cast<double>(std::fabs(vv)));
        }
        kmax = std::max(kmax, std::sqrt(kn));
      }
      const std::vector<double> ref = tt::attend64(q, ks, vs, d, scale);
      const double e = scale * std::sqrt(qn) * kmax * std::ldexp(1.0, -8) * 1.01;
      const double bound = tt::attention_error_bound(q, ks, vs, d, scale) + 2 * vmax * std::expm1(2 * e);
      for (int j = 0; j < d; ++j) {
        INFO("position " << pos << " layer " << l << " head " << h << " channel " << j << " bound " << bound);
        REQUIRE(std::fabs(outs[static_cast<std::size_t>(l)][static_cast<std::size_t>(h * d + j)] -
                          ref[static_cast<std::size_t>(j)]) <= bound);
      }
    }
  }
}

}  // namespace

TEST_CASE("RopeSpec: rotations match the definition, compose, and bad specs name the value", "[position_shift]") {
  auto rng = tt::make_rng("rope_spec");
  for (RopeStyle style : {RopeStyle::kAdjacentPairs, RopeStyle::kHalves}) {
    for (int n : {0, 8, 32}) {
      RopeSpec r;
      r.style = style;
      r.rotary_dims = n;
      r.theta = n == 8 ? 500000.0 : 10000.0;
      r.position_scale = n == 32 ? 0.25 : 1.0;
      REQUIRE(r.validate(32).is_ok());
      const std::vector<float> f = tt::random_row(rng, 32, 1.0, false);
      const std::vector<double> x(f.begin(), f.end());
      for (std::int64_t delta : {1, -1, 7, -64, 1000, 32767}) {
        INFO("style " << static_cast<int>(style) << " rotary_dims " << n << " delta " << delta);
        std::vector<double> y = x;
        r.rotate(y, delta);
        // Angles of |delta| radians carry ~|delta| 2^-52 of rounding: the tolerance grows with them.
        const double tol = 1e-14 * (8.0 + static_cast<double>(std::llabs(delta)));
        const std::vector<double> want = tt::rope64(x, static_cast<double>(delta), r);
        for (std::size_t j = 0; j < y.size(); ++j) REQUIRE(std::fabs(y[j] - want[j]) <= tol);
        if (n == 8) {  // channels past rotary_dims untouched
          for (std::size_t j = 8; j < y.size(); ++j) REQUIRE(y[j] == x[j]);
        }
        r.rotate(y, 5);  // composes: R(5) R(delta) = R(delta + 5)
        const std::vector<double> sum = tt::rope64(x, static_cast<double>(delta + 5), r);
        for (std::size_t j = 0; j < y.size(); ++j) REQUIRE(std::fabs(y[j] - sum[j]) <= 2 * tol);
      }
    }
  }
  RopeSpec bad;
  bad.theta = 1.0;
  CHECK(bad.validate(16).message().find("theta 1") != std::string::npos);
  bad = RopeSpec{};
  bad.rotary_dims = 7;
  CHECK(bad.validate(16).message().find("rotary_dims 7") != std::string::npos);
  bad.rotary_dims = 18;
  CHECK(bad.validate(16).code() == StatusCode::kInvalidArgument);
  bad = RopeSpec{};
  bad.position_scale = 0.0;
  CHECK(bad.validate(16).message().find("position_scale") != std::string::npos);
  bad = RopeSpec{};
  bad.theta = NAN;
  CHECK(bad.validate(16).code() == StatusCode::kInvalidArgument);
}

TEST_CASE("encode_bf16_from_double rounds once, to nearest even", "[position_shift][formats]") {
  auto rng = tt::make_rng("bf16_from_double");
  for (int i = 0; i < 200000; ++i) {
    const double mag = std::ldexp(1.0, tt::uniform_int(rng, -100, 100));
    double x = (tt::uniform01(rng) * 2 - 1) * mag;
    if (i % 4 == 1) {  // an exact tie between two BF16 values, or one double ulp off it
      const float b = tt::bf16_round(static_cast<float>(x));
      int e = 0;
      (void)std::frexp(static_cast<double>(b), &e);  // |b| in [2^(e-1), 2^e): BF16 steps of 2^(e-8)
      x = static_cast<double>(b) + std::copysign(std::ldexp(1.0, e - 9), static_cast<double>(b));
      if (i % 8 == 5) x = std::nextafter(x, 0.0);
      if (i % 16 == 9) x = std::nextafter(x, 2 * x);
    }
    INFO(x);
    const std::uint16_t h = thinkv::encode_bf16_from_double(x);
    REQUIRE(thinkv::decode_bf16(h) == tt::bf16_nearest(x));
    const float f = static_cast<float>(x);
    REQUIRE(thinkv::encode_bf16_from_double(static_cast<double>(f)) == thinkv::encode_bf16(f));
  }
  // Specials and the subnormal steps (2^-133).
  CHECK(thinkv::encode_bf16_from_double(0.0) == 0x0000);
  CHECK(thinkv::encode_bf16_from_double(-0.0) == 0x8000);
  CHECK(thinkv::encode_bf16_from_double(INFINITY) == 0x7F80);
  CHECK(thinkv::encode_bf16_from_double(-1e300) == 0xFF80);
  CHECK(thinkv::encode_bf16_from_double(NAN) == thinkv::kBf16CanonicalNan);
  CHECK(thinkv::encode_bf16_from_double(std::ldexp(1.5, -133)) == 0x0002);  // tie: to even
  CHECK(thinkv::encode_bf16_from_double(std::ldexp(2.5, -133)) == 0x0002);
  CHECK(thinkv::encode_bf16_from_double(std::ldexp(127.75, -133)) == 0x0080);  // up to the smallest normal
  CHECK(thinkv::encode_bf16_from_double(std::ldexp(1.0, -126)) == 0x0080);
}

TEST_CASE("Position shift: a context shift on BF16 pages re-rotates every moved key once and attends as float64",
          "[position_shift]") {
  // llama.cpp's context shift: seq_rm(keep, keep + n) then seq_add(keep + n, -1, -n). FullKV
  // (BF16 pages), 100 tokens, then n = 32 removed after the first 24 and the rest moved down.
  RopeSpec halves;
  halves.style = RopeStyle::kHalves;
  halves.rotary_dims = 8;
  halves.theta = 500000.0;
  for (const RopeSpec& rope : {RopeSpec{}, halves}) {
    INFO("style " << static_cast<int>(rope.style) << " rotary_dims " << rope.rotary_dims);
    const ThinKvSpec cfg = tt::sequence_spec(CacheMode::kFull);
    with_cache(cfg, [&](auto& cache) {
      auto rng = tt::make_rng("position_shift_context");
      Tokens t;
      for (int i = 0; i < 100; ++i) decode_rope(cache, 0, t, rope, rng);
      std::vector<std::map<std::int32_t, std::vector<float>>> before;
      for (int l = 0; l < cfg.num_layers; ++l) {
        for (int h = 0; h < cfg.num_kv_heads; ++h) before.push_back(stored_keys(cache, 0, l, h));
      }
      REQUIRE(cache.remove(0, 24, 56).is_ok());
      const Status s = cache.shift_positions(0, 56, -1, -32, rope);
      INFO(s);
      REQUIRE(s.is_ok());
      CHECK(cache.position(0) == 68);
      CHECK(cache.pos_max(0) == 67);
      CHECK(cache.pos_min(0) == 0);
      tt::check_segment_ranges(cache, 0);  // the segment of 32..63 kept 56..63, now 24..31: it starts at 24
      std::set<std::int32_t> want;
      for (std::int32_t p = 0; p < 68; ++p) want.insert(p);
      for (const auto& held : tt::held_positions(cache, 0)) REQUIRE(held == want);
      // Every key: untouched below 24; from 24 on, the old stored key (decoded at p + 32) turned
      // by -32 and rounded to BF16 once. 96..99 were staged: their rows moved too.
      int k = 0;
      for (int l = 0; l < cfg.num_layers; ++l) {
        for (int h = 0; h < cfg.num_kv_heads; ++h, ++k) {
          const auto now = stored_keys(cache, 0, l, h);
          REQUIRE(now.size() == 68);
          for (const auto& [p, key] : now) {
            INFO("layer " << l << " head " << h << " position " << p);
            const std::vector<float>& old = before[static_cast<std::size_t>(k)].at(p < 24 ? p : p + 32);
            if (p < 24) {
              REQUIRE(tt::same_bits(key, old));
              continue;
            }
            const std::vector<double> y = tt::rope64(std::vector<double>(old.begin(), old.end()), -32.0, rope);
            for (int j = 0; j < cfg.head_dim; ++j) {
              INFO("channel " << j);
              REQUIRE(tt::fbits(key[static_cast<std::size_t>(j)]) ==
                      tt::fbits(tt::bf16_nearest(y[static_cast<std::size_t>(j)])));
            }
          }
        }
      }
      // Decoding on at the new positions attends as float64 over keys turned to where they are now.
      std::map<std::int32_t, int> at;
      for (const auto& [p, id] : t.at) {
        if (p < 24) at[p] = id;
        if (p >= 56) at[p - 32] = id;
      }
      t.at = at;
      for (int i = 0; i < 40; ++i) check_attention(cache, 0, t, rope, rng);
      CHECK(cache.position(0) == 108);
      // The shifted sequence saves, loads into another slot and saves back the same bytes.
      std::vector<std::uint8_t> a, b;
      REQUIRE(cache.save_sequence(0, a).is_ok());
      REQUIRE(cache.load_sequence(1, a).is_ok());
      REQUIRE(cache.save_sequence(1, b).is_ok());
      CHECK(a == b);
    });
  }
}

TEST_CASE("Position shift: the open group shifts under TBQ, and what the storage cannot do is refused unchanged",
          "[position_shift]") {
  const ThinKvSpec cfg = tt::sequence_spec(CacheMode::kTbq);  // groups of 8, quantized pages
  const RopeSpec rope;
  with_cache(cfg, [&](auto& cache) {
    auto rng = tt::make_rng("position_shift_refusals");
    Tokens t0, t1;
    for (int i = 0; i < 50; ++i) decode_rope(cache, 0, t0, rope, rng);  // 0..47 quantized, 48 and 49 staged
    for (int i = 0; i < 20; ++i) decode_rope(cache, 1, t1, rope, rng);
    const auto before = tt::snapshot_cache(cache.paged());
    const auto segments = cache.segments(0);
    auto unchanged = [&](const Status& s, StatusCode code, const char* says) {
      INFO(s);
      CHECK(s.code() == code);
      CHECK(s.message().find(says) != std::string::npos);
      TT_REQUIRE_SAME_SNAPSHOT(before, tt::snapshot_cache(cache.paged()));
      REQUIRE(cache.position(0) == 50);
      REQUIRE(cache.position(1) == 20);
      REQUIRE(cache.segments(0) == segments);
    };
    unchanged(cache.shift_positions(0, 48, -1, 5, rope), StatusCode::kUnsupported, "shift by 0 or 8");
    unchanged(cache.shift_positions(0, 48, -1, -3, rope), StatusCode::kUnsupported, "shift by -8 or 0");
    unchanged(cache.shift_positions(0, 40, -1, 8, rope), StatusCode::kUnsupported, "nvfp4 page");
    unchanged(cache.shift_positions(0, 49, -1, 8, rope), StatusCode::kUnsupported, "1 of the 2 tokens");
    unchanged(cache.shift_positions(0, 48, 49, 8, rope), StatusCode::kUnsupported, "1 of the 2 tokens");
    unchanged(cache.shift_positions(0, 48, -1, -8, rope), StatusCode::kInvalidArgument, "keep their order");
    unchanged(cache.shift_positions(0, 48, -1, -56, rope), StatusCode::kUnsupported, "remove(0, 48, 104) first");
    unchanged(cache.shift_positions(0, 48, -1, 4000, rope), StatusCode::kOutOfRange, "max_tokens");
    RopeSpec bad;
    bad.rotary_dims = 3;
    unchanged(cache.shift_positions(0, 48, -1, 8, bad), StatusCode::kInvalidArgument, "rotary_dims 3");
    unchanged(cache.shift_positions(3, 0, -1, 8, rope), StatusCode::kOutOfRange, "sequence 3");
    REQUIRE(cache.begin_token(0).is_ok());  // an open token: nothing may change under it
    CHECK(cache.shift_positions(0, 48, -1, 8, rope).code() == StatusCode::kInvalidArgument);
    REQUIRE(cache.end_token(0).is_ok() == false);  // no layer appended: end_token refuses
    REQUIRE(cache.reset_sequence(0).is_ok());
    for (int i = 0; i < 50; ++i) decode_rope(cache, 0, t0, rope, rng);
    // Nothing to do: delta 0, an empty range, a range holding no token.
    const auto again = tt::snapshot_cache(cache.paged());
    REQUIRE(cache.shift_positions(0, 48, -1, 0, rope).is_ok());
    REQUIRE(cache.shift_positions(0, 30, 30, 8, rope).is_ok());
    REQUIRE(cache.shift_positions(0, 60, -1, 8, rope).is_ok());
    TT_REQUIRE_SAME_SNAPSHOT(again, tt::snapshot_cache(cache.paged()));
    // The open group alone moves: staged rows rotated once, the sequence continues at 58.
    const auto staged_before = stored_keys(cache, 0, 1, 1);
    REQUIRE(cache.shift_positions(0, 48, -1, 8, rope).is_ok());
    CHECK(cache.position(0) == 58);
    CHECK(cache.pos_max(0) == 57);
    const auto staged_after = stored_keys(cache, 0, 1, 1);
    REQUIRE(staged_after.size() == 50);
    for (std::int32_t p : {56, 57}) {
      const std::vector<float>& old = staged_before.at(p - 8);
      const std::vector<double> y = tt::rope64(std::vector<double>(old.begin(), old.end()), 8.0, rope);
      for (int j = 0; j < cfg.head_dim; ++j) {
        REQUIRE(tt::fbits(staged_after.at(p)[static_cast<std::size_t>(j)]) ==
                tt::fbits(tt::bf16_nearest(y[static_cast<std::size_t>(j)])));
      }
    }
    for (std::int32_t p = 0; p < 48; ++p) REQUIRE(tt::same_bits(staged_after.at(p), staged_before.at(p)));
    // The group fills at 63 and commits; the next group starts at 64, aligned.
    for (int i = 0; i < 7; ++i) decode_rope(cache, 0, t0, rope, rng);
    CHECK(cache.paged().table().staged_count(cache.stream_of(0, 0, 0)) == 1);
    for (const auto& held : tt::held_positions(cache, 0)) {
      CHECK(held.size() == 57);
      CHECK(held.count(55) == 0);
      CHECK(held.count(64) == 1);
    }
  });
}

TEST_CASE("Position shift: the pinned prefix neither moves nor takes moved tokens", "[position_shift]") {
  const ThinKvSpec cfg = tt::sequence_spec(CacheMode::kFull);
  const RopeSpec rope;
  with_cache(cfg, [&](auto& cache) {
    auto rng = tt::make_rng("position_shift_pinned");
    REQUIRE(cache.pin_prefix(0, 16).is_ok());
    Tokens t;
    for (int i = 0; i < 60; ++i) decode_rope(cache, 0, t, rope, rng);
    REQUIRE(cache.remove(0, 16, 32).is_ok());
    const auto before = tt::snapshot_cache(cache.paged());
    Status s = cache.shift_positions(0, 32, -1, -24, rope);  // 32 -> 8: into the prefix
    INFO(s);
    CHECK(s.code() == StatusCode::kUnsupported);
    CHECK(s.message().find("pinned prefix") != std::string::npos);
    s = cache.shift_positions(0, 8, 16, 8, rope);  // the prefix itself
    CHECK(s.code() == StatusCode::kUnsupported);
    TT_REQUIRE_SAME_SNAPSHOT(before, tt::snapshot_cache(cache.paged()));
    REQUIRE(cache.shift_positions(0, 32, -1, -16, rope).is_ok());  // 32 -> 16: just after it
    CHECK(cache.position(0) == 44);
    CHECK(cache.pos_min(0) == 0);
  });
}

TEST_CASE("Position shift: segment starts stay at or before their first token and after the tokens before them",
          "[position_shift]") {
  const ThinKvSpec cfg = tt::sequence_spec(CacheMode::kFull);  // segments of 32 positions
  const RopeSpec rope;
  with_cache(cfg, [&](auto& cache) {
    auto rng = tt::make_rng("position_shift_segments");
    Tokens t;
    for (int i = 0; i < 96; ++i) decode_rope(cache, 0, t, rope, rng);
    auto starts = [&] {
      std::vector<std::int32_t> out;
      for (const auto& seg : cache.segments(0)) out.push_back(seg.start);
      return out;
    };
    REQUIRE(starts() == std::vector<std::int32_t>{0, 32, 64});
    // Down: the segment of 32.. lost 32..39; moving 40.. down by 8 would put its start at 24,
    // before 31, which stays in the segment before: it starts at 32, its first token.
    REQUIRE(cache.remove(0, 32, 40).is_ok());
    REQUIRE(cache.shift_positions(0, 32, -1, -8, rope).is_ok());
    CHECK(starts() == std::vector<std::int32_t>{0, 32, 56});
    tt::check_segment_ranges(cache, 0);
    // Up: 40..47 of the second segment move past the third's start (56) into the gap 48..63
    // left by a removal: the third segment then starts after them, at its first token.
    REQUIRE(cache.remove(0, 48, 64).is_ok());
    REQUIRE(cache.shift_positions(0, 40, 48, 16, rope).is_ok());
    CHECK(starts() == std::vector<std::int32_t>{0, 32, 64});
    tt::check_segment_ranges(cache, 0);
    CHECK(cache.position(0) == 88);
  });
}
