// `thinkv calibrate TRACES... -o calib.json [options]`: reads sparsity traces, runs the offline
// calibration (thinkv/thought/calibration.hpp), writes the calibration JSON and, when asked, an
// SVG of the per-layer densities. See docs/calibration.md.

#include "calibrate.hpp"
#include "cache_flags.hpp"

#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "../decoder/progress.hpp"
#include "thinkv/status.hpp"
#include "thinkv/thought/calibration.hpp"
#include "thinkv/thought/calibration_file.hpp"
#include "thinkv/thought/density_plot.hpp"
#include "thinkv/thought/trace.hpp"

namespace {

constexpr int kExitData = 1;
constexpr int kExitUsage = 2;

constexpr const char* kUsage =
    "usage: thinkv calibrate TRACE... -o CALIB.json [--plot DENSITIES.svg] [--types 3|2]\n"
    "                        [--max-layers N] [--tau N] [--thresholds a[,b]] [--min-prompts N]\n"
    "                        [--layers a[,b...]] [--band-types X,Y[,Z]] [--group G]\n"
    "                        [--bandwidth-scale X] [--progress] [--quiet] [--verbose]\n";

constexpr const char* kHelp =
    "\n"
    "Calibrates ThinKV's thought classifier from sparsity traces (CSV files recorded from a\n"
    "model, see docs/calibration.md): for each layer and prompt a Gaussian KDE of the decode\n"
    "steps' attention sparsity; layers whose density shows one mode per thought type on at\n"
    "least half of the prompts are candidates; the best (up to --max-layers) form L*, and the\n"
    "density minima between the modes, averaged, are the thresholds.\n"
    "\n"
    "  TRACE...               trace files of one model (several files are merged)\n"
    "  -o, --output PATH      calibration file to write ('-' for stdout)\n"
    "  --plot PATH            also write an SVG of each layer's mean density, L* and thresholds\n"
    "  --types 3|2            thought types: 3 = E, R, T (default); 2 = E, T (a fallback when\n"
    "                         no layer shows three modes)\n"
    "  --max-layers N         at most N layers in L* (default 4)\n"
    "  --tau N                classifier refresh interval written to the file (default 128); a\n"
    "                         multiple of the cache's quantization group, as `thinkv generate` needs\n"
    "  --group G              that group: 8, 16 (default) or 32\n"
    "  --thresholds a[,b]     use these thresholds (ascending, in (0,1); types-1 values) instead\n"
    "                         of estimating them; layers are still chosen by the mode rule when\n"
    "                         possible, else all layers are used\n"
    "  --layers a[,b...]      use these layers as L* instead of choosing them by the mode rule\n"
    "  --band-types X,Y[,Z]   thought type of each band, lowest sparsity first, instead of the\n"
    "                         paper's order (E,R,T; E,T for --types 2): for a model whose labelled\n"
    "                         traces show another order (`thinkv thoughts` measures it)\n"
    "  --min-prompts N        refuse to estimate thresholds from fewer than N prompts (default 3:\n"
    "                         the fewest for which a layer must show its modes on two prompts)\n"
    "  --bandwidth-scale X    multiply Silverman's KDE bandwidth by X (default 1; > 1 smooths more)\n"
    "  --progress             show progress even when stderr is not a terminal\n"
    "  -q, --quiet            no progress and no per-layer report (the summary line stays)\n"
    "  -v, --verbose          print the per-layer report (modes per prompt, score, depth)\n"
    "  -h, --help             this help\n"
    "\n"
    "Exit status: 0 ok, 1 data error (bad trace, calibration failed, output not writable),\n"
    "2 usage error.\n"
    "\n"
    "Example:\n"
    "  thinkv calibrate traces/*.csv -o calib.json --plot densities.svg\n"
    "  rsvg-convert densities.svg -o densities.png   # to look at the densities\n";

struct Args {
  std::vector<std::string> traces;
  std::string output;
  std::string plot;
  int types = 3;
  int max_layers = 4;
  int tau = 128;
  int group = 16;  ///< the cache's quantization group the file will be used with
  int min_prompts = thinkv::kDefaultMinPrompts;
  std::vector<float> thresholds;
  std::vector<int> layers;
  std::vector<thinkv::ThoughtType> band_types;
  double bandwidth_scale = 1.0;
  bool progress = false;
  bool quiet = false;
  bool verbose = false;
  bool help = false;
};

/// Prints "thinkv calibrate: msg" and the usage; returns the usage exit status.
int usage_error(const std::string& msg) { return thinkv::decoder::cli::usage_error("calibrate", kUsage, msg); }

bool parse_double(std::string_view s, double& out) {
  double x = 0;
  const auto r = std::from_chars(s.data(), s.data() + s.size(), x);
  if (r.ec != std::errc() || r.ptr != s.data() + s.size() || !std::isfinite(x)) return false;
  out = x;
  return true;
}

/// Parses the command line; returns 0 or the usage exit status (message printed).
int parse_args(int argc, char** argv, Args& a) {
  using thinkv::decoder::cli::parse_int;
  thinkv::decoder::cli::ArgParser p("calibrate", kUsage);
  std::string thresholds_text;
  p.app().add_option("traces", a.traces)->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  p.flag("-q,--quiet", a.quiet);
  p.flag("-v,--verbose", a.verbose);
  p.flag("--progress", a.progress);
  p.text("-o,--output", a.output, "a file name");
  p.text("--plot", a.plot, "a file name");
  p.integer("--types", a.types, 2, 3, "must be 3 (E, R, T) or 2 (E, T)");
  p.integer("--max-layers", a.max_layers, 1, thinkv::kMaxTraceLayers, "must be an integer >= 1");
  p.integer("--tau", a.tau, 1, 1 << 30, "must be an integer >= 1");
  p.value("--group", [&a](const std::string& v) {
    return parse_int(v, 1, 64, a.group) && (a.group == 8 || a.group == 16 || a.group == 32)
               ? std::string()
               : std::string("must be 8, 16 or 32");
  });
  p.integer("--min-prompts", a.min_prompts, 1, 1 << 30, "must be an integer >= 1");
  p.value("--bandwidth-scale", [&a](const std::string& v) {
    return parse_double(v, a.bandwidth_scale) && a.bandwidth_scale > 0.0 ? std::string()
                                                                         : std::string("must be a number > 0");
  });
  p.value("--layers", [&a](const std::string& v) {
    if (v.empty()) return std::string("needs layer indices, e.g. --layers 2,4");
    a.layers.clear();
    std::string_view rest = v;
    for (;;) {
      const auto comma = rest.find(',');
      int l = 0;
      if (!parse_int(rest.substr(0, comma), 0, thinkv::kMaxTraceLayers - 1, l)) {
        return "'" + std::string(rest.substr(0, comma)) + "' is not a layer index";
      }
      a.layers.push_back(l);
      if (comma == std::string_view::npos) return std::string();
      rest.remove_prefix(comma + 1);
    }
  });
  p.value("--band-types", [&a](const std::string& v) {
    if (v.empty()) return std::string("needs types, e.g. --band-types E,R,T");
    a.band_types.clear();
    std::string_view rest = v;
    for (;;) {
      const auto comma = rest.find(',');
      const std::string_view t = rest.substr(0, comma);
      if (t == "R")
        a.band_types.push_back(thinkv::ThoughtType::kReasoning);
      else if (t == "E")
        a.band_types.push_back(thinkv::ThoughtType::kExecution);
      else if (t == "T")
        a.band_types.push_back(thinkv::ThoughtType::kTransition);
      else
        return "'" + std::string(t) + "' is not R, E or T";
      if (comma == std::string_view::npos) return std::string();
      rest.remove_prefix(comma + 1);
    }
  });
  p.text("--thresholds", thresholds_text, "values, e.g. --thresholds 0.4,0.7");
  if (const int rc = p.parse(argc, argv); rc != 0) return rc;
  a.help = p.help();
  if (a.help) return 0;
  if (a.tau % a.group != 0) {
    return usage_error("--tau " + std::to_string(a.tau) + " is not a multiple of the quantization group " +
                       std::to_string(a.group) +
                       "; `thinkv generate` would refuse the file (a thought changes "
                       "type only at a group boundary): use a multiple of " +
                       std::to_string(a.group) + ", or --group for the cache it will be used with");
  }
  if (!thresholds_text.empty()) {
    std::string_view rest = thresholds_text;
    for (;;) {
      const auto comma = rest.find(',');
      double x = 0;
      if (!parse_double(rest.substr(0, comma), x) || !(x > 0.0 && x < 1.0)) {
        return usage_error("--thresholds " + thresholds_text + ": '" + std::string(rest.substr(0, comma)) +
                           "' is not a number in (0,1)");
      }
      a.thresholds.push_back(static_cast<float>(x));
      if (comma == std::string_view::npos) break;
      rest.remove_prefix(comma + 1);
    }
    if (static_cast<int>(a.thresholds.size()) != a.types - 1) {
      return usage_error("--thresholds " + thresholds_text + ": " + std::to_string(a.types) + " types need " +
                         std::to_string(a.types - 1) + " threshold" + (a.types == 2 ? "" : "s") + ", found " +
                         std::to_string(a.thresholds.size()));
    }
    for (std::size_t k = 1; k < a.thresholds.size(); ++k) {
      if (!(a.thresholds[k] > a.thresholds[k - 1])) {
        return usage_error("--thresholds " + thresholds_text + ": thresholds must be strictly ascending");
      }
    }
  }
  if (a.traces.empty()) return usage_error("no trace files given");
  if (a.output.empty()) return usage_error("no output file given (-o calib.json)");
  return 0;
}

std::string fmt_thresholds(const std::vector<float>& t) {
  std::string s = "[";
  for (std::size_t i = 0; i < t.size(); ++i) {
    char b[32];
    std::snprintf(b, sizeof b, "%.4f", static_cast<double>(t[i]));
    s += (i ? ", " : "") + std::string(b);
  }
  return s + "]";
}

std::string fmt_layers(const std::vector<int>& l) {
  std::string s = "{";
  for (std::size_t i = 0; i < l.size(); ++i) s += (i ? ", " : "") + std::to_string(l[i]);
  return s + "}";
}

void print_layer_report(const thinkv::CalibrationResult& r) {
  std::fprintf(stderr, "calibrate: layer  score  depth  modes per prompt (count: prompts)\n");
  for (const auto& rep : r.layer_reports) {
    std::string hist;
    for (std::size_t k = 0; k < rep.mode_histogram.size(); ++k) {
      if (rep.mode_histogram[k] == 0) continue;
      hist += (hist.empty() ? "" : ", ") + std::to_string(k) + ": " + std::to_string(rep.mode_histogram[k]);
    }
    std::fprintf(stderr, "calibrate: %5d  %5.2f  %5.2f  %s%s\n", rep.layer, rep.score, rep.mean_valley_depth,
                 hist.c_str(), rep.chosen ? "   <- L*" : "");
  }
}

/// Writes `content` through `write` to `path` ('-' = stdout). Returns 0 or kExitData.
template <class Writer>
int write_output(const std::string& path, const char* what, Writer&& write) {
  std::ostringstream buf;
  const thinkv::Status s = write(buf);
  if (!s.is_ok()) {
    std::fprintf(stderr, "thinkv calibrate: %s\n", s.message().c_str());
    return kExitData;
  }
  if (path == "-") {
    std::cout << buf.str();
    std::cout.flush();
    if (!std::cout) {
      std::fprintf(stderr, "thinkv calibrate: writing the %s to stdout failed\n", what);
      return kExitData;
    }
    return 0;
  }
  // Through a temporary file and a rename: a failed write leaves no partial file.
  if (const std::string e = thinkv::decoder::cli::write_file_atomic(path, buf.str()); !e.empty()) {
    std::fprintf(stderr, "thinkv calibrate: the %s: %s\n", what, e.c_str());
    return kExitData;
  }
  return 0;
}

}  // namespace

