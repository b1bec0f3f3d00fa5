#pragma once
/// \file calibration_file.hpp
/// The calibration file: a JSON document written by `thinkv calibrate` and read by the run-time
/// classifier (docs/calibration.md lists every field).
///
///     {
///       "format": "thinkv-calibration",
///       "version": 1,
///       "model": {"name": "stories260K", "num_layers": 5},
///       "thresholds": [0.41, 0.7],
///       "layers": [1, 3],
///       "tau": 128,
///       "num_types": 3,
///       "band_types": ["E", "R", "T"],
///       "provenance": {"prompts": 12, "steps": 12000, "date": "2025-01-31T12:00:00Z",
///                      "method": "kde-silverman", "bandwidth_rule": "...", "tool": "thinkv calibrate"},
///       "diagnostics": {...}
///     }
///
/// Reading validates every field and rejects a corrupt file with a message naming the field.
/// "diagnostics" (per-layer scores and mode counts) and unknown fields are ignored by the reader.
///
/// JSON is read and written with nlohmann-json (Debian: nlohmann-json3-dev), which is why this
/// header belongs to the calibration component and not to the dependency-free runtime core. The
/// reader adds what a configuration file needs on top: "<file>:<line>:<column>:" on malformed
/// text, a member given twice in one object is an error (which value was meant is ambiguous),
/// nesting is limited to kMaxCalibrationJsonDepth, and floats are written with the shortest
/// digits that read back to the same float ("0.41", not "0.4099999964237213").

#include <array>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <filesystem>
#include <fstream>
#include <istream>
#include <iterator>
#include <ostream>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "thinkv/status.hpp"
#include "thinkv/thought/calibration.hpp"
#include "thinkv/thought/classifier.hpp"
#include "thinkv/types.hpp"

namespace thinkv {

inline constexpr std::string_view kCalibrationFormat = "thinkv-calibration";
inline constexpr int kCalibrationVersion = 1;
/// Larger inputs are not calibration files (they hold a few hundred bytes).
inline constexpr std::size_t kMaxCalibrationFileBytes = std::size_t{16} << 20;
/// Deeper nesting is not a calibration file (the format nests 3 levels).
inline constexpr int kMaxCalibrationJsonDepth = 64;

/// The JSON value type of calibration files (members keep their order).
using CalibrationJson = nlohmann::ordered_json;

struct CalibrationProvenance {
  long prompts = 0;
  long steps = 0;
  std::string date;            ///< ISO 8601 UTC
  std::string method;          ///< "kde-silverman" or "user-thresholds"
  std::string bandwidth_rule;  ///< human-readable bandwidth rule and grid
  std::string tool;            ///< what wrote the file
};

/// The content of a calibration file.
struct CalibrationFile {
  std::string format = std::string(kCalibrationFormat);
  int version = kCalibrationVersion;
  std::string model_name;
  int num_layers = 0;
  std::vector<float> thresholds;  ///< ascending, num_types - 1 values in (0,1)
  std::vector<int> layers;        ///< L*, unique, in [0, num_layers)
  int tau = 128;
  int num_types = 3;
  /// Lowest to highest sparsity; the first num_types entries are used.
  std::array<ThoughtType, 3> band_types = default_band_types(3);
  CalibrationProvenance provenance;
  std::string source;  ///< where it was read from (for messages; not written)
};

/// The file content of a calibration result.
inline CalibrationFile to_calibration_file(const CalibrationResult& r, std::string_view tool = "thinkv calibrate") {
  CalibrationFile f;
  f.model_name = r.model;
  f.num_layers = r.num_layers;
  f.thresholds = r.thresholds;
  f.layers = r.layers;
  f.tau = r.tau;
  f.num_types = r.num_types;
  f.band_types = r.band_types;
  f.provenance.prompts = r.prompts;
  f.provenance.steps = r.steps;
  f.provenance.date = r.date;
  f.provenance.method = r.method;
  f.provenance.bandwidth_rule = bandwidth_rule_text(r.bandwidth_scale);
  f.provenance.tool = std::string(tool);
  return f;
}

namespace calib_file_detail {

inline std::string source_or(std::string_view s) {
  return s.empty() ? std::string("calibration file") : std::string(s);
}

inline Status bad(std::string_view source, const std::string& what) {
  return {StatusCode::kInvalidArgument,
          source_or(source) + ": " + what +
              "; the file is corrupt or not a ThinKV calibration file — recalibrate with `thinkv calibrate`"};
}

/// A model with more layers than the thought classifier takes: not a corrupt file, but one that
/// cannot be used (calibrate() refuses such traces for the same reason).
inline Status too_many_layers(std::string_view source, long long num_layers) {
  return {StatusCode::kInvalidArgument,
          source_or(source) + ": field 'model.num_layers' is " + std::to_string(num_layers) +
              "; ThinKV's thought classifier supports at most " + std::to_string(kMaxClassifierLayers) +
              " layers (kMaxClassifierLayers), so this calibration cannot be used"};
}

/// The double with the shortest decimal text that reads back to `x` as a float, so that the
/// writer (write_pretty, which prints a double's shortest text) writes 0.41f as "0.41".
inline double shortest_float(float x) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, x);
  double d = static_cast<double>(x);
  std::from_chars(buf, r.ptr, d);
  return d;
}

