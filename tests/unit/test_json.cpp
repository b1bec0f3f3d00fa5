/// \file test_json.cpp
/// thinkv/util/json.hpp: parsing (scalars, escapes, nesting, numbers), writing (shortest
/// round-trip digits, escapes, layout), malformed input reported with line:column, and no crash
/// on random or mutated input.

#include <catch2/catch.hpp>
#include <chrono>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "test_util.hpp"
#include "thinkv/util/json.hpp"

using namespace thinkv;
using Catch::Matchers::Contains;
using Catch::Matchers::StartsWith;
using json::Value;

namespace {

Value parse_ok(std::string_view text) {
  Value v;
  const Status s = json::parse(text, "t.json", v);
  INFO("input: " << text << "\nstatus: " << s);
  REQUIRE(s.is_ok());
  return v;
}

std::string parse_error(std::string_view text, const json::ParseOptions& opt = {}) {
  Value v = Value::string("unchanged");
  const Status s = json::parse(text, "t.json", v, opt);
  INFO("input: " << text);
  REQUIRE_FALSE(s.is_ok());
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(v == Value::string("unchanged"));  // out untouched on error
  return s.message();
}

/// A random JSON value of bounded depth.
Value random_value(std::mt19937_64& rng, int depth) {
  const int kind = tt::uniform_int(rng, 0, depth <= 0 ? 4 : 6);
  switch (kind) {
    case 0: return Value::null();
    case 1: return Value::boolean(tt::chance(rng, 0.5));
    case 2: {
      switch (tt::uniform_int(rng, 0, 3)) {
        case 0: return Value::integer(tt::uniform_int(rng, -1000000, 1000000));
        case 1: return Value::number_f(static_cast<float>(tt::uniform01(rng)));
        case 2: return Value::number(std::ldexp(tt::uniform01(rng) - 0.5, tt::uniform_int(rng, -300, 300)));
        default: return Value::number(tt::uniform01(rng) * 1e6);
      }
    }
    case 3:
    case 4: {
      std::string s;
      const int n = tt::uniform_int(rng, 0, 12);
      for (int i = 0; i < n; ++i) {
        const int c = tt::uniform_int(rng, 0, 9);
        if (c == 0)
          s += static_cast<char>(tt::uniform_int(rng, 1, 31));  // control characters
        else if (c == 1)
          s += "\"\\/";
        else if (c == 2)
          s += "\xC3\xA9\xF0\x9F\x98\x80";  // UTF-8
        else
          s += static_cast<char>(tt::uniform_int(rng, 0x20, 0x7E));
      }
      return Value::string(s);
    }
    case 5: {
      Value a = Value::array();
      const int n = tt::uniform_int(rng, 0, 5);
      for (int i = 0; i < n; ++i) a.push_back(random_value(rng, depth - 1));
      return a;
    }
    default: {
      Value o = Value::object();
      const int n = tt::uniform_int(rng, 0, 5);
      for (int i = 0; i < n; ++i) o.set("k" + std::to_string(i) + (i % 2 ? "\n\"" : ""), random_value(rng, depth - 1));
      return o;
    }
  }
}

/// Deep equality of an original value and its written-and-parsed copy: numbers made with
/// number_f are equal when they read back to the same float.
bool same(const Value& a, const Value& b) {
  if (a.type() != b.type()) return false;
  if (a.is_number() && a.is_single()) { return static_cast<float>(a.as_number()) == static_cast<float>(b.as_number()); }
  if (a.is_array()) {
    if (a.size() != b.size()) return false;
    for (std::size_t i = 0; i < a.size(); ++i)
      if (!same(a.as_array()[i], b.as_array()[i])) return false;
    return true;
  }
  if (a.is_object()) {
    if (a.size() != b.size()) return false;
    for (std::size_t i = 0; i < a.size(); ++i) {
      if (a.as_object()[i].first != b.as_object()[i].first) return false;
      if (!same(a.as_object()[i].second, b.as_object()[i].second)) return false;
    }
    return true;
  }
  return a == b;
}

}  // namespace

