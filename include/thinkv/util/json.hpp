#pragma once
/// \file json.hpp
/// A minimal JSON value, parser and writer (RFC 8259), for ThinKV's small configuration files
/// (calibration files). No exceptions, no UB on any input:
///  - `parse` returns a Status whose message is "<source>:<line>:<column>: <what was found>"
///    (line and column 1-based, the column counts bytes) on malformed input; nesting deeper than
///    `ParseOptions::max_depth` is rejected before it can exhaust the stack; duplicate object keys
///    are rejected (a configuration file with two values for one field is ambiguous);
///  - numbers are doubles, parsed with std::from_chars after a strict check of the JSON grammar
///    (no NaN/Inf, no leading zeros or '+'); numbers beyond the double range are rejected, numbers
///    below it read as 0;
///  - strings hold UTF-8 bytes; \uXXXX escapes (surrogate pairs included) are decoded to UTF-8, an
///    unpaired surrogate is an error; other bytes are taken as they are (not validated as UTF-8);
///  - `write` prints the shortest text that reads back to the same double (std::to_chars), or to
///    the same float for values made with `Value::number_f` (so a float threshold is written
///    "0.41" and not "0.4099999964237213"); integral values below 2^53 are written as integers;
///    non-finite numbers, which JSON cannot hold, are written as null.
/// Objects keep their members in insertion order.

#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <unordered_set>
#include <vector>

#include "thinkv/util/utf8.hpp"
#include "thinkv/status.hpp"

namespace thinkv::json {

enum class Type : std::uint8_t { kNull, kBool, kNumber, kString, kArray, kObject };

constexpr std::string_view to_string(Type t) noexcept {
  switch (t) {
    case Type::kNull: return "null";
    case Type::kBool: return "boolean";
    case Type::kNumber: return "number";
    case Type::kString: return "string";
    case Type::kArray: return "array";
    case Type::kObject: return "object";
  }
  return "?";
}

/// A JSON value. Built with the named factories (no implicit conversions, so a string literal can
/// never silently become a boolean). Accessors of the wrong type return an empty/zero value.
class Value {
 public:
  using Array = std::vector<Value>;
  using Member = std::pair<std::string, Value>;
  using Object = std::vector<Member>;

  Value() = default;  ///< null

  static Value null() { return {}; }
  static Value boolean(bool b) {
    Value v;
    v.type_ = Type::kBool;
    v.bool_ = b;
    return v;
  }
  /// A number written with the shortest digits that read back to the same double.
  static Value number(double x) {
    Value v;
    v.type_ = Type::kNumber;
    v.num_ = x;
    return v;
  }
  /// A number that is a float: written with the shortest digits that read back to the same float.
  static Value number_f(float x) {
    Value v = number(static_cast<double>(x));
    v.single_ = true;
    return v;
  }
  static Value integer(long long x) { return number(static_cast<double>(x)); }
  static Value string(std::string s) {
    Value v;
    v.type_ = Type::kString;
    v.str_ = std::move(s);
    return v;
  }
  static Value array(Array a = {}) {
    Value v;
    v.type_ = Type::kArray;
    v.arr_ = std::move(a);
    return v;
  }
  static Value object(Object o = {}) {
    Value v;
    v.type_ = Type::kObject;
    v.obj_ = std::move(o);
    return v;
  }

  [[nodiscard]] Type type() const noexcept { return type_; }
  [[nodiscard]] bool is_null() const noexcept { return type_ == Type::kNull; }
  [[nodiscard]] bool is_bool() const noexcept { return type_ == Type::kBool; }
  [[nodiscard]] bool is_number() const noexcept { return type_ == Type::kNumber; }
  [[nodiscard]] bool is_string() const noexcept { return type_ == Type::kString; }
  [[nodiscard]] bool is_array() const noexcept { return type_ == Type::kArray; }
  [[nodiscard]] bool is_object() const noexcept { return type_ == Type::kObject; }
  /// True for a number that is integral and within [-2^53, 2^53] (exactly representable).
  [[nodiscard]] bool is_integer() const noexcept {
    return type_ == Type::kNumber && std::isfinite(num_) && std::fabs(num_) <= 9007199254740992.0 &&
           std::floor(num_) == num_;
  }
  [[nodiscard]] bool is_single() const noexcept { return single_; }