/// JSON text of one value, as nlohmann-json writes it; invalid UTF-8 in strings becomes U+FFFD.
inline std::string dump_scalar(const CalibrationJson& v) {
  return v.dump(-1, ' ', false, CalibrationJson::error_handler_t::replace);
}

/// Pretty-printed with two spaces per level, arrays of scalars on one line (the layout of the
/// files `thinkv calibrate` writes: thresholds and layers read at a glance).
inline void write_pretty(std::string& out, const CalibrationJson& v, int level) {
  auto newline = [&](int lv) {
    out += '\n';
    out.append(static_cast<std::size_t>(2 * lv), ' ');
  };
  if (v.is_array()) {
    if (v.empty()) {
      out += "[]";
      return;
    }
    bool flat = true;
    for (const auto& x : v) flat = flat && !x.is_structured();
    out += '[';
    bool first = true;
    for (const auto& x : v) {
      if (!first) out += flat ? ", " : ",";
      first = false;
      if (!flat) newline(level + 1);
      write_pretty(out, x, level + 1);
    }
    if (!flat) newline(level);
    out += ']';
  } else if (v.is_object()) {
    if (v.empty()) {
      out += "{}";
      return;
    }
    out += '{';
    bool first = true;
    for (const auto& [key, x] : v.items()) {
      if (!first) out += ',';
      first = false;
      newline(level + 1);
      out += dump_scalar(CalibrationJson(key));
      out += ": ";
      write_pretty(out, x, level + 1);
    }
    newline(level);
    out += '}';
  } else if (v.is_number_float() && std::isfinite(v.get<double>())) {
    // std::to_chars: the shortest text that reads back to the same double. nlohmann-json's own
    // Grisu2 output reads back too but is not always the shortest ("0.7337977999999999").
    char buf[32];
    const auto r = std::to_chars(buf, buf + sizeof buf, v.get<double>());
    out.append(buf, r.ptr);
  } else {
    out += dump_scalar(v);
  }
}

inline std::string float_list(const std::vector<float>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) {
    char buf[32];
    const auto r = std::to_chars(buf, buf + sizeof buf, v[i]);
    s += (i ? ", " : "") + std::string(buf, r.ptr);
  }
  return s + "]";
}

/// An integral JSON number in [lo, hi] (2.0 counts: the value, not the spelling, is checked).
inline bool integer_in(const CalibrationJson& v, long long lo, long long hi, long long& out) {
  if (v.is_number_unsigned()) {
    const auto u = v.get<std::uint64_t>();
    if (u > static_cast<std::uint64_t>(hi)) return false;
    out = static_cast<long long>(u);
  } else if (v.is_number_integer()) {
    out = v.get<std::int64_t>();
  } else if (v.is_number_float()) {
    const double d = v.get<double>();
    if (!(d == std::floor(d)) || d < static_cast<double>(lo) || d > static_cast<double>(hi)) return false;
    out = static_cast<long long>(d);
  } else {
    return false;
  }
  return out >= lo && out <= hi;
}