TEST_CASE("json: scalars and literals", "[json]") {
  CHECK(parse_ok("null").is_null());
  CHECK(parse_ok("true").as_bool());
  CHECK_FALSE(parse_ok("false").as_bool());
  CHECK(parse_ok("false").is_bool());
  CHECK(parse_ok(" \n\t 42 \r\n").as_number() == 42.0);
  CHECK(parse_ok("\"x\"").as_string() == "x");
  CHECK(parse_ok("\xEF\xBB\xBF{}").is_object());  // byte order mark
  // Wrong-type accessors are harmless.
  const Value n = parse_ok("1");
  CHECK(n.as_string().empty());
  CHECK(n.as_array().empty());
  CHECK(n.find("a") == nullptr);
  CHECK_FALSE(n.as_bool());
  CHECK(parse_ok("\"s\"").as_number() == 0.0);
}

TEST_CASE("json: numbers", "[json]") {
  CHECK(parse_ok("0").as_number() == 0.0);
  CHECK(std::signbit(parse_ok("-0").as_number()));
  CHECK(parse_ok("0.1").as_number() == 0.1);
  CHECK(parse_ok("-12.5e-1").as_number() == -1.25);
  CHECK(parse_ok("1E+2").as_number() == 100.0);
  CHECK(parse_ok("1e308").as_number() == 1e308);
  CHECK(parse_ok("5e-324").as_number() == 5e-324);
  CHECK(parse_ok("1e-400").as_number() == 0.0);  // below the double range: 0
  CHECK(parse_ok("123456789012345678901234567890").as_number() == 123456789012345678901234567890.0);
  CHECK(parse_ok("3").is_integer());
  CHECK_FALSE(parse_ok("3.5").is_integer());
  CHECK_THAT(parse_error("1e400"), Contains("t.json:1:1: number 1e400 is out of the range of a double"));
  CHECK_THAT(parse_error("-"), Contains("t.json:1:2: invalid number"));
  CHECK_THAT(parse_error("01"), Contains("t.json:1:1: invalid number: leading zeros"));
  CHECK_THAT(parse_error("1."), Contains("t.json:1:3: invalid number: expected a digit after '.'"));
  CHECK_THAT(parse_error(".5"), Contains("t.json:1:1: expected a JSON value, found '.'"));
  CHECK_THAT(parse_error("+1"), Contains("t.json:1:1: expected a JSON value, found '+'"));
  CHECK_THAT(parse_error("1e"), Contains("t.json:1:3: invalid number: expected a digit in the exponent"));
  CHECK_THAT(parse_error("NaN"), Contains("t.json:1:1: expected a JSON value, found 'N'"));
  CHECK_THAT(parse_error("Infinity"), Contains("t.json:1:1"));
  CHECK_THAT(parse_error("-Infinity"), Contains("t.json:1:2"));
}

TEST_CASE("json: string escapes", "[json]") {
  CHECK(parse_ok(R"("a\"b\\c\/d\b\f\n\r\t")").as_string() == "a\"b\\c/d\b\f\n\r\t");
  CHECK(parse_ok(R"("\u00e9")").as_string() == "\xC3\xA9");
  CHECK(parse_ok(R"("\u20AC")").as_string() == "\xE2\x82\xAC");
  CHECK(parse_ok(R"("\ud83d\ude00")").as_string() == "\xF0\x9F\x98\x80");
  CHECK(parse_ok(R"("\u0000x")").as_string() == std::string("\0x", 2));
  CHECK(parse_ok("\"caf\xC3\xA9\"").as_string() == "caf\xC3\xA9");  // raw UTF-8 passes through
  CHECK_THAT(parse_error(R"("\x")"), Contains("t.json:1:2: invalid escape '\\x'"));
  CHECK_THAT(parse_error(R"("\u12")"), Contains("t.json:1:2: invalid \\u escape: expected 4 hex digits"));
  CHECK_THAT(parse_error(R"("\u12G4")"), Contains("expected 4 hex digits"));
  CHECK_THAT(parse_error(R"("\ude00")"), Contains("unpaired low surrogate"));
  CHECK_THAT(parse_error(R"("\ud83d")"), Contains("high surrogate not followed by a low one"));
  CHECK_THAT(parse_error(R"("\ud83d\u0041")"), Contains("high surrogate not followed by a low one"));
  CHECK_THAT(parse_error("\"a\nb\""), Contains("t.json:1:3: control character byte 0x0a inside a string"));
  CHECK_THAT(parse_error("\"abc"), Contains("t.json:1:1: unterminated string"));
  CHECK_THAT(parse_error("\"abc\\"), Contains("unterminated string"));

  // The writer escapes what must be escaped and round-trips every byte string.
  std::string all;
  for (int c = 1; c < 256; ++c) all += static_cast<char>(c);
  const std::string text = json::write(Value::string(all));
  CHECK_THAT(text, Contains("\\u0001"));
  CHECK_THAT(text, Contains("\\n"));
  CHECK_THAT(text, Contains("\\\""));
  CHECK(parse_ok(text).as_string() == all);
}

