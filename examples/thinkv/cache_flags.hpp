#pragma once
/// \file cache_flags.hpp
/// The cache flags `thinkv generate`, `sweep` and `eval` share (--budget, --group, --segment,
/// --tau, --precision, --calibration, --select), the calibration file loader, and small
/// formatting helpers.

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "../decoder/cli_util.hpp"
#include "../decoder/decoder.hpp"
#include "thinkv/thought/calibration_file.hpp"

namespace thinkv::decoder::cli {

inline int usage_error(const char* cmd, const char* usage, const std::string& msg) {
  std::fprintf(stderr, "thinkv %s: %s\n%sRun `thinkv %s --help` for details.\n", cmd, msg.c_str(), usage, cmd);
  return kExitUsage;
}

/// Cache flags shared by generate and sweep.
struct CacheFlags {
  int budget = -1;  ///< -1: the default; 0: no budget
  int group = 0;
  int segment = 0;
  int tau = 0;
  PrecisionMap precision{};
  std::string calibration;
  SegmentSelection selection = SegmentSelection::kKmeans;
  bool keep_prompt = true;  ///< --keep-prompt (default) / --compress-prompt
};

/// Parses one cache flag at the scanner's position. Returns 1 when handled, 0 when not a cache
/// flag, -1 after printing a usage error.
inline int parse_cache_flag(Options& o, CacheFlags& c, const char* cmd, const char* usage, int& rc) {
  const std::string_view n = o.name();
  std::string_view v;
  auto need = [&](const char* what) {
    if (!o.value(v) || v.empty()) {
      rc = usage_error(cmd, usage, std::string(n) + " needs " + what);
      return false;
    }
    return true;
  };
  if (n == "--budget") {
    if (!need("a token count")) return -1;
    // 0 = no budget, as ThinKvConfig::token_budget = 0 (TBE then evicts on transitions only).
    if (!parse_int(v, 0, 1 << 30, c.budget)) {
      rc = usage_error(cmd, usage, "--budget " + std::string(v) + ": must be an integer >= 0 (0: no budget)");
      return -1;
    }
  } else if (n == "--group") {
    if (!need("8, 16 or 32")) return -1;
    if (!parse_int(v, 1, 1024, c.group) || (c.group != 8 && c.group != 16 && c.group != 32)) {
      rc = usage_error(cmd, usage, "--group " + std::string(v) + ": must be 8, 16 or 32");
      return -1;
    }
  } else if (n == "--segment") {
    if (!need("a length")) return -1;
    if (!parse_int(v, 1, 1 << 30, c.segment)) {
      rc = usage_error(cmd, usage, "--segment " + std::string(v) + ": must be an integer >= 1");
      return -1;
    }
  } else if (n == "--tau") {
    if (!need("a period")) return -1;
    if (!parse_int(v, 1, 1 << 30, c.tau)) {
      rc = usage_error(cmd, usage, "--tau " + std::string(v) + ": must be an integer >= 1");
      return -1;
    }
  } else if (n == "--precision") {
    if (!need("a map like R4E4T2")) return -1;
    if (Status s = PrecisionMap::parse(v, c.precision); !s.is_ok()) {
      rc = usage_error(cmd, usage, "--precision: " + s.message());
      return -1;
    }
  } else if (n == "--calibration") {
    if (!need("a file")) return -1;
    c.calibration = v;
  } else if (n == "--keep-prompt" || n == "--compress-prompt") {
    if (!o.is_flag()) {
      rc = usage_error(cmd, usage, std::string(n) + " takes no value");
      return -1;
    }
    c.keep_prompt = n == "--keep-prompt";
  } else if (n == "--select") {
    if (!need("kmeans, first or last")) return -1;
    const auto sel = parse_segment_selection(v);
    if (!sel) {
      rc = usage_error(cmd, usage, "--select " + std::string(v) + ": must be kmeans, first or last");
      return -1;
    }
    c.selection = *sel;
  } else {
    return 0;
  }
  return 1;
}

/// Loads --calibration into a classifier (checked against the model). Prints and returns the
/// exit status on error, 0 on success.
inline int load_classifier(const char* cmd, const CacheFlags& c, const Model& m, ThoughtClassifier& out) {
  if (c.calibration.empty()) return 0;
  CalibrationFile f;
  if (Status s = read_calibration_json(std::filesystem::path(c.calibration), f); !s.is_ok()) {
    std::fprintf(stderr, "thinkv %s: %s\n", cmd, s.message().c_str());
    return kExitData;
  }
  if (Status s = check_model(f, m.config.n_layers, m.name); !s.is_ok()) {
    std::fprintf(stderr, "thinkv %s: %s\n", cmd, s.message().c_str());
    return kExitData;
  }
  try {
    std::vector<ThoughtType> bands(f.band_types.begin(), f.band_types.begin() + f.num_types);
    out = ThoughtClassifier(f.thresholds, f.layers, f.tau, bands, f.num_layers);
  } catch (const ConfigError& e) {
    std::fprintf(stderr, "thinkv %s: %s: %s\n", cmd, c.calibration.c_str(), e.what());
    return kExitData;
  }
  return 0;
}

/// The cache options of the flags; `prompt_tokens` (BOS included) are pinned with --keep-prompt.
inline CacheOptions cache_options(const CacheFlags& c, CacheMode mode, int max_tokens, const ThoughtClassifier& cl,
                                  int prompt_tokens = 0) {
  CacheOptions o;
  o.pinned_prefix = c.keep_prompt ? prompt_tokens : 0;
  o.mode = mode;
  o.max_tokens = max_tokens;
  o.budget = c.budget > 0 ? c.budget : 0;  // 0 = the default
  o.no_budget = c.budget == 0;
  o.group_size = c.group;
  o.segment_len = c.segment;
  o.tau = c.tau;
  o.precision = c.precision;
  o.classifier = cl;
  return o;
}

inline std::string fmt(const char* f, double x) {
  char b[64];
  std::snprintf(b, sizeof b, f, x);
  return b;
}

inline std::string human_bytes(std::int64_t n) {
  if (n < 10 * 1024) return std::to_string(n) + " B";
  if (n < 10 * 1024 * 1024) return fmt("%.1f KiB", static_cast<double>(n) / 1024.0);
  if (n < std::int64_t{10} * 1024 * 1024 * 1024) return fmt("%.1f MiB", static_cast<double>(n) / (1024.0 * 1024.0));
  return fmt("%.2f GiB", static_cast<double>(n) / (1024.0 * 1024.0 * 1024.0));
}

/// Writes `content` to `path` through a temporary file in the same directory and a rename, so
/// a reader never sees a partial file and a failed write leaves any earlier file as it was.
/// Returns an error message, empty on success.
inline std::string write_file_atomic(const std::string& path, const std::string& content) {
  namespace fs = std::filesystem;
  const std::string tmp = path + ".tmp-" + std::to_string(static_cast<long long>(::getpid()));
  {
    std::FILE* f = std::fopen(tmp.c_str(), "wb");
    if (f == nullptr) return "cannot write " + path + " (cannot create " + tmp + ")";
    const bool ok = std::fwrite(content.data(), 1, content.size(), f) == content.size();
    const bool closed = std::fclose(f) == 0;
    if (!ok || !closed) {
      std::error_code ec;
      fs::remove(tmp, ec);
      return "cannot write " + path + " (disk full or write error); nothing was written";
    }
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) {
    fs::remove(tmp, ec);
    return "cannot write " + path + ": " + ec.message();
  }
  return {};
}

}  // namespace thinkv::decoder::cli