/// Thrown by the parser callback to stop at the first member given twice or too deep a nesting.
struct StructureError {
  std::string what;
};

/// Parses `text`; on error a message "<src>:<line>:<column>: <what>" (position where known).
inline Status parse_json(const std::string& text, const std::string& src, CalibrationJson& out) {
  std::vector<std::vector<std::string>> keys;  // member names of each open object
  int open = 0;                                // open arrays and objects (the root object is 1)
  auto callback = [&](int /*depth*/, CalibrationJson::parse_event_t event, CalibrationJson& parsed) {
    using E = CalibrationJson::parse_event_t;
    if (event == E::object_start || event == E::array_start) {
      if (++open > kMaxCalibrationJsonDepth) {
        throw StructureError{"nesting deeper than " + std::to_string(kMaxCalibrationJsonDepth) + " levels"};
      }
    }
    if (event == E::object_end || event == E::array_end) --open;
    if (event == E::object_start) {
      keys.emplace_back();
    } else if (event == E::object_end) {
      keys.pop_back();
    } else if (event == E::key) {
      auto& seen = keys.back();
      const std::string& k = parsed.get_ref<const std::string&>();
      for (const auto& x : seen) {
        if (x == k) throw StructureError{"member \"" + k + "\" is given twice in one object"};
      }
      seen.push_back(k);
    }
    return true;
  };
  try {
    out = CalibrationJson::parse(text, callback, /*allow_exceptions=*/true, /*ignore_comments=*/false);
  } catch (const StructureError& e) {
    return {StatusCode::kInvalidArgument, src + ": " + e.what};
  } catch (const CalibrationJson::parse_error& e) {
    // e.byte: 1-based offset of the last byte read. Line and column (bytes) are counted here.
    const std::size_t at = std::min<std::size_t>(e.byte == 0 ? 0 : e.byte - 1, text.size());
    std::size_t line = 1, col = 1;
    for (std::size_t i = 0; i < at; ++i) {
      if (text[i] == '\n') {
        ++line;
        col = 1;
      } else {
        ++col;
      }
    }
    std::string what = e.what();  // "[json.exception.parse_error.101] parse error at line 1, column 2: <what>"
    if (const auto p = what.find("column "); p != std::string::npos) {
      if (const auto c = what.find(": ", p); c != std::string::npos) what = what.substr(c + 2);
    }
    return {StatusCode::kInvalidArgument, src + ":" + std::to_string(line) + ":" + std::to_string(col) + ": " + what};
  } catch (const CalibrationJson::exception& e) {  // e.g. out_of_range.406: a number beyond double
    std::string what = e.what();
    if (const auto p = what.find("] "); p != std::string::npos) what = what.substr(p + 2);
    return {StatusCode::kInvalidArgument, src + ": " + what};
  }
  return Status::ok();
}

inline bool type_from_letter(std::string_view s, ThoughtType& t) {
  if (s == "R")
    t = ThoughtType::kReasoning;
  else if (s == "E")
    t = ThoughtType::kExecution;
  else if (s == "T")
    t = ThoughtType::kTransition;
  else
    return false;
  return true;
}

}  // namespace calib_file_detail