TEST_CASE("json: nesting, order and depth limit", "[json]") {
  const Value v = parse_ok(R"({"b": [1, {"c": null}, []], "a": {}, "z": "s"})");
  REQUIRE(v.is_object());
  REQUIRE(v.size() == 3);
  CHECK(v.as_object()[0].first == "b");  // insertion order kept
  CHECK(v.as_object()[1].first == "a");
  const Value* b = v.find("b");
  REQUIRE(b != nullptr);
  REQUIRE(b->size() == 3);
  CHECK(b->as_array()[1].find("c")->is_null());
  CHECK(v.find("a")->is_object());
  CHECK(v.find("missing") == nullptr);

  json::ParseOptions opt;
  opt.max_depth = 5;
  Value out;
  CHECK(json::parse("[[[[[1]]]]]", "t.json", out, opt).is_ok());
  CHECK_THAT(parse_error("[[[[[[1]]]]]]", opt), Contains("t.json:1:6: nesting deeper than 5 levels"));
  // A nesting bomb is rejected, not a stack overflow.
  CHECK_THAT(parse_error(std::string(200000, '[')), Contains("nesting deeper than 64 levels"));
  CHECK_THAT(parse_error(std::string(100000, '{')), Contains("t.json:1:2: expected a string key"));
  CHECK_THAT(parse_error(R"({"a": 1, "a": 2})"), Contains("t.json:1:10: duplicate key \"a\""));
}

TEST_CASE("json: malformed input is reported with line:column", "[json]") {
  struct Case {
    const char* text;
    const char* where;
  };
  const Case cases[] = {
      {"", "t.json:1:1: expected a JSON value, found end of input"},
      {"   \n  ", "t.json:2:3: expected a JSON value, found end of input"},
      {"{\"a\": 1,\n  \"b\": ]}", "t.json:2:8: expected a JSON value, found ']'"},
      {"{\"a\": 1,}", "t.json:1:9: expected a string key in an object, found '}'"},
      {"[1, 2,]", "t.json:1:7: expected a JSON value, found ']'"},
      {"[1 2]", "t.json:1:4: expected ',' or ']' in an array, found '2'"},
      {"{\"a\" 1}", "t.json:1:6: expected ':' after an object key, found '1'"},
      {"{\"a\": 1", "t.json:1:8: expected ',' or '}' in an object, found end of input"},
      {"[1,\n2,\n3", "t.json:3:2: expected ',' or ']' in an array, found end of input"},
      {"{a: 1}", "t.json:1:2: expected a string key in an object, found 'a'"},
      {"tru", "t.json:1:1: invalid literal: expected 'true'"},
      {"nul", "t.json:1:1: invalid literal: expected 'null'"},
      {"{} x", "t.json:1:4: unexpected 'x' after the end of the JSON value"},
      {"1 2", "t.json:1:3: unexpected '2' after the end of the JSON value"},
      {"\x01", "t.json:1:1: expected a JSON value, found byte 0x01"},
      {"['a']", "t.json:1:2: expected a JSON value, found '''"},
      {"\r\n\r\n  @", "t.json:3:3: expected a JSON value, found '@'"},
  };
  for (const Case& c : cases) {
    INFO("input: " << c.text);
    CHECK_THAT(parse_error(c.text), StartsWith(c.where));
  }
}