int run_calibrate(int argc, char** argv) {
  Args a;
  if (const int rc = parse_args(argc, argv, a); rc != 0) return rc;
  if (a.help) {
    std::printf("%s%s", kUsage, kHelp);
    return 0;
  }
  thinkv::cli::Progress progress(!a.quiet && (a.progress || isatty(STDERR_FILENO) != 0), "calibrate: ");

  // Read and merge the traces.
  std::vector<thinkv::SparsityTrace> parts(a.traces.size());
  for (std::size_t i = 0; i < a.traces.size(); ++i) {
    progress.update("reading " + std::to_string(i + 1) + "/" + std::to_string(a.traces.size()) + " files (" +
                    a.traces[i] + ") ...");
    thinkv::Status s;
    if (a.traces[i] == "-") {
      s = thinkv::read_sparsity_trace(std::cin, "<stdin>", parts[i]);
    } else {
      s = thinkv::read_sparsity_trace(std::filesystem::path(a.traces[i]), parts[i]);
    }
    if (!s.is_ok()) {
      progress.clear();
      std::fprintf(stderr, "thinkv calibrate: %s\n", s.message().c_str());
      return kExitData;
    }
  }
  thinkv::SparsityTrace trace;
  if (const thinkv::Status s = thinkv::merge_traces(parts, a.traces, trace); !s.is_ok()) {
    progress.clear();
    std::fprintf(stderr, "thinkv calibrate: %s\n", s.message().c_str());
    return kExitData;
  }
  parts.clear();

  // Calibrate.
  thinkv::CalibrationOptions opt;
  opt.num_types = a.types;
  opt.max_layers = a.max_layers;
  opt.tau = a.tau;
  opt.min_prompts = a.min_prompts;
  opt.bandwidth_scale = a.bandwidth_scale;
  opt.user_thresholds = a.thresholds;
  opt.user_layers = a.layers;
  opt.user_band_types = a.band_types;
  opt.progress = [&](std::string_view stage, int done, int total) {
    progress.update(std::string(stage) + " " + std::to_string(done) + "/" + std::to_string(total), done == total);
  };
  thinkv::CalibrationResult result;
  const thinkv::Status cs = thinkv::calibrate(trace, opt, result);
  progress.clear();
  if (!cs.is_ok()) {
    std::fprintf(stderr, "thinkv calibrate: calibration failed for %s (%d layers, %zu prompt%s, %ld steps): %s\n",
                 trace.model.c_str(), trace.num_layers, trace.prompts.size(), trace.prompts.size() == 1 ? "" : "s",
                 trace.total_steps(), cs.message().c_str());
    return kExitData;
  }

  if (int rc = write_output(a.output, "calibration file",
                            [&](std::ostream& os) { return thinkv::write_calibration_json(os, result); });
      rc != 0) {
    return rc;
  }
  if (!a.plot.empty()) {
    if (int rc = write_output(a.plot, "plot", [&](std::ostream& os) { return thinkv::write_density_svg(os, result); });
        rc != 0) {
      return rc;
    }
  }

  if (a.verbose && !a.quiet) print_layer_report(result);
  for (const auto& note : result.notes) std::fprintf(stderr, "calibrate: note: %s\n", note.c_str());
  std::string bands;
  for (int i = 0; i < result.num_types; ++i) {
    bands +=
        std::string(i ? " < " : "") + std::string(thinkv::to_string(result.band_types[static_cast<std::size_t>(i)]));
  }
  std::fprintf(stderr,
               "calibrate: %s (%d layers): L* = %s, thresholds %s (%s by sparsity, %s), %d prompt%s, %ld steps "
               "-> %s%s%s\n",
               result.model.c_str(), result.num_layers, fmt_layers(result.layers).c_str(),
               fmt_thresholds(result.thresholds).c_str(), bands.c_str(), result.method.c_str(), result.prompts,
               result.prompts == 1 ? "" : "s", result.steps, a.output == "-" ? "<stdout>" : a.output.c_str(),
               a.plot.empty() ? "" : ", ", a.plot.c_str());
  return 0;
}