/// Checks every constraint of a calibration file; the message names the field.
inline Status validate_calibration(const CalibrationFile& f, std::string_view source = {}) {
  using calib_file_detail::bad;
  if (f.format != kCalibrationFormat) {
    return bad(source, "field 'format' is \"" + f.format + "\", expected \"" + std::string(kCalibrationFormat) + "\"");
  }
  if (f.version != kCalibrationVersion) {
    return {StatusCode::kInvalidArgument,
            calib_file_detail::source_or(source) + ": field 'version' is " + std::to_string(f.version) +
                "; this thinkv reads version " + std::to_string(kCalibrationVersion) +
                (f.version > kCalibrationVersion
                     ? " (the file was written by a newer thinkv: update thinkv, or recalibrate)"
                     : " — recalibrate with `thinkv calibrate`")};
  }
  if (f.model_name.empty()) return bad(source, "field 'model.name' is empty");
  if (f.num_layers > kMaxClassifierLayers) return calib_file_detail::too_many_layers(source, f.num_layers);
  if (f.num_layers < 1) {
    return bad(source, "field 'model.num_layers' is " + std::to_string(f.num_layers) + ", expected 1.." +
                           std::to_string(kMaxClassifierLayers));
  }
  if (f.num_types != 2 && f.num_types != 3) {
    return bad(source, "field 'num_types' is " + std::to_string(f.num_types) + ", expected 2 or 3");
  }
  if (static_cast<int>(f.thresholds.size()) != f.num_types - 1) {
    return bad(source, "field 'thresholds' has " + std::to_string(f.thresholds.size()) + " values, but " +
                           std::to_string(f.num_types) + " thought types need " + std::to_string(f.num_types - 1));
  }
  for (std::size_t i = 0; i < f.thresholds.size(); ++i) {
    const float x = f.thresholds[i];
    if (!(std::isfinite(x) && x > 0.0f && x < 1.0f) || (i > 0 && !(x > f.thresholds[i - 1]))) {
      return bad(source, "field 'thresholds' " + calib_file_detail::float_list(f.thresholds) +
                             " must be strictly ascending numbers in (0,1)");
    }
  }
  if (f.layers.empty()) return bad(source, "field 'layers' is empty; at least one layer is needed");
  std::set<int> seen;
  for (int l : f.layers) {
    if (l < 0 || l >= f.num_layers) {
      return bad(source, "field 'layers' names layer " + std::to_string(l) + ", outside [0, " +
                             std::to_string(f.num_layers) + ") for a model with " + std::to_string(f.num_layers) +
                             " layers");
    }
    if (!seen.insert(l).second) return bad(source, "field 'layers' names layer " + std::to_string(l) + " twice");
  }
  if (f.tau < 1) return bad(source, "field 'tau' is " + std::to_string(f.tau) + ", expected an integer >= 1");
  for (int i = 0; i < f.num_types; ++i) {
    for (int j = 0; j < i; ++j) {
      if (f.band_types[static_cast<std::size_t>(i)] == f.band_types[static_cast<std::size_t>(j)]) {
        return bad(source, "field 'band_types' names " +
                               std::string(to_string(f.band_types[static_cast<std::size_t>(i)])) +
                               " twice; it must list " + std::to_string(f.num_types) + " different types");
      }
    }
  }
  if (f.provenance.prompts < 0) return bad(source, "field 'provenance.prompts' is negative");
  if (f.provenance.steps < 0) return bad(source, "field 'provenance.steps' is negative");
  return Status::ok();
}

/// Writes a calibration file (validated first; nothing is written when invalid). `diagnostics`,
/// when given, is written as the "diagnostics" member.
inline Status write_calibration_json(std::ostream& os, const CalibrationFile& f,
                                     const CalibrationJson* diagnostics = nullptr) {
  THINKV_RETURN_IF_ERROR(validate_calibration(f, "write_calibration_json"));
  using calib_file_detail::shortest_float;
  CalibrationJson root = CalibrationJson::object();
  root["format"] = f.format;
  root["version"] = f.version;
  root["model"] = {{"name", f.model_name}, {"num_layers", f.num_layers}};
  CalibrationJson th = CalibrationJson::array();
  for (float x : f.thresholds) th.push_back(shortest_float(x));
  root["thresholds"] = std::move(th);
  root["layers"] = f.layers;
  root["tau"] = f.tau;
  root["num_types"] = f.num_types;
  CalibrationJson bands = CalibrationJson::array();
  for (int i = 0; i < f.num_types; ++i) {
    bands.push_back(std::string(to_string(f.band_types[static_cast<std::size_t>(i)])));
  }
  root["band_types"] = std::move(bands);
  root["provenance"] = {{"prompts", f.provenance.prompts},
                        {"steps", f.provenance.steps},
                        {"date", f.provenance.date},
                        {"method", f.provenance.method},
                        {"bandwidth_rule", f.provenance.bandwidth_rule},
                        {"tool", f.provenance.tool}};
  if (diagnostics != nullptr) root["diagnostics"] = *diagnostics;
  std::string text;
  calib_file_detail::write_pretty(text, root, 0);
  os << text << '\n';
  os.flush();
  if (!os) return {StatusCode::kInvalidArgument, "write_calibration_json: the output stream failed (disk full?)"};
  return Status::ok();
}