TEST_CASE("json: writer output and round trip", "[json]") {
  CHECK(json::write(Value::number_f(0.1f)) == "0.1");
  CHECK(json::write(Value::number_f(0.41f)) == "0.41");
  CHECK(json::write(Value::number(0.1)) == "0.1");
  CHECK(json::write(Value::number(1.0 / 3.0)) == "0.3333333333333333");
  CHECK(json::write(Value::number(3.0)) == "3");
  CHECK(json::write(Value::integer(-17)) == "-17");
  CHECK(json::write(Value::number(1e300)) == "1e+300");
  CHECK(json::write(Value::number(std::nan(""))) == "null");
  CHECK(json::write(Value::number(HUGE_VAL)) == "null");
  CHECK(json::write(Value::array()) == "[]");
  CHECK(json::write(Value::object()) == "{}");
  Value o = Value::object();
  o.set("a", Value::integer(1));
  o.set("b", Value::array({Value::number_f(0.5f), Value::boolean(true)}));
  o.set("a", Value::integer(2));  // replaces
  CHECK(json::write(o) == "{\n  \"a\": 2,\n  \"b\": [0.5, true]\n}");
  CHECK(json::write(o, 0) == "{\"a\":2,\"b\":[0.5,true]}");

  // Every float reads back bit for bit through number_f.
  TT_SEEDED_RNG();
  for (int i = 0; i < 2000; ++i) {
    std::uint32_t bits = static_cast<std::uint32_t>(rng());
    float f;
    std::memcpy(&f, &bits, 4);
    if (!std::isfinite(f)) continue;
    const std::string t = json::write(Value::number_f(f));
    const float back = static_cast<float>(parse_ok(t).as_number());
    INFO(t);
    REQUIRE(std::memcmp(&back, &f, 4) == 0);
    const double d = std::ldexp(tt::uniform01(rng), tt::uniform_int(rng, -1000, 1000));
    REQUIRE(parse_ok(json::write(Value::number(d))).as_number() == d);
  }
  // Random documents round-trip, pretty and compact.
  for (int i = 0; i < 300; ++i) {
    const Value v = random_value(rng, 4);
    for (int indent : {2, 0}) {
      const std::string t = json::write(v, indent);
      INFO(t);
      REQUIRE(same(v, parse_ok(t)));
    }
  }
}

TEST_CASE("json: random and mutated input never crashes", "[json][fuzz]") {
  TT_SEEDED_RNG();
  const std::string alphabet = "{}[]\":,.-+eE0123456789 \n\\utrfalsn\x01\xff";
  std::vector<std::string> seeds;
  for (int i = 0; i < 20; ++i) seeds.push_back(json::write(random_value(rng, 4), i % 2 ? 2 : 0));
  int ok = 0;
  for (int i = 0; i < 20000; ++i) {
    std::string s;
    if (i % 2 == 0) {
      const int n = tt::uniform_int(rng, 0, 40);
      for (int k = 0; k < n; ++k)
        s += alphabet[static_cast<std::size_t>(tt::uniform_int(rng, 0, static_cast<int>(alphabet.size()) - 1))];
    } else {
      s = seeds[static_cast<std::size_t>(tt::uniform_int(rng, 0, 19))];
      const int edits = tt::uniform_int(rng, 1, 4);
      for (int e = 0; e < edits && !s.empty(); ++e) {
        const auto at = static_cast<std::size_t>(tt::uniform_int(rng, 0, static_cast<int>(s.size()) - 1));
        switch (tt::uniform_int(rng, 0, 3)) {
          case 0: s.erase(at, 1); break;
          case 1:
            s.insert(
                at, 1,
                alphabet[static_cast<std::size_t>(tt::uniform_int(rng, 0, static_cast<int>(alphabet.size()) - 1))]);
            break;
          case 2: s[at] = static_cast<char>(rng()); break;
          default: s.resize(at); break;  // truncation
        }
      }
    }
    Value v;
    const Status st = json::parse(s, "fuzz", v);
    if (st.is_ok()) {
      ++ok;
      Value again;
      REQUIRE(json::parse(json::write(v), "again", again).is_ok());
      REQUIRE(again == v);
    } else {
      REQUIRE_THAT(st.message(), StartsWith("fuzz:"));
    }
  }
  CHECK(ok > 0);
}

TEST_CASE("json: duplicate-key detection is not quadratic in the number of keys", "[json][regression]") {
  // 200,000 distinct keys (2.6 MB). The old linear scan per key made 2 x 10^10 string compares
  // (minutes); a hash set takes a fraction of a second. The bound is 50x what a linear parser
  // needs on a slow machine, so it only fails for the quadratic behaviour.
  std::string text = "{";
  for (int i = 0; i < 200000; ++i) text += (i ? ",\"k" : "\"k") + std::to_string(i) + "\":1";
  text += "}";
  thinkv::json::Value v;
  const auto t0 = std::chrono::steady_clock::now();
  REQUIRE(thinkv::json::parse(text, "big.json", v).is_ok());
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(s < 10.0);
  // And a duplicate among them is still found, with its position.
  text.back() = ',';
  text += "\"k123456\":2}";
  const thinkv::Status dup = thinkv::json::parse(text, "big.json", v);
  CHECK_FALSE(dup.is_ok());
  CHECK(dup.message().find("duplicate key \"k123456\"") != std::string::npos);
}
