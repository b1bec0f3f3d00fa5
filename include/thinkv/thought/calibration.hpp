#pragma once
/// \file calibration.hpp
/// Offline calibration of the thought classifier from sparsity traces (docs/calibration.md).
///
/// For every (prompt, layer) the decode steps' sparsity values are smoothed by a Gaussian kernel
/// density estimate (Silverman's bandwidth) on a fixed grid of 512 points over [0,1]; the modes of
/// the density are counted with a robustness rule; a layer qualifies on a prompt when it shows
/// exactly `num_types` modes. With at least min_prompts prompts (3 by default), the layers that
/// qualify on the most prompts (at least half) form L*, and the thresholds Theta are the density
/// minima between adjacent modes, averaged over every (prompt, chosen layer) that qualifies.
/// Bands from lowest to highest sparsity are E, R, T.
///
/// The pieces (silverman_bandwidth, kde_on_grid, find_modes) are exposed for tests and tools.

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <numeric>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "thinkv/status.hpp"
#include "thinkv/thought/classifier.hpp"
#include "thinkv/thought/trace.hpp"
#include "thinkv/types.hpp"

namespace thinkv {

// ---- constants (docs/calibration.md says why each has its value) ------------------------------

/// Grid of the KDE: kKdeGridPoints equally spaced points x_i = i / (kKdeGridPoints - 1) over
/// [0,1] (sparsity is a share, so [0,1] is its whole range; one fixed grid makes densities of
/// different prompts comparable and averageable).
inline constexpr int kKdeGridPoints = 512;
/// Smallest bandwidth: two grid steps. Below it the grid no longer resolves the kernel and every
/// sample becomes its own spike; it also keeps constant data (sd = IQR = 0) from dividing by zero.
inline constexpr double kMinBandwidth = 2.0 / (kKdeGridPoints - 1);
/// A local maximum counts as a mode only if its density is at least this share of the global max.
inline constexpr double kModeMinRelativeHeight = 0.05;
/// Two adjacent modes stay separate only if the density minimum between them is at most this share
/// of the smaller of the two peaks; otherwise they are merged (the lower peak is dropped).
inline constexpr double kModeMaxValleyRatio = 0.80;
/// A layer is eligible for L* when it qualifies on at least this share of the prompts.
inline constexpr double kMinLayerScore = 0.5;
/// Fewest decode steps a prompt must have for its KDE to mean anything.
inline constexpr int kMinStepsPerPrompt = 32;
/// Default of CalibrationOptions::min_prompts: the fewest prompts the mode rule accepts. With the
/// "qualifies on at least half of the prompts" rule, 1 prompt decides alone and 2 prompts let one
/// of them decide (1/2 is half); 3 is the fewest for which a layer must show its modes on two
/// separately recorded prompts (2/3) to be chosen, so one odd prompt cannot make L* and Theta.
inline constexpr int kDefaultMinPrompts = 3;

/// Band types from lowest to highest sparsity: {E, R, T} for 3 types, {E, T} for 2 (the third
/// entry is unused and set to T).
constexpr std::array<ThoughtType, 3> default_band_types(int num_types) noexcept {
  if (num_types == 2) { return {ThoughtType::kExecution, ThoughtType::kTransition, ThoughtType::kTransition}; }
  return {ThoughtType::kExecution, ThoughtType::kReasoning, ThoughtType::kTransition};
}

// ---- options and result ---------------------------------------------------------------------

struct CalibrationOptions {
  int num_types = 3;             ///< 3 (E, R, T) or 2 (E, T; an explicit fallback)
  int max_layers = 4;            ///< |L*| at most
  int tau = 128;                 ///< classifier refresh interval written into the result
  double bandwidth_scale = 1.0;  ///< multiplies Silverman's bandwidth (> 0)
  /// Fewest prompts the mode rule accepts (>= 1; kDefaultMinPrompts says why 3). Not applied
  /// with user_thresholds (then a note says when fewer prompts chose L*).
  int min_prompts = kDefaultMinPrompts;
  /// When not empty: the thresholds to use (num_types - 1 values, strictly ascending in (0,1));
  /// layers are still chosen by the mode rule when any layer is eligible, else all layers are.
  std::vector<float> user_thresholds;
  /// When not empty: L* itself (ascending or not, distinct layers); thresholds are then estimated
  /// from these layers' valleys on the prompts where they show num_types modes (or taken from
  /// user_thresholds).
  std::vector<int> user_layers;
  /// When not empty: the thought type of each band, lowest sparsity first (num_types distinct
  /// types), instead of the paper's order (E, R, T for 3 types; E, T for 2). For a model whose
  /// labelled traces show another order (`thinkv thoughts` measures it).
  std::vector<ThoughtType> user_band_types;
  /// Called as progress("KDE layer", done, total) after each layer (may be empty).
  std::function<void(std::string_view stage, int done, int total)> progress;
};

/// What the mode rule found for one layer across the prompts.
struct LayerReport {
  int layer = 0;
  /// mode_histogram[k] = number of prompts on which the layer's density shows k modes.
  std::vector<int> mode_histogram;
  int qualifying_prompts = 0;  ///< prompts with exactly num_types modes
  double score = 0.0;          ///< qualifying_prompts / prompts used
  /// Mean over qualifying prompts of the mean valley depth 1 - valley / min(adjacent peaks).
  double mean_valley_depth = 0.0;
  /// Mean valley positions over the qualifying prompts (num_types - 1 values; empty if none).
  std::vector<double> mean_valleys;
  bool eligible = false;  ///< score >= kMinLayerScore
  bool chosen = false;    ///< in L*
};

struct CalibrationResult {
  std::vector<float> thresholds;  ///< Theta, ascending, num_types - 1 values in (0,1)
  std::vector<int> layers;        ///< L*, ascending
  int tau = 128;
  int num_types = 3;
  std::array<ThoughtType, 3> band_types = default_band_types(3);  ///< lowest to highest sparsity
  std::string model;
  int num_layers = 0;
  /// Prompts used: every prompt of the traces, except (user thresholds only) prompts shorter
  /// than kMinStepsPerPrompt, which are left out of the layer selection (notes names them).
  int prompts = 0;
  long steps = 0;      ///< decode steps of the prompts used
  std::string date;    ///< ISO 8601 UTC, e.g. "2025-01-31T12:00:00Z"
  std::string method;  ///< "kde-silverman" or "user-thresholds"
  double bandwidth_scale = 1.0;
  std::vector<LayerReport> layer_reports;         ///< one per layer
  std::vector<std::vector<double>> mean_density;  ///< per layer: mean KDE over prompts, on the grid
  std::vector<std::string> notes;                 ///< things a user should know (fallbacks taken)
};

/// The bandwidth rule as written into calibration files.
inline std::string bandwidth_rule_text(double scale) {
  std::string s = "silverman: h = 0.9 * min(sd, IQR/1.34) * n^(-1/5)";
  if (scale != 1.0) {
    char buf[48];
    std::snprintf(buf, sizeof buf, " * %.6g", scale);
    s += buf;
  }
  char floor_buf[64];
  std::snprintf(floor_buf, sizeof floor_buf, ", h >= %.4g; grid %d points on [0,1]", kMinBandwidth, kKdeGridPoints);
  return s + floor_buf;
}

/// "YYYY-MM-DDThh:mm:ssZ" of a time point (proleptic Gregorian, UTC).
inline std::string iso8601_utc(std::chrono::system_clock::time_point tp) {
  const long long secs = std::chrono::duration_cast<std::chrono::seconds>(tp.time_since_epoch()).count();
  long long days = secs / 86400;
  long long sod = secs % 86400;
  if (sod < 0) {
    sod += 86400;
    --days;
  }
  // civil_from_days (H. Hinnant, "chrono-Compatible Low-Level Date Algorithms").
  days += 719468;
  const long long era = (days >= 0 ? days : days - 146096) / 146097;
  const long long doe = days - era * 146097;
  const long long yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
  long long y = yoe + era * 400;
  const long long doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
  const long long mp = (5 * doy + 2) / 153;
  const long long d = doy - (153 * mp + 2) / 5 + 1;
  const long long m = mp < 10 ? mp + 3 : mp - 9;
  if (m <= 2) ++y;
  char buf[64];
  std::snprintf(buf, sizeof buf, "%04lld-%02lld-%02lldT%02lld:%02lld:%02lldZ", y, m, d, sod / 3600, (sod / 60) % 60,
                sod % 60);
  return buf;
}

// ---- the pieces ---------------------------------------------------------------------------

/// Silverman's rule of thumb: h = scale * 0.9 * min(sd, IQR/1.34) * n^(-1/5), with sd the sample
/// standard deviation (n - 1), IQR from linearly interpolated quartiles; sd alone when IQR is 0;
/// never below kMinBandwidth (also returned for fewer than 2 finite samples). Non-finite samples
/// are ignored.
inline double silverman_bandwidth(std::span<const float> samples, double scale = 1.0) {
  std::vector<double> v;
  v.reserve(samples.size());
  for (float x : samples)
    if (std::isfinite(x)) v.push_back(x);
  const std::size_t n = v.size();
  if (n < 2) return kMinBandwidth;
  double mean = 0.0;
  for (double x : v) mean += x;
  mean /= static_cast<double>(n);
  double ss = 0.0;
  for (double x : v) ss += (x - mean) * (x - mean);
  const double sd = std::sqrt(ss / static_cast<double>(n - 1));
  std::sort(v.begin(), v.end());
  auto quantile = [&](double p) {
    const double pos = p * static_cast<double>(n - 1);
    const auto lo = static_cast<std::size_t>(pos);
    const std::size_t hi = std::min(lo + 1, n - 1);
    return v[lo] + (pos - static_cast<double>(lo)) * (v[hi] - v[lo]);
  };
  const double iqr = quantile(0.75) - quantile(0.25);
  const double spread = iqr > 0.0 ? std::min(sd, iqr / 1.34) : sd;
  const double h = scale * 0.9 * spread * std::pow(static_cast<double>(n), -0.2);
  return h >= kMinBandwidth ? h : kMinBandwidth;  // also catches NaN
}

/// Gaussian KDE of `samples` with bandwidth h on `grid_points` equally spaced points over [0,1]:
/// f(x) = 1/(n h) sum_j phi((x - s_j) / h). Computed by linear binning of the samples onto the
/// grid and a kernel truncated at 6h (together within 1e-3 of the peak density of the exact sum for
/// h >= 0.02, i.e. 10 grid steps; coarser near the kMinBandwidth floor).
/// Non-finite samples are ignored, samples outside [0,1] clamped; h below kMinBandwidth (or not
/// finite) is raised to it. Mass beyond [0,1] is not folded back. All zeros for no samples.
inline std::vector<double> kde_on_grid(std::span<const float> samples, double h, int grid_points = kKdeGridPoints) {
  const int G = std::max(grid_points, 2);
  std::vector<double> out(static_cast<std::size_t>(G), 0.0);
  if (!(h >= kMinBandwidth) || !std::isfinite(h)) h = kMinBandwidth;
  const double delta = 1.0 / (G - 1);
  std::vector<double> bins(static_cast<std::size_t>(G), 0.0);
  std::size_t n = 0;
  for (float s : samples) {
    if (!std::isfinite(s)) continue;
    const double x = std::clamp(static_cast<double>(s), 0.0, 1.0);
    const double pos = x * (G - 1);
    int i = static_cast<int>(pos);
    if (i >= G - 1) i = G - 2;
    const double frac = pos - i;
    bins[static_cast<std::size_t>(i)] += 1.0 - frac;
    bins[static_cast<std::size_t>(i) + 1] += frac;
    ++n;
  }
  if (n == 0) return out;
  const int K = static_cast<int>(std::min<double>(G - 1, std::ceil(6.0 * h / delta)));
  std::vector<double> kern(static_cast<std::size_t>(K) + 1);
  for (int k = 0; k <= K; ++k) {
    const double z = k * delta / h;
    kern[static_cast<std::size_t>(k)] = std::exp(-0.5 * z * z);
  }
  for (int i = 0; i < G; ++i) {
    const double w = bins[static_cast<std::size_t>(i)];
    if (w == 0.0) continue;
    const int lo = std::max(0, i - K), hi = std::min(G - 1, i + K);
    for (int j = lo; j <= hi; ++j) {
      out[static_cast<std::size_t>(j)] += w * kern[static_cast<std::size_t>(std::abs(j - i))];
    }
  }
  const double norm = 1.0 / (static_cast<double>(n) * h * std::sqrt(2.0 * 3.14159265358979323846));
  for (double& y : out) y *= norm;
  return out;
}

struct DensityMode {
  int index = 0;   ///< grid index
  double x = 0.0;  ///< position (grid position refined by a parabola through 3 points)
  double density = 0.0;
};
struct DensityValley {
  int index = 0;   ///< grid index of the minimum between two adjacent modes
  double x = 0.0;  ///< refined position (the threshold candidate)
  double density = 0.0;
  double depth = 0.0;  ///< 1 - density / min(the two adjacent peaks), in [0,1]
};
struct ModeAnalysis {
  std::vector<DensityMode> modes;      ///< ascending x
  std::vector<DensityValley> valleys;  ///< valleys[i] lies between modes[i] and modes[i+1]
};

namespace calib_detail {

/// Vertex offset in (-0.5, 0.5) grid steps of the parabola through (i-1, i, i+1).
inline double parabola_offset(std::span<const double> d, int i) {
  const int n = static_cast<int>(d.size());
  if (i <= 0 || i >= n - 1) return 0.0;
  const double a = d[static_cast<std::size_t>(i) - 1], b = d[static_cast<std::size_t>(i)],
               c = d[static_cast<std::size_t>(i) + 1];
  const double den = a - 2.0 * b + c;
  if (den == 0.0 || !std::isfinite(den)) return 0.0;
  return std::clamp(0.5 * (a - c) / den, -0.5, 0.5);
}

/// Index of the minimum of d over [a, b]; for a run of equal minimal values, its middle.
inline int valley_index(std::span<const double> d, int a, int b) {
  int best = a;
  for (int j = a + 1; j <= b; ++j)
    if (d[static_cast<std::size_t>(j)] < d[static_cast<std::size_t>(best)]) best = j;
  int end = best;
  while (end + 1 <= b && d[static_cast<std::size_t>(end) + 1] == d[static_cast<std::size_t>(best)]) ++end;
  return best + (end - best) / 2;
}

}  // namespace calib_detail

/// Modes and valleys of a density sampled on an equally spaced grid over [0,1] (x_i = i/(n-1)).
/// Rule (docs/calibration.md): local maxima (a plateau counts once, at its middle; the grid ends
/// count when the density falls away from them) with density >= min_relative_height x the global
/// max are candidates; then, repeatedly, the adjacent pair with the shallowest valley (highest
/// valley / min(peaks)) is merged, keeping the higher peak, while that ratio exceeds
/// max_valley_ratio. Valleys are the minima between the surviving adjacent modes.
inline ModeAnalysis find_modes(std::span<const double> density, double min_relative_height = kModeMinRelativeHeight,
                               double max_valley_ratio = kModeMaxValleyRatio) {
  ModeAnalysis out;
  const int n = static_cast<int>(density.size());
  if (n == 0) return out;
  double gmax = 0.0;
  for (double y : density) {
    if (!std::isfinite(y)) return out;  // not a density
    gmax = std::max(gmax, y);
  }
  if (!(gmax > 0.0)) return out;
  const double step = n > 1 ? 1.0 / (n - 1) : 0.0;
  auto d = [&](int i) { return density[static_cast<std::size_t>(i)]; };

  std::vector<int> cand;
  for (int a = 0; a < n;) {
    int b = a;
    while (b + 1 < n && d(b + 1) == d(a)) ++b;
    const bool left_lower = a == 0 || d(a - 1) < d(a);
    const bool right_lower = b == n - 1 || d(b + 1) < d(b);
    if (left_lower && right_lower && d(a) >= min_relative_height * gmax) cand.push_back(a + (b - a) / 2);
    a = b + 1;
  }

  while (cand.size() >= 2) {
    double worst = -1.0;
    std::size_t at = 0;
    for (std::size_t k = 0; k + 1 < cand.size(); ++k) {
      const int v = calib_detail::valley_index(density, cand[k], cand[k + 1]);
      const double ratio = d(v) / std::min(d(cand[k]), d(cand[k + 1]));
      if (ratio > worst) {
        worst = ratio;
        at = k;
      }
    }
    if (worst <= max_valley_ratio) break;
    // Merge: drop the lower peak of the pair (the right one on a tie).
    const std::size_t drop = d(cand[at]) >= d(cand[at + 1]) ? at + 1 : at;
    cand.erase(cand.begin() + static_cast<std::ptrdiff_t>(drop));
  }

  for (int i : cand) { out.modes.push_back({i, (i + calib_detail::parabola_offset(density, i)) * step, d(i)}); }
  for (std::size_t k = 0; k + 1 < cand.size(); ++k) {
    const int v = calib_detail::valley_index(density, cand[k], cand[k + 1]);
    const double lower_peak = std::min(d(cand[k]), d(cand[k + 1]));
    DensityValley val;
    val.index = v;
    val.x = (v + calib_detail::parabola_offset(density, v)) * step;
    val.density = d(v);
    val.depth = std::clamp(1.0 - d(v) / lower_peak, 0.0, 1.0);
    out.valleys.push_back(val);
  }
  return out;
}

// ---- calibration --------------------------------------------------------------------------

namespace calib_detail {

inline std::string fmt(double x, const char* f = "%.3g") {
  char buf[48];
  std::snprintf(buf, sizeof buf, f, x);
  return buf;
}

inline std::string list(std::span<const float> v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + fmt(v[i], "%.6g");
  return s + "]";
}

/// "1 mode on 10/12 prompts, 2 on 2/12"
inline std::string histogram_text(const std::vector<int>& hist, int prompts) {
  std::string s;
  bool first = true;
  for (std::size_t k = 0; k < hist.size(); ++k) {
    if (hist[k] == 0) continue;
    if (!first) s += ", ";
    s += std::to_string(k);
    if (first) s += k == 1 ? " mode" : " modes";
    s += " on " + std::to_string(hist[k]) + "/" + std::to_string(prompts);
    if (first) s += " prompts";
    first = false;
  }
  return s.empty() ? "no prompts" : s;
}

/// "0-3, 5, 7-9" for ascending layer indices.
inline std::string ranges_text(const std::vector<int>& v) {
  std::string s;
  for (std::size_t i = 0; i < v.size();) {
    std::size_t j = i;
    while (j + 1 < v.size() && v[j + 1] == v[j] + 1) ++j;
    if (!s.empty()) s += ", ";
    s += std::to_string(v[i]);
    if (j > i) s += (j == i + 1 ? ", " : "-") + std::to_string(v[j]);
    i = j + 1;
  }
  return s;
}

/// "layers 0-2, 5: 1 mode on 12/12 prompts; layer 3: 1 mode on 10/12 prompts, 2 on 2/12" (layers
/// with the same histogram are grouped, groups in order of their first layer).
inline std::string modes_per_layer_text(const std::vector<LayerReport>& reps, int prompts) {
  std::vector<std::string> texts;
  std::vector<std::vector<int>> groups;
  for (const LayerReport& rep : reps) {
    const std::string t = histogram_text(rep.mode_histogram, prompts);
    std::size_t g = 0;
    while (g < texts.size() && texts[g] != t) ++g;
    if (g == texts.size()) {
      texts.push_back(t);
      groups.emplace_back();
    }
    groups[g].push_back(rep.layer);
  }
  std::string s;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    if (g) s += "; ";
    s += (groups[g].size() == 1 ? "layer " : "layers ") + ranges_text(groups[g]) + ": " + texts[g];
  }
  return s;
}

inline Status invalid(std::string msg) { return {StatusCode::kInvalidArgument, std::move(msg)}; }

}  // namespace calib_detail