  [[nodiscard]] bool as_bool() const noexcept { return type_ == Type::kBool && bool_; }
  [[nodiscard]] double as_number() const noexcept { return type_ == Type::kNumber ? num_ : 0.0; }
  [[nodiscard]] const std::string& as_string() const noexcept { return type_ == Type::kString ? str_ : empty_string(); }
  [[nodiscard]] const Array& as_array() const noexcept { return type_ == Type::kArray ? arr_ : empty_array(); }
  [[nodiscard]] const Object& as_object() const noexcept { return type_ == Type::kObject ? obj_ : empty_object(); }

  /// Array append (a non-array becomes an empty array first).
  Value& push_back(Value v) {
    if (type_ != Type::kArray) *this = array();
    arr_.push_back(std::move(v));
    return arr_.back();
  }
  /// Object member set, replacing an existing member of that key (a non-object becomes an empty
  /// object first). Returns the stored value.
  Value& set(std::string key, Value v) {
    if (type_ != Type::kObject) *this = object();
    for (auto& m : obj_) {
      if (m.first == key) {
        m.second = std::move(v);
        return m.second;
      }
    }
    obj_.emplace_back(std::move(key), std::move(v));
    return obj_.back().second;
  }
  /// The member `key` of an object, or nullptr (also for non-objects).
  [[nodiscard]] const Value* find(std::string_view key) const noexcept {
    if (type_ != Type::kObject) return nullptr;
    for (const auto& m : obj_)
      if (m.first == key) return &m.second;
    return nullptr;
  }
  [[nodiscard]] std::size_t size() const noexcept {
    return type_ == Type::kArray ? arr_.size() : type_ == Type::kObject ? obj_.size() : 0;
  }

  /// Deep equality (numbers by value; the float flag is ignored; member order matters).
  friend bool operator==(const Value& a, const Value& b) {
    if (a.type_ != b.type_) return false;
    switch (a.type_) {
      case Type::kNull: return true;
      case Type::kBool: return a.bool_ == b.bool_;
      case Type::kNumber: return a.num_ == b.num_;
      case Type::kString: return a.str_ == b.str_;
      case Type::kArray: return a.arr_ == b.arr_;
      case Type::kObject: return a.obj_ == b.obj_;
    }
    return false;
  }

 private:
  static const std::string& empty_string() noexcept {
    static const std::string s;
    return s;
  }
  static const Array& empty_array() noexcept {
    static const Array a;
    return a;
  }
  static const Object& empty_object() noexcept {
    static const Object o;
    return o;
  }

  Type type_ = Type::kNull;
  bool bool_ = false;
  bool single_ = false;
  double num_ = 0.0;
  std::string str_;
  Array arr_;
  Object obj_;
};

struct ParseOptions {
  int max_depth = 64;  ///< arrays/objects nested deeper than this are rejected
};

namespace detail {

class Parser {
 public:
  Parser(std::string_view text, std::string_view source, const ParseOptions& opt)
      : s_(text), source_(source), opt_(opt) {}

  Status run(Value& out) {
    if (s_.size() >= 3 && static_cast<unsigned char>(s_[0]) == 0xEF && static_cast<unsigned char>(s_[1]) == 0xBB &&
        static_cast<unsigned char>(s_[2]) == 0xBF) {
      i_ = 3;  // UTF-8 byte order mark
    }
    skip_ws();
    Value v;
    if (!parse_value(v, 0)) return error();
    skip_ws();
    if (i_ < s_.size()) {
      fail("unexpected " + found() + " after the end of the JSON value");
      return error();
    }
    out = std::move(v);
    return Status::ok();
  }

 private:
  Status error() const { return {StatusCode::kInvalidArgument, err_}; }
  bool at_end() const noexcept { return i_ >= s_.size(); }
  char peek() const noexcept { return i_ < s_.size() ? s_[i_] : '\0'; }

  void skip_ws() noexcept {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r')) ++i_;
  }