/// The "diagnostics" object of a result: per layer the score, the mean valley depth, the mode
/// histogram over prompts and whether it was chosen (for people; the reader ignores it).
inline CalibrationJson calibration_diagnostics(const CalibrationResult& r) {
  using calib_file_detail::shortest_float;
  CalibrationJson score = CalibrationJson::array(), depth = CalibrationJson::array(), hist = CalibrationJson::array();
  for (const LayerReport& rep : r.layer_reports) {
    score.push_back(shortest_float(static_cast<float>(rep.score)));
    depth.push_back(shortest_float(static_cast<float>(rep.mean_valley_depth)));
    CalibrationJson h = CalibrationJson::array();
    for (int c : rep.mode_histogram) h.push_back(c);
    hist.push_back(std::move(h));
  }
  CalibrationJson d = CalibrationJson::object();
  d["layer_score"] = std::move(score);
  d["layer_mean_valley_depth"] = std::move(depth);
  d["layer_mode_histogram"] = std::move(hist);
  d["notes"] = r.notes;
  return d;
}

/// Writes the calibration file of a result, with its diagnostics.
inline Status write_calibration_json(std::ostream& os, const CalibrationResult& r) {
  const CalibrationJson diag = calibration_diagnostics(r);
  return write_calibration_json(os, to_calibration_file(r), &diag);
}

namespace calib_file_detail {

/// Field access with messages that name the field ("model.num_layers").
class Fields {
 public:
  using Json = CalibrationJson;
  explicit Fields(std::string_view source) : source_(source) {}

  Status object(const Json& parent, std::string_view key, std::string_view path, const Json*& out) {
    return get(parent, key, path, Json::value_t::object, "object", out);
  }
  Status string(const Json& parent, std::string_view key, std::string_view path, std::string& out) {
    const Json* v = nullptr;
    THINKV_RETURN_IF_ERROR(get(parent, key, path, Json::value_t::string, "string", v));
    out = v->get<std::string>();
    return Status::ok();
  }
  Status integer(const Json& parent, std::string_view key, std::string_view path, long long lo, long long hi,
                 long long& out) {
    const Json* v = find(parent, key);
    if (v == nullptr) return bad(source_, "missing field '" + std::string(path) + "'");
    if (!v->is_number()) return wrong_type(path, *v, "number");
    if (!integer_in(*v, lo, hi, out)) {
      return bad(source_, "field '" + std::string(path) + "' is " + dump_scalar(*v) + ", expected an integer in [" +
                              std::to_string(lo) + ", " + std::to_string(hi) + "]");
    }
    return Status::ok();
  }
  Status array(const Json& parent, std::string_view key, std::string_view path, const Json*& out) {
    return get(parent, key, path, Json::value_t::array, "array", out);
  }

  static const Json* find(const Json& parent, std::string_view key) {
    const auto it = parent.find(std::string(key));
    return it == parent.end() ? nullptr : &*it;
  }

 private:
  Status get(const Json& parent, std::string_view key, std::string_view path, Json::value_t want, const char* want_name,
             const Json*& out) {
    const Json* v = find(parent, key);
    if (v == nullptr) return bad(source_, "missing field '" + std::string(path) + "'");
    if (v->type() != want) return wrong_type(path, *v, want_name);
    out = v;
    return Status::ok();
  }
  Status wrong_type(std::string_view path, const Json& v, const char* want) {
    return bad(source_,
               "field '" + std::string(path) + "' is a " + std::string(v.type_name()) + ", expected a " + want);
  }

  std::string_view source_;
};

}  // namespace calib_file_detail

