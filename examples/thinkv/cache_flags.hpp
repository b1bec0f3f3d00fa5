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
#include "cli_args.hpp"
#include "thinkv/thought/calibration_file.hpp"

namespace thinkv::decoder::cli {

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

/// Adds the cache options to a subcommand's parser.
inline void add_cache_options(ArgParser& p, CacheFlags& c) {
  // 0 = no budget, as ThinKvConfig::token_budget = 0 (TBE then evicts on transitions only).
  p.integer("--budget", c.budget, 0, 1 << 30, "must be an integer >= 0 (0: no budget)");
  p.value("--group", [&c](const std::string& v) {
    return parse_int(v, 1, 1024, c.group) && (c.group == 8 || c.group == 16 || c.group == 32)
               ? std::string()
               : std::string("must be 8, 16 or 32");
  });
  p.integer("--segment", c.segment, 1, 1 << 30, "must be an integer >= 1");
  p.integer("--tau", c.tau, 1, 1 << 30, "must be an integer >= 1");
  p.value("--precision", [&c](const std::string& v) {
    if (v.empty()) return std::string("needs a map like R4E4T2");
    const Status s = PrecisionMap::parse(v, c.precision);
    return s.is_ok() ? std::string() : s.message();
  });
  p.text("--calibration", c.calibration, "a file");
  p.flag("--keep-prompt,!--compress-prompt", c.keep_prompt);
  p.value("--select", [&c](const std::string& v) {
    const auto sel = parse_segment_selection(v);
    if (!sel) return std::string("must be kmeans, first or last");
    c.selection = *sel;
    return std::string();
  });
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