  /// "'x'", "byte 0x01" or "end of input" for the byte at i_.
  std::string found() const {
    if (at_end()) return "end of input";
    const auto c = static_cast<unsigned char>(s_[i_]);
    if (c >= 0x20 && c < 0x7F) return std::string("'") + static_cast<char>(c) + "'";
    static constexpr char kHex[] = "0123456789abcdef";
    return std::string("byte 0x") + kHex[c >> 4] + kHex[c & 15];
  }

  bool fail(const std::string& what) { return fail_at(i_, what); }
  bool fail_at(std::size_t pos, const std::string& what) {
    if (pos > s_.size()) pos = s_.size();
    std::size_t line = 1, col = 1;
    for (std::size_t k = 0; k < pos; ++k) {
      if (s_[k] == '\n') {
        ++line;
        col = 1;
      } else {
        ++col;
      }
    }
    err_ = std::string(source_) + ":" + std::to_string(line) + ":" + std::to_string(col) + ": " + what;
    return false;
  }

  bool literal(std::string_view word, Value v, Value& out) {
    if (s_.substr(i_, word.size()) != word) { return fail("invalid literal: expected '" + std::string(word) + "'"); }
    i_ += word.size();
    out = std::move(v);
    return true;
  }

  bool parse_value(Value& out, int depth) {
    if (at_end()) return fail("expected a JSON value, found end of input");
    const char c = peek();
    switch (c) {
      case '{': return parse_object(out, depth + 1);
      case '[': return parse_array(out, depth + 1);
      case '"': {
        std::string s;
        if (!parse_string(s)) return false;
        out = Value::string(std::move(s));
        return true;
      }
      case 't': return literal("true", Value::boolean(true), out);
      case 'f': return literal("false", Value::boolean(false), out);
      case 'n': return literal("null", Value::null(), out);
      default:
        if (c == '-' || (c >= '0' && c <= '9')) return parse_number(out);
        return fail("expected a JSON value, found " + found());
    }
  }

  bool enter(int depth) {
    if (depth > opt_.max_depth) { return fail("nesting deeper than " + std::to_string(opt_.max_depth) + " levels"); }
    return true;
  }

  bool parse_object(Value& out, int depth) {
    if (!enter(depth)) return false;
    ++i_;  // '{'
    Value obj = Value::object();
    skip_ws();
    if (peek() == '}' && !at_end()) {
      ++i_;
      out = std::move(obj);
      return true;
    }
    Value::Object members;
    // Duplicate keys are found with a hash set (a linear scan per key would make an object of n
    // keys cost n^2 / 2 string compares: minutes for a 16 MiB file of small keys).
    std::unordered_set<std::string> seen;
    for (;;) {
      skip_ws();
      if (peek() != '"' || at_end()) { return fail("expected a string key in an object, found " + found()); }
      const std::size_t key_pos = i_;
      std::string key;
      if (!parse_string(key)) return false;
      if (!seen.insert(key).second) { return fail_at(key_pos, "duplicate key \"" + key + "\" in an object"); }
      skip_ws();
      if (peek() != ':' || at_end()) return fail("expected ':' after an object key, found " + found());
      ++i_;
      skip_ws();
      Value v;
      if (!parse_value(v, depth)) return false;
      members.emplace_back(std::move(key), std::move(v));
      skip_ws();
      if (at_end()) return fail("expected ',' or '}' in an object, found end of input");
      if (peek() == ',') {
        ++i_;
        continue;
      }
      if (peek() == '}') {
        ++i_;
        out = Value::object(std::move(members));
        return true;
      }
      return fail("expected ',' or '}' in an object, found " + found());
    }
  }

  bool parse_array(Value& out, int depth) {
    if (!enter(depth)) return false;
    ++i_;  // '['
    Value::Array items;
    skip_ws();
    if (peek() == ']' && !at_end()) {
      ++i_;
      out = Value::array();
      return true;
    }
    for (;;) {
      skip_ws();
      Value v;
      if (!parse_value(v, depth)) return false;
      items.push_back(std::move(v));
      skip_ws();
      if (at_end()) return fail("expected ',' or ']' in an array, found end of input");
      if (peek() == ',') {
        ++i_;
        continue;
      }
      if (peek() == ']') {
        ++i_;
        out = Value::array(std::move(items));
        return true;
      }
      return fail("expected ',' or ']' in an array, found " + found());
    }
  }