/// Reads and validates a calibration file. `source` (the file name) prefixes every message. On
/// error `out` is left unchanged.
inline Status read_calibration_json(std::istream& in, std::string_view source, CalibrationFile& out) {
  using calib_file_detail::bad;
  const std::string src = calib_file_detail::source_or(source);
  std::string text;
  char buf[65536];
  while (in.read(buf, sizeof buf) || in.gcount() > 0) {
    text.append(buf, static_cast<std::size_t>(in.gcount()));
    if (text.size() > kMaxCalibrationFileBytes) {
      return bad(src, "the file is larger than " + std::to_string(kMaxCalibrationFileBytes >> 20) + " MiB");
    }
  }
  if (in.bad()) return {StatusCode::kInvalidArgument, src + ": read error"};
  CalibrationJson root;
  if (Status s = calib_file_detail::parse_json(text, src, root); !s.is_ok()) {
    return {StatusCode::kInvalidArgument,
            s.message() + " (not valid JSON: the file is corrupt or truncated — recalibrate with `thinkv calibrate`)"};
  }
  if (!root.is_object()) {
    return bad(src, "the document is a " + std::string(root.type_name()) + ", expected a JSON object");
  }
  calib_file_detail::Fields F(src);
  CalibrationFile f;
  f.source = src;
  THINKV_RETURN_IF_ERROR(F.string(root, "format", "format", f.format));
  if (f.format != kCalibrationFormat) {
    return bad(src, "field 'format' is \"" + f.format + "\", expected \"" + std::string(kCalibrationFormat) + "\"");
  }
  long long ll = 0;
  THINKV_RETURN_IF_ERROR(F.integer(root, "version", "version", 0, 1000000, ll));
  f.version = static_cast<int>(ll);
  if (f.version != kCalibrationVersion) return validate_calibration(f, src);  // the version message

  using calib_file_detail::dump_scalar;
  using calib_file_detail::Fields;
  const CalibrationJson* model = nullptr;
  THINKV_RETURN_IF_ERROR(F.object(root, "model", "model", model));
  THINKV_RETURN_IF_ERROR(F.string(*model, "name", "model.name", f.model_name));
  // The classifier's limit, not the trace format's (kMaxTraceLayers): a file that validates
  // always becomes a classifier (classifier_from_calibration).
  if (const CalibrationJson* n = Fields::find(*model, "num_layers"); n != nullptr) {
    if (long long big = 0; calib_file_detail::integer_in(*n, kMaxClassifierLayers + 1, 1000000000000000000LL, big)) {
      return calib_file_detail::too_many_layers(src, big);
    }
  }
  THINKV_RETURN_IF_ERROR(F.integer(*model, "num_layers", "model.num_layers", 1, kMaxClassifierLayers, ll));
  f.num_layers = static_cast<int>(ll);
  THINKV_RETURN_IF_ERROR(F.integer(root, "num_types", "num_types", 2, 3, ll));
  f.num_types = static_cast<int>(ll);
  THINKV_RETURN_IF_ERROR(F.integer(root, "tau", "tau", 1, 1LL << 30, ll));
  f.tau = static_cast<int>(ll);

  const CalibrationJson* arr = nullptr;
  THINKV_RETURN_IF_ERROR(F.array(root, "thresholds", "thresholds", arr));
  for (std::size_t i = 0; i < arr->size(); ++i) {
    const CalibrationJson& x = (*arr)[i];
    if (!x.is_number()) {
      return bad(src, "field 'thresholds[" + std::to_string(i) + "]' is a " + std::string(x.type_name()) +
                          ", expected a number");
    }
    f.thresholds.push_back(static_cast<float>(x.get<double>()));
  }
  THINKV_RETURN_IF_ERROR(F.array(root, "layers", "layers", arr));
  for (std::size_t i = 0; i < arr->size(); ++i) {
    const CalibrationJson& x = (*arr)[i];
    long long l = 0;
    if (!calib_file_detail::integer_in(x, -1000000000LL, 1000000000LL, l)) {
      return bad(src, "field 'layers[" + std::to_string(i) + "]' is " + dump_scalar(x) + ", expected a layer index");
    }
    f.layers.push_back(static_cast<int>(l));
  }
  THINKV_RETURN_IF_ERROR(F.array(root, "band_types", "band_types", arr));
  if (static_cast<int>(arr->size()) != f.num_types) {
    return bad(src, "field 'band_types' has " + std::to_string(arr->size()) +
                        " entries, expected num_types = " + std::to_string(f.num_types));
  }
  f.band_types = default_band_types(f.num_types);
  for (std::size_t i = 0; i < arr->size(); ++i) {
    const CalibrationJson& x = (*arr)[i];
    if (!x.is_string() || !calib_file_detail::type_from_letter(x.get<std::string>(), f.band_types[i])) {
      return bad(src, "field 'band_types[" + std::to_string(i) + "]' is " + dump_scalar(x) +
                          ", expected \"E\", \"R\" or \"T\"");
    }
  }
  const CalibrationJson* prov = nullptr;
  THINKV_RETURN_IF_ERROR(F.object(root, "provenance", "provenance", prov));
  THINKV_RETURN_IF_ERROR(F.integer(*prov, "prompts", "provenance.prompts", 0, 1LL << 50, ll));
  f.provenance.prompts = static_cast<long>(ll);
  THINKV_RETURN_IF_ERROR(F.integer(*prov, "steps", "provenance.steps", 0, 1LL << 50, ll));
  f.provenance.steps = static_cast<long>(ll);
  THINKV_RETURN_IF_ERROR(F.string(*prov, "date", "provenance.date", f.provenance.date));
  THINKV_RETURN_IF_ERROR(F.string(*prov, "method", "provenance.method", f.provenance.method));
  THINKV_RETURN_IF_ERROR(F.string(*prov, "bandwidth_rule", "provenance.bandwidth_rule", f.provenance.bandwidth_rule));
  THINKV_RETURN_IF_ERROR(F.string(*prov, "tool", "provenance.tool", f.provenance.tool));

  THINKV_RETURN_IF_ERROR(validate_calibration(f, src));
  out = std::move(f);
  return Status::ok();
}

