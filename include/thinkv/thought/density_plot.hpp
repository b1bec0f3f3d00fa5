#pragma once
/// \file density_plot.hpp
/// An SVG picture of a calibration: one panel per layer with the layer's mean sparsity density
/// (mean KDE over prompts), the chosen layers L* framed in red and labelled "L*", the thresholds
/// as dashed vertical lines with their values, band letters (E/R/T) between them, and a title
/// with the model and the provenance. Open it in a browser, or convert it with
/// `rsvg-convert densities.svg -o densities.png`.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "thinkv/status.hpp"
#include "thinkv/thought/calibration.hpp"
#include "thinkv/types.hpp"

namespace thinkv {

namespace plot_detail {

inline std::string xml_escape(std::string_view s) {
  std::string o;
  for (char c : s) {
    switch (c) {
      case '<': o += "&lt;"; break;
      case '>': o += "&gt;"; break;
      case '&': o += "&amp;"; break;
      case '"': o += "&quot;"; break;
      case '\'': o += "&apos;"; break;
      default:
        if (static_cast<unsigned char>(c) >= 0x20 || c == '\t') o += c;
    }
  }
  return o;
}

inline std::string num(double x, const char* f = "%.1f") {
  char b[40];
  std::snprintf(b, sizeof b, f, x);
  return b;
}

}  // namespace plot_detail

/// Writes the SVG of a calibration result. Needs `mean_density` (one curve per layer, as
/// `calibrate` fills it); returns kInvalidArgument otherwise.
inline Status write_density_svg(std::ostream& os, const CalibrationResult& r) {
  using plot_detail::num;
  using plot_detail::xml_escape;
  const int L = r.num_layers;
  if (L < 1 || static_cast<int>(r.mean_density.size()) != L) {
    return {StatusCode::kInvalidArgument, "write_density_svg: the result has " + std::to_string(r.mean_density.size()) +
                                              " density curves for " + std::to_string(L) +
                                              " layers; plot a result returned by calibrate()"};
  }
  const int cols = std::min(L, 8);
  const int rows = (L + cols - 1) / cols;
  const double pw = 190, ph = 130;                  // panel size
  const double ml = 12, mr = 10, mt = 34, mb = 30;  // plot area margins inside a panel
  const double gap = 10, left = 40, top = 92;
  const double width = left + cols * pw + (cols - 1) * gap + 20;
  const double height = top + rows * ph + (rows - 1) * gap + 50;
  const char* kChosen = "#d62728";
  const char* kThreshold = "#1f77b4";
  const char* kEligible = "#ff7f0e";

  std::string s;
  s += "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  s += "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + num(width, "%.0f") + "\" height=\"" +
       num(height, "%.0f") + "\" viewBox=\"0 0 " + num(width, "%.0f") + " " + num(height, "%.0f") +
       "\" font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\">\n";
  s += "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";

  // Title and provenance.
  std::string th;
  for (std::size_t i = 0; i < r.thresholds.size(); ++i) th += (i ? ", " : "") + num(r.thresholds[i], "%.3f");
  std::string ls;
  for (std::size_t i = 0; i < r.layers.size(); ++i) ls += (i ? ", " : "") + std::to_string(r.layers[i]);
  std::string bands;
  for (int i = 0; i < r.num_types; ++i)
    bands += std::string(i ? " < " : "") + std::string(to_string(r.band_types[static_cast<std::size_t>(i)]));
  s += "<text x=\"" + num(left) +
       "\" y=\"26\" font-size=\"18\" font-weight=\"bold\">ThinKV calibration: " + xml_escape(r.model) + " (" +
       std::to_string(L) + " layers)</text>\n";
  s += "<text x=\"" + num(left) + "\" y=\"46\" font-size=\"12\">thresholds " + xml_escape(th.empty() ? "-" : th) +
       "   |   L* = {" + xml_escape(ls) + "}   |   bands by sparsity: " + xml_escape(bands) + "   |   tau " +
       std::to_string(r.tau) + "</text>\n";
  s += "<text x=\"" + num(left) + "\" y=\"63\" font-size=\"11\" fill=\"#555\">" + std::to_string(r.prompts) +
       " prompts, " + std::to_string(r.steps) + " decode steps   |   method " + xml_escape(r.method) + "   |   " +
       xml_escape(bandwidth_rule_text(r.bandwidth_scale)) + "   |   " + xml_escape(r.date) + "</text>\n";
  // Legend.
  s += "<rect x=\"" + num(left) + "\" y=\"72\" width=\"14\" height=\"10\" fill=\"none\" stroke=\"" + kChosen +
       "\" stroke-width=\"2\"/><text x=\"" + num(left + 20) + "\" y=\"81\" font-size=\"11\">chosen layer (L*)</text>\n";
  s += "<line x1=\"" + num(left + 130) + "\" y1=\"77\" x2=\"" + num(left + 150) + "\" y2=\"77\" stroke=\"" +
       kThreshold + "\" stroke-width=\"1.5\" stroke-dasharray=\"4,3\"/><text x=\"" + num(left + 156) +
       "\" y=\"81\" font-size=\"11\">threshold</text>\n";
  s += "<rect x=\"" + num(left + 230) + "\" y=\"72\" width=\"14\" height=\"10\" fill=\"none\" stroke=\"" + kEligible +
       "\" stroke-width=\"1.5\" stroke-dasharray=\"5,3\"/><text x=\"" + num(left + 250) +
       "\" y=\"81\" font-size=\"11\">eligible, not chosen</text>\n";
  s += "<text x=\"" + num(left + 380) +
       "\" y=\"81\" font-size=\"11\" fill=\"#555\">curve: mean KDE over prompts, each panel scaled to its own maximum;"
       " E/R/T: thought type of each band</text>\n";

  for (int l = 0; l < L; ++l) {
    const int cx = l % cols, cy = l / cols;
    const double x0 = left + cx * (pw + gap), y0 = top + cy * (ph + gap);
    const double ax0 = x0 + ml, ax1 = x0 + pw - mr, ay0 = y0 + mt, ay1 = y0 + ph - mb;  // plot area
    const bool chosen = std::find(r.layers.begin(), r.layers.end(), l) != r.layers.end();
    const LayerReport* rep =
        static_cast<std::size_t>(l) < r.layer_reports.size() ? &r.layer_reports[static_cast<std::size_t>(l)] : nullptr;
    const bool eligible = !chosen && rep != nullptr && rep->eligible;
    s += "<g>\n";
    s += "<rect x=\"" + num(x0) + "\" y=\"" + num(y0) + "\" width=\"" + num(pw) + "\" height=\"" + num(ph) +
         "\" fill=\"" + (chosen ? "#fff5f5" : "#fafafa") + "\" stroke=\"" +
         (chosen     ? kChosen
          : eligible ? kEligible
                     : "#bbb") +
         "\" stroke-width=\"" +
         (chosen     ? "2.5"
          : eligible ? "1.5\" stroke-dasharray=\"5,3"
                     : "1") +
         "\"/>\n";
    s += "<text x=\"" + num(x0 + 6) + "\" y=\"" + num(y0 + 14) + "\" font-size=\"11\" font-weight=\"bold\">layer " +
         std::to_string(l) + "</text>\n";
    if (rep != nullptr) {
      s += "<text x=\"" + num(x0 + 60) + "\" y=\"" + num(y0 + 14) + "\" font-size=\"9\" fill=\"#555\">" +
           std::to_string(r.num_types) + " modes on " + std::to_string(rep->qualifying_prompts) + "/" +
           std::to_string(r.prompts) + "</text>\n";
      if (eligible) {
        s += "<text x=\"" + num(x0 + pw - 8) + "\" y=\"" + num(y0 + 14) + "\" font-size=\"9\" fill=\"" + kEligible +
             "\" text-anchor=\"end\">eligible</text>\n";
      }
    }
    if (chosen) {
      s += "<text x=\"" + num(x0 + pw - 8) + "\" y=\"" + num(y0 + 15) +
           "\" font-size=\"12\" font-weight=\"bold\" fill=\"" + kChosen + "\" text-anchor=\"end\">L*</text>\n";
    }
    // Axis with ticks at 0, 0.25, 0.5, 0.75, 1.
    s += "<line x1=\"" + num(ax0) + "\" y1=\"" + num(ay1) + "\" x2=\"" + num(ax1) + "\" y2=\"" + num(ay1) +
         "\" stroke=\"#333\" stroke-width=\"1\"/>\n";
    for (int t = 0; t <= 4; ++t) {
      const double tx = ax0 + (ax1 - ax0) * t / 4.0;
      s += "<line x1=\"" + num(tx) + "\" y1=\"" + num(ay1) + "\" x2=\"" + num(tx) + "\" y2=\"" + num(ay1 + 3) +
           "\" stroke=\"#333\"/>\n";
      if (t % 2 == 0) {
        s += "<text x=\"" + num(tx) + "\" y=\"" + num(ay1 + 13) + "\" font-size=\"9\" text-anchor=\"middle\">" +
             (t == 0   ? "0"
              : t == 2 ? "0.5"
                       : "1") +
             "</text>\n";
      }
    }
    s += "<text x=\"" + num((ax0 + ax1) / 2) + "\" y=\"" + num(ay1 + 24) +
         "\" font-size=\"9\" fill=\"#555\" text-anchor=\"middle\">sparsity</text>\n";
    // Threshold lines and band letters.
    double prev = 0.0;
    for (std::size_t k = 0; k <= r.thresholds.size(); ++k) {
      const double next = k < r.thresholds.size() ? static_cast<double>(r.thresholds[k]) : 1.0;
      if (k < static_cast<std::size_t>(r.num_types) && std::isfinite(next)) {
        const double bx = ax0 + (ax1 - ax0) * std::clamp((prev + next) / 2, 0.0, 1.0);
        s += "<text x=\"" + num(bx) + "\" y=\"" + num(ay0 - 3) +
             "\" font-size=\"10\" font-weight=\"bold\" fill=\"#999\" text-anchor=\"middle\">" +
             std::string(to_string(r.band_types[std::min<std::size_t>(k, 2)])) + "</text>\n";
      }
      if (k < r.thresholds.size() && std::isfinite(next)) {
        const double tx = ax0 + (ax1 - ax0) * std::clamp(next, 0.0, 1.0);
        s += "<line x1=\"" + num(tx) + "\" y1=\"" + num(ay0) + "\" x2=\"" + num(tx) + "\" y2=\"" + num(ay1) +
             "\" stroke=\"" + kThreshold + "\" stroke-width=\"1.2\" stroke-dasharray=\"4,3\"/>\n";
        s += "<text x=\"" + num(tx) + "\" y=\"" + num(ay0 - 3) + "\" font-size=\"8\" fill=\"" + kThreshold +
             "\" text-anchor=\"middle\">" + num(next, "%.3f") + "</text>\n";
      }
      prev = next;
    }
    // The curve.
    const auto& d = r.mean_density[static_cast<std::size_t>(l)];
    double dmax = 0.0;
    for (double y : d)
      if (std::isfinite(y)) dmax = std::max(dmax, y);
    if (d.size() >= 2) {
      s += "<polyline fill=\"none\" stroke=\"" + std::string(chosen ? kChosen : "#222") +
           "\" stroke-width=\"1.4\" points=\"";
      for (std::size_t i = 0; i < d.size(); ++i) {
        const double fx = static_cast<double>(i) / static_cast<double>(d.size() - 1);
        const double fy = dmax > 0.0 && std::isfinite(d[i]) ? d[i] / dmax : 0.0;
        s += num(ax0 + (ax1 - ax0) * fx) + "," + num(ay1 - (ay1 - ay0) * fy) + " ";
      }
      s += "\"/>\n";
    }
    s += "</g>\n";
  }
  s += "<text x=\"14\" y=\"" + num(top + rows * ph / 2.0) +
       "\" font-size=\"11\" fill=\"#555\" text-anchor=\"middle\" transform=\"rotate(-90 14 " +
       num(top + rows * ph / 2.0) + ")\">density (per-panel scale)</text>\n";
  s += "</svg>\n";
  os << s;
  os.flush();
  if (!os) return {StatusCode::kInvalidArgument, "write_density_svg: the output stream failed (disk full?)"};
  return Status::ok();
}

}  // namespace thinkv