  static int hex_digit(char c) noexcept {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  }
  /// Reads 4 hex digits at i_ (after "\u"); -1 when malformed.
  long read_hex4() {
    if (s_.size() - i_ < 4) return -1;
    long v = 0;
    for (int k = 0; k < 4; ++k) {
      const int d = hex_digit(s_[i_ + static_cast<std::size_t>(k)]);
      if (d < 0) return -1;
      v = v * 16 + d;
    }
    i_ += 4;
    return v;
  }
  bool parse_string(std::string& out) {
    const std::size_t start = i_;
    ++i_;  // opening quote
    for (;;) {
      if (at_end()) return fail_at(start, "unterminated string (no closing '\"')");
      const char c = s_[i_];
      if (c == '"') {
        ++i_;
        return true;
      }
      if (static_cast<unsigned char>(c) < 0x20) {
        return fail("control character " + found() + " inside a string (write it as an escape)");
      }
      if (c != '\\') {
        out += c;
        ++i_;
        continue;
      }
      const std::size_t esc = i_;
      ++i_;
      if (at_end()) return fail_at(start, "unterminated string (ends in a '\\')");
      const char e = s_[i_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          const long hi = read_hex4();
          if (hi < 0) return fail_at(esc, "invalid \\u escape: expected 4 hex digits");
          unsigned long cp = static_cast<unsigned long>(hi);
          if (hi >= 0xDC00 && hi <= 0xDFFF) { return fail_at(esc, "invalid \\u escape: unpaired low surrogate"); }
          if (hi >= 0xD800 && hi <= 0xDBFF) {
            if (s_.substr(i_, 2) != "\\u") {
              return fail_at(esc, "invalid \\u escape: high surrogate not followed by a low one");
            }
            i_ += 2;
            const long lo = read_hex4();
            if (lo < 0xDC00 || lo > 0xDFFF) {
              return fail_at(esc, "invalid \\u escape: high surrogate not followed by a low one");
            }
            cp =
                0x10000 + ((static_cast<unsigned long>(hi) - 0xD800) << 10) + (static_cast<unsigned long>(lo) - 0xDC00);
          }
          ::thinkv::append_utf8(out, cp);
          break;
        }
        default: i_ = esc; return fail("invalid escape '\\" + std::string(1, e) + "' in a string");
      }
    }
  }

  bool parse_number(Value& out) {
    const std::size_t start = i_;
    auto digit = [&] { return !at_end() && s_[i_] >= '0' && s_[i_] <= '9'; };
    if (peek() == '-') ++i_;
    if (!digit()) return fail("invalid number: expected a digit after '-', found " + found());
    if (s_[i_] == '0') {
      ++i_;
      if (digit()) return fail_at(start, "invalid number: leading zeros are not allowed");
    } else {
      while (digit()) ++i_;
    }
    if (peek() == '.' && !at_end()) {
      ++i_;
      if (!digit()) return fail("invalid number: expected a digit after '.', found " + found());
      while (digit()) ++i_;
    }
    bool neg_exp = false;
    if (!at_end() && (peek() == 'e' || peek() == 'E')) {
      ++i_;
      if (!at_end() && (peek() == '+' || peek() == '-')) neg_exp = s_[i_++] == '-';
      if (!digit()) return fail("invalid number: expected a digit in the exponent, found " + found());
      while (digit()) ++i_;
    }
    const std::string_view text = s_.substr(start, i_ - start);
    double x = 0.0;
    const auto r = std::from_chars(text.data(), text.data() + text.size(), x);
    if (r.ec == std::errc::result_out_of_range) {
      // Below the double range: 0 (with its sign); above: an error.
      bool all_zero_mantissa = true;
      for (char ch : text) {
        if (ch == 'e' || ch == 'E') break;
        if (ch >= '1' && ch <= '9') all_zero_mantissa = false;
      }
      if (!neg_exp && !all_zero_mantissa) {
        return fail_at(start, "number " + std::string(text) + " is out of the range of a double");
      }
      x = text[0] == '-' ? -0.0 : 0.0;
    } else if (r.ec != std::errc() || r.ptr != text.data() + text.size()) {
      return fail_at(start, "invalid number " + std::string(text));
    }
    out = Value::number(x);
    return true;
  }