/// Calibrates a classifier from `trace` (docs/calibration.md). On error `out` is left unchanged
/// and the message says what was found and what to do.
inline Status calibrate(const SparsityTrace& trace, const CalibrationOptions& opt, CalibrationResult& out) {
  using calib_detail::invalid;
  const int T = opt.num_types;
  if (T != 2 && T != 3) {
    return invalid("num_types " + std::to_string(T) + " is not supported; use 3 (E, R, T) or 2 (E, T)");
  }
  if (opt.max_layers < 1) { return invalid("max_layers " + std::to_string(opt.max_layers) + " must be >= 1"); }
  if (opt.tau < 1) return invalid("tau " + std::to_string(opt.tau) + " must be >= 1");
  if (opt.min_prompts < 1) return invalid("min_prompts " + std::to_string(opt.min_prompts) + " must be >= 1");
  if (!(std::isfinite(opt.bandwidth_scale) && opt.bandwidth_scale > 0.0)) {
    return invalid("bandwidth_scale " + calib_detail::fmt(opt.bandwidth_scale) + " must be a number > 0");
  }
  const bool user = !opt.user_thresholds.empty();
  if (user) {
    const auto& u = opt.user_thresholds;
    if (static_cast<int>(u.size()) != T - 1) {
      return invalid("user thresholds " + calib_detail::list(u) + ": " + std::to_string(T) + " thought types need " +
                     std::to_string(T - 1) + " threshold" + (T == 2 ? "" : "s") + ", found " +
                     std::to_string(u.size()));
    }
    for (std::size_t i = 0; i < u.size(); ++i) {
      if (!(std::isfinite(u[i]) && u[i] > 0.0f && u[i] < 1.0f) || (i > 0 && !(u[i] > u[i - 1]))) {
        return invalid("user thresholds " + calib_detail::list(u) + " must be strictly ascending numbers in (0,1)");
      }
    }
  }
  if (!opt.user_band_types.empty()) {
    const auto& b = opt.user_band_types;
    if (static_cast<int>(b.size()) != T) {
      return invalid("band types: " + std::to_string(T) + " thought types need " + std::to_string(T) +
                     " band types, found " + std::to_string(b.size()));
    }
    for (std::size_t i = 0; i < b.size(); ++i) {
      if (static_cast<int>(b[i]) >= kNumThoughtTypes) return invalid("band type " + std::to_string(i) + " is unknown");
      for (std::size_t k = 0; k < i; ++k) {
        if (b[k] == b[i])
          return invalid("band types repeat " + std::string(to_string(b[i])) + "; each band needs its own type");
      }
    }
  }
  THINKV_RETURN_IF_ERROR(validate_sparsity_trace(trace, "calibrate: the trace"));
  for (int l : opt.user_layers) {
    if (l < 0 || l >= trace.num_layers) {
      return invalid("layer " + std::to_string(l) + " of the given L* is out of range; the traces have layers 0.." +
                     std::to_string(trace.num_layers - 1));
    }
  }
  if (trace.prompts.empty()) {
    return invalid("the traces hold no decode steps (no data rows); record traces with `thinkv trace`");
  }
  if (trace.num_layers > kMaxClassifierLayers) {
    return invalid("the traces have " + std::to_string(trace.num_layers) +
                   " layers; the thought classifier "
                   "supports at most " +
                   std::to_string(kMaxClassifierLayers) +
                   " (kMaxClassifierLayers), so no calibration file for this model could be used");
  }
  const int num_prompts = static_cast<int>(trace.prompts.size());
  if (!user && num_prompts < opt.min_prompts) {
    return invalid("only " + std::to_string(num_prompts) + (num_prompts == 1 ? " prompt" : " prompts") +
                   " in the traces; calibration needs at least " + std::to_string(opt.min_prompts) +
                   " (record more with `thinkv trace`, or pass --min-prompts " + std::to_string(num_prompts) +
                   " to accept fewer, or give --thresholds; CalibrationOptions::min_prompts / user_thresholds)");
  }

  // Prompts long enough for a KDE.
  std::vector<std::size_t> usable;
  std::vector<std::string> short_ids;
  for (std::size_t p = 0; p < trace.prompts.size(); ++p) {
    if (trace.prompts[p].num_steps() >= static_cast<std::size_t>(kMinStepsPerPrompt)) {
      usable.push_back(p);
    } else {
      short_ids.push_back("'" + trace.prompts[p].id + "' (" + std::to_string(trace.prompts[p].num_steps()) + ")");
    }
  }
  std::string short_text;
  for (std::size_t i = 0; i < short_ids.size() && i < 5; ++i) short_text += (i ? ", " : "") + short_ids[i];
  if (short_ids.size() > 5) short_text += " and " + std::to_string(short_ids.size() - 5) + " more";
  if (!user && !short_ids.empty()) {
    return invalid(std::to_string(short_ids.size()) + " of " + std::to_string(trace.prompts.size()) +
                   " prompts have fewer than " + std::to_string(kMinStepsPerPrompt) +
                   " decode steps, too few for a density estimate: " + short_text +
                   "; record longer traces (hundreds of steps per prompt) or drop those prompts");
  }

  const int L = trace.num_layers;
  const int P = static_cast<int>(usable.size());
  const auto G = static_cast<std::size_t>(kKdeGridPoints);
  CalibrationResult r;
  r.tau = opt.tau;
  r.num_types = T;
  r.band_types = default_band_types(T);
  r.model = trace.model;
  r.num_layers = L;
  r.prompts = P;
  r.steps = 0;
  for (std::size_t p : usable) r.steps += static_cast<long>(trace.prompts[p].num_steps());
  r.date = iso8601_utc(std::chrono::system_clock::now());
  r.method = user ? "user-thresholds" : "kde-silverman";
  r.bandwidth_scale = opt.bandwidth_scale;
  r.layer_reports.resize(static_cast<std::size_t>(L));
  r.mean_density.assign(static_cast<std::size_t>(L), std::vector<double>(G, 0.0));
  if (user && !short_ids.empty()) {
    r.notes.push_back("prompts with fewer than " + std::to_string(kMinStepsPerPrompt) +
                      " steps were left out of the layer selection: " + short_text);
  }
  if (user && P < opt.min_prompts) {
    r.notes.push_back("the layer selection used " + std::to_string(P) + (P == 1 ? " prompt" : " prompts") +
                      ", fewer than min_prompts " + std::to_string(opt.min_prompts) +
                      ": L* rests on little data (record more prompts with `thinkv trace`)");
  }

  // valleys[l]: the valley positions of layer l on each prompt where it qualifies.
  std::vector<std::vector<std::vector<double>>> valleys(static_cast<std::size_t>(L));
  std::vector<float> col;
  for (int l = 0; l < L; ++l) {
    LayerReport& rep = r.layer_reports[static_cast<std::size_t>(l)];
    rep.layer = l;
    double depth_sum = 0.0;
    std::vector<double> valley_sum(static_cast<std::size_t>(T - 1), 0.0);
    auto& mean = r.mean_density[static_cast<std::size_t>(l)];
    for (std::size_t p : usable) {
      const PromptTrace& pr = trace.prompts[p];
      const std::size_t n = pr.num_steps();
      col.resize(n);
      for (std::size_t i = 0; i < n; ++i) {
        col[i] = pr.values[i * static_cast<std::size_t>(L) + static_cast<std::size_t>(l)];
      }
      const double h = silverman_bandwidth(col, opt.bandwidth_scale);
      const std::vector<double> dens = kde_on_grid(col, h);
      for (std::size_t g = 0; g < G; ++g) mean[g] += dens[g] / P;
      const ModeAnalysis ma = find_modes(dens);
      const std::size_t m = ma.modes.size();
      if (rep.mode_histogram.size() <= m) rep.mode_histogram.resize(m + 1, 0);
      ++rep.mode_histogram[m];
      if (static_cast<int>(m) == T) {
        ++rep.qualifying_prompts;
        std::vector<double> xs;
        double dsum = 0.0;
        for (std::size_t k = 0; k < ma.valleys.size(); ++k) {
          xs.push_back(ma.valleys[k].x);
          valley_sum[k] += ma.valleys[k].x;
          dsum += ma.valleys[k].depth;
        }
        depth_sum += dsum / static_cast<double>(ma.valleys.size());
        valleys[static_cast<std::size_t>(l)].push_back(std::move(xs));
      }
    }
    rep.score = P > 0 ? static_cast<double>(rep.qualifying_prompts) / P : 0.0;
    if (rep.qualifying_prompts > 0) {
      rep.mean_valley_depth = depth_sum / rep.qualifying_prompts;
      for (double& v : valley_sum) v /= rep.qualifying_prompts;
      rep.mean_valleys = valley_sum;
    }
    rep.eligible = P > 0 && rep.score >= kMinLayerScore;
    if (opt.progress) opt.progress("KDE layer", l + 1, L);
  }

  // Layer selection: eligible layers by score, then mean valley depth, then lower index.
  std::vector<int> order;
  for (int l = 0; l < L; ++l)
    if (r.layer_reports[static_cast<std::size_t>(l)].eligible) order.push_back(l);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    const LayerReport& x = r.layer_reports[static_cast<std::size_t>(a)];
    const LayerReport& y = r.layer_reports[static_cast<std::size_t>(b)];
    if (x.score != y.score) return x.score > y.score;
    if (x.mean_valley_depth != y.mean_valley_depth) return x.mean_valley_depth > y.mean_valley_depth;
    return a < b;
  });
  if (order.size() > static_cast<std::size_t>(opt.max_layers)) order.resize(static_cast<std::size_t>(opt.max_layers));
  if (!opt.user_layers.empty()) {
    order = opt.user_layers;
    std::sort(order.begin(), order.end());
    order.erase(std::unique(order.begin(), order.end()), order.end());
    std::string text;
    for (int l : order) text += (text.empty() ? "" : ",") + std::to_string(l);
    r.notes.push_back("L* = {" + text + "} was given by the user, not chosen by the mode rule");
    if (!user) {
      long count = 0;
      for (int l : order) count += static_cast<long>(valleys[static_cast<std::size_t>(l)].size());
      if (count == 0) {
        return invalid("the given layers {" + text + "} show " + std::to_string(T) +
                       " modes on no prompt, so there is no valley to take thresholds from; give --thresholds");
      }
    }
  }
  if (!opt.user_band_types.empty()) {
    std::string text;
    for (int i = 0; i < T; ++i) {
      r.band_types[static_cast<std::size_t>(i)] = opt.user_band_types[static_cast<std::size_t>(i)];
      text += (i ? "," : "") + std::string(to_string(opt.user_band_types[static_cast<std::size_t>(i)]));
    }
    r.notes.push_back("band types (lowest sparsity first) " + text + " were given by the user, not the paper's order");
  }

  if (order.empty()) {
    if (!user) {
      int best = 0;
      for (int l = 1; l < L; ++l) {
        if (r.layer_reports[static_cast<std::size_t>(l)].qualifying_prompts >
            r.layer_reports[static_cast<std::size_t>(best)].qualifying_prompts) {
          best = l;
        }
      }
      const int need = static_cast<int>(std::ceil(kMinLayerScore * P));
      const int best_q = r.layer_reports[static_cast<std::size_t>(best)].qualifying_prompts;
      std::string msg = "no layer shows " + std::to_string(T) + " modes on at least half of the " + std::to_string(P) +
                        " prompts (" +
                        (best_q > 0 ? "best: layer " + std::to_string(best) + " on " + std::to_string(best_q) + "/" +
                                          std::to_string(P) + ", needs " + std::to_string(need)
                                    : "none does on any prompt") +
                        "). Modes per layer: " + calib_detail::modes_per_layer_text(r.layer_reports, P) +
                        ". To fix: record more prompts or longer traces; check that the layers are right (each "
                        "row must hold every layer's sparsity of the decoded token); or pass --types 2 or "
                        "--thresholds a,b explicitly (CalibrationOptions::num_types / user_thresholds)";
      return invalid(std::move(msg));
    }
    for (int l = 0; l < L; ++l) order.push_back(l);
    r.notes.push_back("no layer shows " + std::to_string(T) +
                      " modes on at least half of the prompts; "
                      "with user thresholds every layer is used");
  }
  std::sort(order.begin(), order.end());
  r.layers = order;
  for (int l : order) r.layer_reports[static_cast<std::size_t>(l)].chosen = true;

  if (user) {
    r.thresholds = opt.user_thresholds;
  } else {
    std::vector<double> sum(static_cast<std::size_t>(T - 1), 0.0);
    long count = 0;
    for (int l : order) {
      for (const auto& xs : valleys[static_cast<std::size_t>(l)]) {
        for (std::size_t k = 0; k < xs.size(); ++k) sum[k] += xs[k];
        ++count;
      }
    }
    for (double s : sum) r.thresholds.push_back(static_cast<float>(s / static_cast<double>(count)));
    for (std::size_t k = 0; k < r.thresholds.size(); ++k) {
      if (!(r.thresholds[k] > 0.0f && r.thresholds[k] < 1.0f) || (k > 0 && !(r.thresholds[k] > r.thresholds[k - 1]))) {
        return {StatusCode::kInternal, "calibration produced thresholds " + calib_detail::list(r.thresholds) +
                                           " that are not strictly ascending in (0,1); please report this"};
      }
    }
  }
  out = std::move(r);
  return Status::ok();
}

}  // namespace thinkv
