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

#include <array>
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

#include "thinkv/status.hpp"
#include "thinkv/thought/calibration.hpp"
#include "thinkv/thought/classifier.hpp"
#include "thinkv/types.hpp"
#include "thinkv/util/json.hpp"

namespace thinkv {

inline constexpr std::string_view kCalibrationFormat = "thinkv-calibration";
inline constexpr int kCalibrationVersion = 1;
/// Larger inputs are not calibration files (they hold a few hundred bytes).
inline constexpr std::size_t kMaxCalibrationFileBytes = std::size_t{16} << 20;

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

inline std::string float_list(const std::vector<float>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) {
    json::Value x = json::Value::number_f(v[i]);
    s += (i ? ", " : "") + json::write(x);
  }
  return s + "]";
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

/// Writes a calibration file (validated first; nothing is written when invalid).
inline Status write_calibration_json(std::ostream& os, const CalibrationFile& f,
                                     const json::Value* diagnostics = nullptr) {
  THINKV_RETURN_IF_ERROR(validate_calibration(f, "write_calibration_json"));
  using json::Value;
  Value root = Value::object();
  root.set("format", Value::string(f.format));
  root.set("version", Value::integer(f.version));
  Value model = Value::object();
  model.set("name", Value::string(f.model_name));
  model.set("num_layers", Value::integer(f.num_layers));
  root.set("model", std::move(model));
  Value th = Value::array();
  for (float x : f.thresholds) th.push_back(Value::number_f(x));
  root.set("thresholds", std::move(th));
  Value layers = Value::array();
  for (int l : f.layers) layers.push_back(Value::integer(l));
  root.set("layers", std::move(layers));
  root.set("tau", Value::integer(f.tau));
  root.set("num_types", Value::integer(f.num_types));
  Value bands = Value::array();
  for (int i = 0; i < f.num_types; ++i) {
    bands.push_back(Value::string(std::string(to_string(f.band_types[static_cast<std::size_t>(i)]))));
  }
  root.set("band_types", std::move(bands));
  Value prov = Value::object();
  prov.set("prompts", Value::integer(f.provenance.prompts));
  prov.set("steps", Value::integer(f.provenance.steps));
  prov.set("date", Value::string(f.provenance.date));
  prov.set("method", Value::string(f.provenance.method));
  prov.set("bandwidth_rule", Value::string(f.provenance.bandwidth_rule));
  prov.set("tool", Value::string(f.provenance.tool));
  root.set("provenance", std::move(prov));
  if (diagnostics != nullptr) root.set("diagnostics", *diagnostics);
  os << json::write(root) << '\n';
  os.flush();
  if (!os) return {StatusCode::kInvalidArgument, "write_calibration_json: the output stream failed (disk full?)"};
  return Status::ok();
}

/// The "diagnostics" object of a result: per layer the score, the mean valley depth, the mode
/// histogram over prompts and whether it was chosen (for people; the reader ignores it).
inline json::Value calibration_diagnostics(const CalibrationResult& r) {
  using json::Value;
  Value score = Value::array(), depth = Value::array(), hist = Value::array();
  for (const LayerReport& rep : r.layer_reports) {
    score.push_back(Value::number_f(static_cast<float>(rep.score)));
    depth.push_back(Value::number_f(static_cast<float>(rep.mean_valley_depth)));
    Value h = Value::array();
    for (int c : rep.mode_histogram) h.push_back(Value::integer(c));
    hist.push_back(std::move(h));
  }
  Value d = Value::object();
  d.set("layer_score", std::move(score));
  d.set("layer_mean_valley_depth", std::move(depth));
  d.set("layer_mode_histogram", std::move(hist));
  Value notes = Value::array();
  for (const auto& n : r.notes) notes.push_back(Value::string(n));
  d.set("notes", std::move(notes));
  return d;
}

/// Writes the calibration file of a result, with its diagnostics.
inline Status write_calibration_json(std::ostream& os, const CalibrationResult& r) {
  const json::Value diag = calibration_diagnostics(r);
  return write_calibration_json(os, to_calibration_file(r), &diag);
}

namespace calib_file_detail {

/// Field access with messages that name the field ("model.num_layers").
class Fields {
 public:
  explicit Fields(std::string_view source) : source_(source) {}