/// Reads a calibration file from a path.
inline Status read_calibration_json(const std::filesystem::path& path, CalibrationFile& out) {
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    std::error_code ec;
    const bool exists = std::filesystem::exists(path, ec);
    return {StatusCode::kInvalidArgument, path.string() + ": cannot open the calibration file (" +
                                              (exists ? "permission denied or not a regular file" : "no such file") +
                                              "); create one with `thinkv calibrate`"};
  }
  return read_calibration_json(f, path.string(), out);
}

/// Rejects a calibration file made for another model: a different layer count always; a
/// different model name when both names are non-empty (pass an empty name to skip that check).
inline Status check_model(const CalibrationFile& f, int model_num_layers, std::string_view model_name) {
  const std::string src = f.source.empty() ? std::string("the calibration file") : f.source;
  if (f.num_layers != model_num_layers) {
    return {StatusCode::kInvalidArgument, src + " was calibrated for a model with " + std::to_string(f.num_layers) +
                                              " layers; this model has " + std::to_string(model_num_layers) +
                                              " — recalibrate with `thinkv calibrate`"};
  }
  if (!model_name.empty() && !f.model_name.empty() && model_name != f.model_name) {
    return {StatusCode::kInvalidArgument,
            src + " was calibrated for model '" + f.model_name + "'; this model is '" + std::string(model_name) +
                "' — recalibrate with `thinkv calibrate` (thresholds do not carry over between models)"};
  }
  for (int l : f.layers) {
    if (l < 0 || l >= model_num_layers) {
      return {StatusCode::kInvalidArgument, src + " names layer " + std::to_string(l) + ", but this model has " +
                                                std::to_string(model_num_layers) + " layers — recalibrate"};
    }
  }
  return Status::ok();
}

/// The run-time classifier a calibration file describes. The file must be valid
/// (read_calibration_json validates it); check_model() should have accepted it for the model.
/// Throws ConfigError if it is not valid after all.
inline ThoughtClassifier classifier_from_calibration(const CalibrationFile& f) {
  return ThoughtClassifier(f.thresholds, f.layers, f.tau,
                           std::vector<ThoughtType>(f.band_types.begin(), f.band_types.begin() + f.num_types),
                           f.num_layers);
}

}  // namespace thinkv
