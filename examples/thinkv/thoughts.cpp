// `thinkv thoughts`: does attention sparsity separate the thought types on a model? Joins a
// sparsity trace (`thinkv trace ... --texts`) with ground-truth labels of the generated tokens
// (`--labels RULES`) and reports, per layer, the distribution of each labelled type (mean,
// median, the modes of its density), whether the order T > R > E holds, and with a calibration
// file the confusion matrix of the classifier's per-token types against the labels, plus the band
// assignment that would agree best. `--compare` measures how far the signal over one cache (e.g.
// the compressed cache at run time) is from another's (FullKV, where traces are recorded).

#include "thoughts.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "../decoder/cli_util.hpp"
#include "cache_flags.hpp"
#include "thinkv/thought/calibration.hpp"
#include "thinkv/thought/calibration_file.hpp"
#include "thinkv/thought/classifier.hpp"
#include "thinkv/thought/trace.hpp"
#include "thought_labels.hpp"

namespace {

using namespace thinkv;
using namespace thinkv::decoder::cli;
using Json = nlohmann::ordered_json;

constexpr const char* kUsage =
    "usage: thinkv thoughts TRACE.csv --texts TEXTS.jsonl --labels RULES [--calibration calib.json]\n"
    "                       [--compare TRACE2.csv --compare-texts TEXTS2.jsonl] [--md FILE] [--json FILE]\n";

constexpr const char* kHelp =
    "\n"
    "Does attention sparsity separate the thought types? TRACE.csv and TEXTS.jsonl come from one\n"
    "`thinkv trace --texts` run: step s >= 1 of a prompt's trace is the decode of its generated\n"
    "token s - 1, whose ground-truth label RULES gives (see `thinkv eval --help`).\n"
    "\n"
    "Per layer and label: tokens, mean, median and the modes of the label's sparsity density\n"
    "(the KDE of `thinkv calibrate`, pooled over prompts); the modes of the whole layer's density;\n"
    "whether the medians are in the paper's order T > R > E; the AUC of each pair (the chance that\n"
    "a token of the first label is sparser than one of the second).\n"
    "  --calibration FILE   classify every token from its own signal (the mean over L*) and print\n"
    "                       the confusion matrix against the labels, and the band-to-type\n"
    "                       assignment that would agree best\n"
    "  --compare TRACE2     the same prompts traced over another cache: per-layer mean |difference|\n"
    "                       of the signal and, with --calibration, how often both classify alike,\n"
    "  --compare-texts T2   over the decode steps where both runs had decoded the same tokens so far\n"
    "                       (T2: the other run's --texts; required with --compare)\n"
    "  --md FILE, --json FILE  the report as Markdown / JSON\n";

int usage(const std::string& m) { return usage_error("thoughts", kUsage, m); }

struct Sample {
  std::vector<float> values;  // [layers]
  int label = -1;
  std::string prompt;
  int step = 0;
};

double median(std::vector<float> x) {
  if (x.empty()) return NAN;
  std::sort(x.begin(), x.end());
  const std::size_t n = x.size();
  return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}

/// P(a > b) + 0.5 P(a == b) for a from xa, b from xb (rank-based, O(n log n)).
double auc(std::vector<float> xa, std::vector<float> xb) {
  if (xa.empty() || xb.empty()) return NAN;
  std::sort(xb.begin(), xb.end());
  double s = 0;
  for (float a : xa) {
    const auto lo = std::lower_bound(xb.begin(), xb.end(), a);
    const auto hi = std::upper_bound(xb.begin(), xb.end(), a);
    s += static_cast<double>(lo - xb.begin()) + 0.5 * static_cast<double>(hi - lo);
  }
  return s / (static_cast<double>(xa.size()) * static_cast<double>(xb.size()));
}

std::vector<double> modes_of(const std::vector<float>& x) {
  std::vector<double> out;
  if (x.size() < 2) return out;
  const double h = silverman_bandwidth(x);
  const auto dens = kde_on_grid(x, h);
  for (const DensityMode& m : find_modes(dens).modes) out.push_back(m.x);
  return out;
}

std::string list(const std::vector<double>& v) {
  std::string s;
  for (double x : v) s += (s.empty() ? "" : " ") + fmt("%.2f", x);
  return s.empty() ? "-" : s;
}

}  // namespace