  std::string_view s_;
  std::string_view source_;
  ParseOptions opt_;
  std::size_t i_ = 0;
  std::string err_;
};

inline void write_number(std::string& out, const Value& v) {
  const double x = v.as_number();
  if (!std::isfinite(x)) {
    out += "null";
    return;
  }
  char buf[64];
  std::to_chars_result r{};
  if (std::floor(x) == x && std::fabs(x) < 9007199254740992.0) {
    r = std::to_chars(buf, buf + sizeof buf, static_cast<long long>(x));
    if (x == 0.0 && std::signbit(x)) {
      out += "-0";
      return;
    }
  } else if (v.is_single()) {
    r = std::to_chars(buf, buf + sizeof buf, static_cast<float>(x));
  } else {
    r = std::to_chars(buf, buf + sizeof buf, x);
  }
  if (r.ec != std::errc()) {
    out += "null";
    return;
  }
  out.append(buf, r.ptr);
}

inline void write_string(std::string& out, std::string_view s) {
  static constexpr char kHex[] = "0123456789abcdef";
  out += '"';
  for (char c : s) {
    const auto u = static_cast<unsigned char>(c);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (u < 0x20) {
          out += "\\u00";
          out += kHex[u >> 4];
          out += kHex[u & 15];
        } else {
          out += c;
        }
    }
  }
  out += '"';
}

inline bool is_scalar(const Value& v) noexcept { return !v.is_array() && !v.is_object(); }

inline void write_value(std::string& out, const Value& v, int indent, int level) {
  auto newline = [&](int lv) {
    if (indent <= 0) return;
    out += '\n';
    out.append(static_cast<std::size_t>(indent) * static_cast<std::size_t>(lv), ' ');
  };
  switch (v.type()) {
    case Type::kNull: out += "null"; return;
    case Type::kBool: out += v.as_bool() ? "true" : "false"; return;
    case Type::kNumber: write_number(out, v); return;
    case Type::kString: write_string(out, v.as_string()); return;
    case Type::kArray: {
      const auto& a = v.as_array();
      if (a.empty()) {
        out += "[]";
        return;
      }
      bool flat = true;  // arrays of scalars go on one line
      for (const auto& x : a) flat = flat && is_scalar(x);
      out += '[';
      for (std::size_t k = 0; k < a.size(); ++k) {
        if (k > 0) out += flat && indent > 0 ? ", " : ",";
        if (!flat) newline(level + 1);
        write_value(out, a[k], indent, level + 1);
      }
      if (!flat) newline(level);
      out += ']';
      return;
    }
    case Type::kObject: {
      const auto& o = v.as_object();
      if (o.empty()) {
        out += "{}";
        return;
      }
      out += '{';
      for (std::size_t k = 0; k < o.size(); ++k) {
        if (k > 0) out += ',';
        newline(level + 1);
        write_string(out, o[k].first);
        out += indent > 0 ? ": " : ":";
        write_value(out, o[k].second, indent, level + 1);
      }
      newline(level);
      out += '}';
      return;
    }
  }
}

}  // namespace detail

/// Parses one JSON document (surrounding whitespace and a UTF-8 byte order mark allowed). On
/// error returns kInvalidArgument "<source>:<line>:<column>: <what>" and leaves `out` unchanged.
inline Status parse(std::string_view text, std::string_view source, Value& out, const ParseOptions& options = {}) {
  return detail::Parser(text, source, options).run(out);
}

/// The JSON text of `v`: pretty-printed with `indent` spaces per level (arrays of scalars on one
/// line), or compact when indent <= 0. No trailing newline.
inline std::string write(const Value& v, int indent = 2) {
  std::string out;
  detail::write_value(out, v, indent, 0);
  return out;
}

}  // namespace thinkv::json