  Status object(const json::Value& parent, std::string_view key, std::string_view path, const json::Value*& out) {
    return get(parent, key, path, json::Type::kObject, out);
  }
  Status string(const json::Value& parent, std::string_view key, std::string_view path, std::string& out) {
    const json::Value* v = nullptr;
    THINKV_RETURN_IF_ERROR(get(parent, key, path, json::Type::kString, v));
    out = v->as_string();
    return Status::ok();
  }
  Status integer(const json::Value& parent, std::string_view key, std::string_view path, long long lo, long long hi,
                 long long& out) {
    const json::Value* v = nullptr;
    THINKV_RETURN_IF_ERROR(get(parent, key, path, json::Type::kNumber, v));
    if (!v->is_integer() || v->as_number() < static_cast<double>(lo) || v->as_number() > static_cast<double>(hi)) {
      return bad(source_, "field '" + std::string(path) + "' is " + json::write(*v) + ", expected an integer in [" +
                              std::to_string(lo) + ", " + std::to_string(hi) + "]");
    }
    out = static_cast<long long>(v->as_number());
    return Status::ok();
  }
  Status array(const json::Value& parent, std::string_view key, std::string_view path, const json::Value*& out) {
    return get(parent, key, path, json::Type::kArray, out);
  }

  Status get(const json::Value& parent, std::string_view key, std::string_view path, json::Type want,
             const json::Value*& out) {
    const json::Value* v = parent.find(key);
    if (v == nullptr) return bad(source_, "missing field '" + std::string(path) + "'");
    if (v->type() != want) {
      return bad(source_, "field '" + std::string(path) + "' is a " + std::string(json::to_string(v->type())) +
                              ", expected a " + std::string(json::to_string(want)));
    }
    out = v;
    return Status::ok();
  }

 private:
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
  json::Value root;
  if (Status s = json::parse(text, src, root); !s.is_ok()) {
    return {StatusCode::kInvalidArgument,
            s.message() + " (not valid JSON: the file is corrupt or truncated — recalibrate with `thinkv calibrate`)"};
  }
  if (!root.is_object()) {
    return bad(src, "the document is a " + std::string(json::to_string(root.type())) + ", expected a JSON object");
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

  const json::Value* model = nullptr;
  THINKV_RETURN_IF_ERROR(F.object(root, "model", "model", model));
  THINKV_RETURN_IF_ERROR(F.string(*model, "name", "model.name", f.model_name));
  // The classifier's limit, not the trace format's (kMaxTraceLayers): a file that validates
  // always becomes a classifier (classifier_from_calibration).
  if (const json::Value* n = model->find("num_layers");
      n != nullptr && n->is_integer() && n->as_number() > kMaxClassifierLayers && n->as_number() <= 1e18) {
    return calib_file_detail::too_many_layers(src, static_cast<long long>(n->as_number()));
  }
  THINKV_RETURN_IF_ERROR(F.integer(*model, "num_layers", "model.num_layers", 1, kMaxClassifierLayers, ll));
  f.num_layers = static_cast<int>(ll);
  THINKV_RETURN_IF_ERROR(F.integer(root, "num_types", "num_types", 2, 3, ll));
  f.num_types = static_cast<int>(ll);
  THINKV_RETURN_IF_ERROR(F.integer(root, "tau", "tau", 1, 1LL << 30, ll));
  f.tau = static_cast<int>(ll);

  const json::Value* arr = nullptr;
  THINKV_RETURN_IF_ERROR(F.array(root, "thresholds", "thresholds", arr));
  for (std::size_t i = 0; i < arr->size(); ++i) {
    const json::Value& x = arr->as_array()[i];
    if (!x.is_number()) {
      return bad(src, "field 'thresholds[" + std::to_string(i) + "]' is a " + std::string(json::to_string(x.type())) +
                          ", expected a number");
    }
    f.thresholds.push_back(static_cast<float>(x.as_number()));
  }
  THINKV_RETURN_IF_ERROR(F.array(root, "layers", "layers", arr));
  for (std::size_t i = 0; i < arr->size(); ++i) {
    const json::Value& x = arr->as_array()[i];
    if (!x.is_integer() || x.as_number() < -1e9 || x.as_number() > 1e9) {
      return bad(src, "field 'layers[" + std::to_string(i) + "]' is " + json::write(x) + ", expected a layer index");
    }
    f.layers.push_back(static_cast<int>(x.as_number()));
  }
  THINKV_RETURN_IF_ERROR(F.array(root, "band_types", "band_types", arr));
  if (static_cast<int>(arr->size()) != f.num_types) {
    return bad(src, "field 'band_types' has " + std::to_string(arr->size()) +
                        " entries, expected num_types = " + std::to_string(f.num_types));
  }
  f.band_types = default_band_types(f.num_types);
  for (std::size_t i = 0; i < arr->size(); ++i) {
    const json::Value& x = arr->as_array()[i];
    if (!x.is_string() || !calib_file_detail::type_from_letter(x.as_string(), f.band_types[i])) {
      return bad(src, "field 'band_types[" + std::to_string(i) + "]' is " + json::write(x) +
                          ", expected \"E\", \"R\" or \"T\"");
    }
  }
  const json::Value* prov = nullptr;
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