int run_thoughts(int argc, char** argv) {
  std::string trace_path, texts, labels, calib, compare, compare_texts, md, json_out;
  bool help = false;
  decoder::cli::ArgParser p("thoughts", kUsage);
  p.app().add_option("trace", trace_path);
  p.text("--texts", texts, "a file");
  p.text("--labels", labels, "a rules file");
  p.text("--calibration", calib, "a file");
  p.text("--compare", compare, "a trace file");
  p.text("--compare-texts", compare_texts, "a file");
  p.text("--md", md, "a file");
  p.text("--json", json_out, "a file");
  if (const int rc = p.parse(argc, argv); rc != 0) return rc;
  help = p.help();
  if (help) {
    std::printf("%s%s", kUsage, kHelp);
    return 0;
  }
  if (trace_path.empty()) return usage("no trace given");
  if (texts.empty() || labels.empty()) return usage("--texts and --labels are required");
  auto fail = [](const std::string& m) {
    std::fprintf(stderr, "thinkv thoughts: %s\n", m.c_str());
    return kExitData;
  };
  SparsityTrace trace;
  if (Status s = read_sparsity_trace(std::filesystem::path(trace_path), trace); !s.is_ok()) return fail(s.message());
  std::vector<LabelRule> rules;
  std::string err;
  if (!read_label_rules(labels, rules, err)) return fail(err);
  if (!compare.empty() && compare_texts.empty())
    return usage("--compare needs --compare-texts (the other run's texts)");
  // Generated pieces per prompt id.
  std::map<std::string, std::vector<std::string>> pieces, other_pieces;
  for (const auto& [file, dst] : {std::pair<const std::string*, decltype(&pieces)>{&texts, &pieces},
                                  std::pair<const std::string*, decltype(&pieces)>{&compare_texts, &other_pieces}}) {
    if (file->empty()) continue;
    const std::string& texts = *file;
    auto& pieces = *dst;
    std::ifstream f(texts);
    if (!f) return fail(texts + ": cannot open");
    std::string line;
    int no = 0;
    while (std::getline(f, line)) {
      ++no;
      if (line.empty()) continue;
      Json j;
      try {
        j = Json::parse(line);
      } catch (const Json::parse_error& e) {
        return fail(texts + ":" + std::to_string(no) + ": not JSON (" + e.what() + ")");
      }
      if (!j.contains("id") || !j.contains("pieces") || !j["pieces"].is_array())
        return fail(texts + ":" + std::to_string(no) +
                    ": needs \"id\" and \"pieces\" (written by `thinkv trace --texts`)");
      std::vector<std::string> p;
      for (const auto& x : j["pieces"]) p.push_back(x.get<std::string>());
      pieces[j["id"].get<std::string>()] = std::move(p);
    }
  }
  const int L = trace.num_layers;
  std::vector<Sample> samples;
  for (const PromptTrace& pt : trace.prompts) {
    const auto it = pieces.find(pt.id);
    if (it == pieces.end()) return fail(texts + " has no text for prompt '" + pt.id + "' of " + trace_path);
    const std::vector<int> lab = label_tokens(rules, it->second);
    for (std::size_t i = 0; i < pt.steps.size(); ++i) {
      const int s = pt.steps[i];
      if (s < 1 || static_cast<std::size_t>(s - 1) >= lab.size()) continue;
      Sample x;
      x.values.assign(pt.values.begin() + static_cast<std::ptrdiff_t>(i) * L,
                      pt.values.begin() + static_cast<std::ptrdiff_t>(i + 1) * L);
      x.label = lab[static_cast<std::size_t>(s - 1)];
      x.prompt = pt.id;
      x.step = s;
      if (x.label >= 0) samples.push_back(std::move(x));
    }
  }
  if (samples.empty()) return fail("no labelled decode steps (do the trace and the texts come from one run?)");
  std::ostringstream rep;
  Json j;
  j["trace"] = trace_path;
  j["model"] = trace.model;
  j["labelled_steps"] = samples.size();
  std::array<std::int64_t, 3> count{};
  for (const Sample& s : samples) ++count[static_cast<std::size_t>(s.label)];
  rep << "model " << trace.model << ", " << trace.prompts.size() << " prompts, " << samples.size()
      << " labelled decode steps: R " << count[0] << ", E " << count[1] << ", T " << count[2] << "\n\n";
  rep << "| layer | modes (all) | R mean / median / modes | E mean / median / modes | T mean / median / modes | T>R>E "
         "| AUC T>R | AUC R>E | AUC T>E |\n";
  rep << "|---|---|---|---|---|---|---:|---:|---:|\n";
  Json lj = Json::array();
  for (int l = 0; l < L; ++l) {
    std::array<std::vector<float>, 3> x;
    std::vector<float> all;
    for (const Sample& s : samples) {
      x[static_cast<std::size_t>(s.label)].push_back(s.values[static_cast<std::size_t>(l)]);
      all.push_back(s.values[static_cast<std::size_t>(l)]);
    }
    Json e;
    e["layer"] = l;
    e["modes_all"] = modes_of(all);
    rep << "| " << l << " | " << list(modes_of(all)) << " |";
    std::array<double, 3> med{};
    for (int t = 0; t < 3; ++t) {
      const auto& v = x[static_cast<std::size_t>(t)];
      double mean = 0;
      for (float f : v) mean += f;
      mean = v.empty() ? NAN : mean / static_cast<double>(v.size());
      med[static_cast<std::size_t>(t)] = median(v);
      const auto m = modes_of(v);
      rep << " " << fmt("%.3f", mean) << " / " << fmt("%.3f", med[static_cast<std::size_t>(t)]) << " / " << list(m)
          << " |";
      e[std::string(to_string(static_cast<ThoughtType>(t)))] = {
          {"n", v.size()}, {"mean", mean}, {"median", med[static_cast<std::size_t>(t)]}, {"modes", m}};
    }
    const bool order = med[2] > med[0] && med[0] > med[1];
    const double a_tr = auc(x[2], x[0]), a_re = auc(x[0], x[1]), a_te = auc(x[2], x[1]);
    rep << " " << (order ? "yes" : "no") << " | " << fmt("%.2f", a_tr) << " | " << fmt("%.2f", a_re) << " | "
        << fmt("%.2f", a_te) << " |\n";
    e["order_T_R_E"] = order;
    e["auc_T_gt_R"] = a_tr;
    e["auc_R_gt_E"] = a_re;
    e["auc_T_gt_E"] = a_te;
    lj.push_back(e);
  }
  j["layers"] = lj;

  // A label-informed classifier: for each layer, bands ordered by the labels' medians with
  // thresholds at the midpoints between consecutive medians; the layer whose bands agree best
  // with the labels (per-token, each token from its own value) is suggested, with the
  // `thinkv calibrate` command that writes it.
  {
    int best_layer = -1;
    double best_acc = -1;
    std::array<int, 3> best_order{};
    std::array<float, 2> best_thr{};
    for (int l = 0; l < L; ++l) {
      std::array<std::vector<float>, 3> x;
      for (const Sample& s : samples)
        x[static_cast<std::size_t>(s.label)].push_back(s.values[static_cast<std::size_t>(l)]);
      if (x[0].empty() || x[1].empty() || x[2].empty()) continue;
      std::array<int, 3> order{0, 1, 2};
      std::array<double, 3> med{median(x[0]), median(x[1]), median(x[2])};
      std::sort(order.begin(), order.end(),
                [&](int a, int b) { return med[static_cast<std::size_t>(a)] < med[static_cast<std::size_t>(b)]; });
      const std::array<float, 2> thr{
          static_cast<float>(0.5 * (med[static_cast<std::size_t>(order[0])] + med[static_cast<std::size_t>(order[1])])),
          static_cast<float>(0.5 *
                             (med[static_cast<std::size_t>(order[1])] + med[static_cast<std::size_t>(order[2])]))};
      if (!(thr[0] > 0.0f && thr[1] > thr[0] && thr[1] < 1.0f)) continue;
      std::int64_t agree = 0;
      for (const Sample& s : samples) {
        const float v = s.values[static_cast<std::size_t>(l)];
        const int band = (v >= thr[0]) + (v >= thr[1]);
        agree += order[static_cast<std::size_t>(band)] == s.label;
      }
      const double acc = static_cast<double>(agree) / static_cast<double>(samples.size());
      if (acc > best_acc) {
        best_acc = acc;
        best_layer = l;
        best_order = order;
        best_thr = thr;
      }
    }
    if (best_layer >= 0) {
      std::string types;
      for (int b = 0; b < 3; ++b)
        types +=
            (b ? "," : "") + std::string(to_string(static_cast<ThoughtType>(best_order[static_cast<std::size_t>(b)])));
      rep << "\nlabel-informed classifier: layer " << best_layer << ", bands " << types
          << " (lowest sparsity first), thresholds " << fmt("%.4f", best_thr[0]) << ", " << fmt("%.4f", best_thr[1])
          << " (midpoints of the labels' medians): agreement " << fmt("%.1f", 100.0 * best_acc)
          << " % per token\n  thinkv calibrate " << trace_path << " -o calib.json --types 3 --layers " << best_layer
          << " --thresholds " << fmt("%.4f", best_thr[0]) << "," << fmt("%.4f", best_thr[1]) << " --band-types "
          << types << "\n";
      j["label_informed"] = {{"layer", best_layer},
                             {"band_types", types},
                             {"thresholds", {best_thr[0], best_thr[1]}},
                             {"agreement", best_acc}};
    }
  }

  ThoughtClassifier cl;
  bool have_cl = false;
  if (!calib.empty()) {
    CalibrationFile f;
    if (Status s = read_calibration_json(std::filesystem::path(calib), f); !s.is_ok()) return fail(s.message());
    if (f.num_layers != L) {
      return fail(calib + " is for " + std::to_string(f.num_layers) + " layers; the trace has " + std::to_string(L));
    }
    try {
      std::vector<ThoughtType> bands(f.band_types.begin(), f.band_types.begin() + f.num_types);
      cl = ThoughtClassifier(f.thresholds, f.layers, f.tau, bands, f.num_layers);
    } catch (const ConfigError& e) { return fail(calib + ": " + e.what()); }
    have_cl = cl.needs_signal();
  }
  auto signal = [&](const std::vector<float>& v) { return cl.signal(v); };  // the run-time computation
  if (have_cl) {
    const int bands = static_cast<int>(cl.band_types().size());
    std::vector<std::array<std::int64_t, 3>> by_band(static_cast<std::size_t>(bands), std::array<std::int64_t, 3>{});
    std::int64_t conf[3][3] = {};
    for (const Sample& s : samples) {
      const float sig = signal(s.values);
      int band = 0;
      for (float t : cl.thresholds()) band += sig >= t ? 1 : 0;
      ++by_band[static_cast<std::size_t>(band)][static_cast<std::size_t>(s.label)];
      ++conf[s.label][static_cast<int>(cl.band_types()[static_cast<std::size_t>(band)])];
    }
    std::int64_t agree = 0;
    for (int t = 0; t < 3; ++t) agree += conf[t][t];
    rep << "\nclassifier " << cl.to_string() << " from " << calib << ", each token classified from its own signal:\n\n";
    rep << "| label \\ type | R | E | T | recall |\n|---|---:|---:|---:|---:|\n";
    Json cm = Json::array();
    for (int t = 0; t < 3; ++t) {
      const std::int64_t row = conf[t][0] + conf[t][1] + conf[t][2];
      rep << "| " << to_string(static_cast<ThoughtType>(t)) << " | " << conf[t][0] << " | " << conf[t][1] << " | "
          << conf[t][2] << " | " << (row ? fmt("%.1f", 100.0 * conf[t][t] / row) + " %" : "-") << " |\n";
      cm.push_back({conf[t][0], conf[t][1], conf[t][2]});
    }
    rep << "\nagreement with the labels: " << fmt("%.1f", 100.0 * agree / static_cast<double>(samples.size()))
        << " %\n";
    // The best band -> type assignment (every injective map of bands to types).
    std::array<int, 3> perm{0, 1, 2};
    std::int64_t best = -1;
    std::string best_text;
    do {
      std::int64_t a = 0;
      std::string txt;
      for (int b = 0; b < bands; ++b) {
        a += by_band[static_cast<std::size_t>(b)][static_cast<std::size_t>(perm[static_cast<std::size_t>(b)])];
        txt += (b ? "," : "") + std::string(to_string(static_cast<ThoughtType>(perm[static_cast<std::size_t>(b)])));
      }
      if (a > best) {
        best = a;
        best_text = txt;
      }
    } while (std::next_permutation(perm.begin(), perm.end()));
    rep << "labels per band (lowest sparsity first):";
    for (int b = 0; b < bands; ++b) {
      rep << " [" << to_string(cl.band_types()[static_cast<std::size_t>(b)]) << ": R "
          << by_band[static_cast<std::size_t>(b)][0] << ", E " << by_band[static_cast<std::size_t>(b)][1] << ", T "
          << by_band[static_cast<std::size_t>(b)][2] << "]";
    }
    rep << "\nbest band types (lowest sparsity first): " << best_text << ", agreement "
        << fmt("%.1f", 100.0 * best / static_cast<double>(samples.size())) << " %\n";
    j["classifier"] = cl.to_string();
    j["confusion_label_by_type"] = cm;
    j["agreement"] = static_cast<double>(agree) / static_cast<double>(samples.size());
    j["best_band_types"] = best_text;
    j["best_agreement"] = static_cast<double>(best) / static_cast<double>(samples.size());
  }
  if (!compare.empty()) {
    SparsityTrace other;
    if (Status s = read_sparsity_trace(std::filesystem::path(compare), other); !s.is_ok()) return fail(s.message());
    if (other.num_layers != L) return fail(compare + " has another layer count");
    std::map<std::pair<std::string, int>, const float*> rows;
    for (const PromptTrace& pt : other.prompts) {
      for (std::size_t i = 0; i < pt.steps.size(); ++i)
        rows[{pt.id, pt.steps[i]}] = pt.values.data() + i * static_cast<std::size_t>(L);
    }
    // The step up to which both runs decoded the same tokens, per prompt.
    std::map<std::string, int> same_until;
    for (const auto& [id, pa] : pieces) {
      const auto it = other_pieces.find(id);
      if (it == other_pieces.end()) continue;
      std::size_t k = 0;
      while (k < pa.size() && k < it->second.size() && pa[k] == it->second[k]) ++k;
      same_until[id] = static_cast<int>(k);
    }
    std::vector<double> diff(static_cast<std::size_t>(L), 0.0);
    std::int64_t matched = 0, same_type = 0;
    for (const Sample& s : samples) {
      const auto it = rows.find({s.prompt, s.step});
      const auto su = same_until.find(s.prompt);
      if (it == rows.end() || su == same_until.end() || s.step > su->second) continue;
      ++matched;
      std::vector<float> ov(it->second, it->second + L);
      for (int l = 0; l < L; ++l)
        diff[static_cast<std::size_t>(l)] +=
            std::fabs(ov[static_cast<std::size_t>(l)] - s.values[static_cast<std::size_t>(l)]);
      if (have_cl) same_type += cl.classify(signal(ov)) == cl.classify(signal(s.values));
    }
    rep << "\nagainst " << compare << " (" << matched << " decode steps where both runs had decoded the same tokens):\n"
        << "mean |difference| per layer:";
    Json dj = Json::array();
    for (int l = 0; l < L; ++l) {
      const double d = matched ? diff[static_cast<std::size_t>(l)] / static_cast<double>(matched) : NAN;
      rep << " l" << l << " " << fmt("%.3f", d);
      dj.push_back(d);
    }
    rep << "\n";
    j["compare"] = {{"trace", compare}, {"matched_steps", matched}, {"mean_abs_difference", dj}};
    if (have_cl && matched) {
      rep << "the classifier gives the same type on " << fmt("%.1f", 100.0 * same_type / static_cast<double>(matched))
          << " % of them\n";
      j["compare"]["same_type"] = static_cast<double>(same_type) / static_cast<double>(matched);
    }
  }
  if (!md.empty()) {
    if (const std::string e = write_file_atomic(md, rep.str()); !e.empty()) return fail(e);
  }
  if (!json_out.empty()) {
    if (const std::string e = write_file_atomic(json_out, j.dump(1) + "\n"); !e.empty()) return fail(e);
  }
  std::printf("%s", rep.str().c_str());
  return 0;
}
