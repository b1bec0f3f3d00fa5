// `thinkv eval`: accuracy against KV memory over a set of problems, for every KV-cache method and
// budget of a sweep (FullKV FP16 always runs, as the reference). Flags and output fields:
// examples/thinkv/README.md.

#include "eval.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "../decoder/cli_util.hpp"
#include "../decoder/decoder.hpp"
#include "cache_flags.hpp"
#include "thought_labels.hpp"

namespace {

using namespace thinkv;
using namespace thinkv::decoder;
using namespace thinkv::decoder::cli;
using Json = nlohmann::ordered_json;

constexpr const char* kUsage =
    "usage: thinkv eval --model PATH --problems FILE.jsonl [--methods M,...] [--budgets K,...]\n"
    "                   [--answer-pattern REGEX] [--limit N] [--offset K] [--max-steps N]\n"
    "                   [--calibration calib.json] [--precision R4E4T2] [--group G] [--segment L]\n"
    "                   [--tau T] [--labels RULES] [--kl] [--keep-prompt | --compress-prompt]\n"
    "                   [--jobs N] [--threads N]\n"
    "                   [--json FILE] [--md FILE] [--svg FILE] [--generations FILE]\n"
    "                   [--tokenizer PATH] [--progress | --no-progress] [--quiet]\n";

constexpr const char* kHelp =
    "\n"
    "Decodes every problem of a JSONL set greedily under each KV-cache method (and each budget of\n"
    "the methods that take one) and reports accuracy against KV memory. FullKV in FP16 always runs\n"
    "first: it is the reference for divergence and the memory baseline.\n"
    "\n"
    "  --problems FILE      JSONL, one problem per line: \"prompt\" (string) and \"answer\" (string or\n"
    "                       integer) are required; \"id\" is used in reports; \"completion\" (a\n"
    "                       reference output), when present, must yield the answer by the pattern\n"
    "  --methods M,...      default full,thinkv; any of: full, full-bf16, tbq, tbe, thinkv,\n"
    "                       tbe-first, thinkv-first, nvfp4, kivi2, kivi4, streamingllm, h2o, rkv\n"
    "  --budgets K,...      live tokens per KV stream for the methods that evict (default 128)\n"
    "  --answer-pattern R   ECMAScript regex; the last match in the output is the answer (its first\n"
    "                       capture group if it has one). Default: Answer: (\\d+)\n"
    "  --limit N, --offset K  evaluate N problems starting at the K-th (default: all)\n"
    "  --max-steps N        tokens to generate at most (default: up to the model's context); a run\n"
    "                       ends at EOS/BOS\n"
    "  --labels RULES       ground-truth thought labels of generated text, one rule per line:\n"
    "                       'R|E|T <regex>' matched against each output line, first match wins;\n"
    "                       adds the confusion matrix of ThinKV's thought types to the report\n"
    "  --kl                 also the mean KL(full || method) of the next-token distribution,\n"
    "                       teacher-forced on FullKV's tokens (one more decode per run)\n"
    "  --jobs N             problems decoded in parallel (default: all cores)\n"
    "  --json FILE          every number of the report and every run, as JSON\n"
    "  --md FILE, --svg FILE  the table as Markdown; the accuracy-vs-memory plot\n"
    "  --generations FILE   every output text (JSONL: id, method, text, answer, thought types)\n"
    "  --keep-prompt        (default) the prompt is never evicted and is stored as R; budgets count\n"
    "                       the generated tokens (the decode-stage setting of ThinKV, R-KV, ...)\n"
    "  --compress-prompt    every token, the prompt's too, is subject to eviction and the budget\n"
    "  --calibration, --precision, --group, --segment, --tau, --select  as `thinkv generate`\n"
    "\n"
    "Memory is measured per run at its end: bytes held (every byte the method holds for the\n"
    "sequence: codes, scales, metadata, staging, residuals) and allocated (what it reserved), both\n"
    "against FullKV FP16 of the same positions; 'peak' is the largest held bytes after any step.\n"
    "Output files are written only when the whole evaluation succeeded (through a temporary file).\n"
    "\n"
    "Exit status: 0 ok, 1 data error, 2 usage error.\n"
    "\n"
    "Example:\n"
    "  thinkv eval --model testbed.bin --problems models/eval_public.jsonl --limit 20 \\\n"
    "      --methods full,thinkv,h2o,rkv --budgets 128,256 --calibration models/testbed-calib.json\n";

int usage(const std::string& msg) { return usage_error("eval", kUsage, msg); }

struct Args {
  std::string model, tokenizer, problems, json, md, svg, generations, labels;
  std::string pattern = "Answer: (\\d+)";
  std::vector<Method> methods{Method::kFull, Method::kThinKv};
  std::vector<int> budgets{128};
  CacheFlags cache;
  int limit = -1, offset = 0, max_steps = 0, jobs = 0, threads = 1;
  bool kl = false, quiet = false, help = false;
  bool progress = ::isatty(2) != 0;
};

int parse(int argc, char** argv, Args& a) {
  ArgParser p("eval", kUsage);
  add_cache_options(p, a.cache);
  p.text("-m,--model", a.model, "a file");
  p.text("--tokenizer", a.tokenizer, "a file");
  p.text("--problems", a.problems, "a JSONL file");
  p.text("--json", a.json, "a file");
  p.text("--md", a.md, "a file");
  p.text("--svg", a.svg, "a file");
  p.text("--generations", a.generations, "a file");
  p.text("--labels", a.labels, "a rules file");
  p.text("--answer-pattern", a.pattern, "a regular expression");
  p.value("--methods", [&a](const std::string& v) {
    if (v.empty()) return std::string("needs a comma-separated list");
    a.methods.clear();
    std::string_view rest = v;
    while (true) {
      const auto comma = rest.find(',');
      const std::string_view name = rest.substr(0, comma);
      const auto m = parse_method(name);
      if (!m) return "'" + std::string(name) + "' is not a method; allowed: " + method_names();
      if (std::find(a.methods.begin(), a.methods.end(), *m) == a.methods.end()) a.methods.push_back(*m);
      if (comma == std::string_view::npos) return std::string();
      rest.remove_prefix(comma + 1);
    }
  });
  p.value("--budgets", [&a](const std::string& v) {
    return parse_int_list(v, 1, 1 << 24, a.budgets) ? std::string()
                                                    : std::string("a comma-separated list of integers >= 1");
  });
  p.integer("--limit", a.limit, 1, 1 << 30, "must be an integer >= 1");
  p.integer("--offset", a.offset, 0, 1 << 30, "must be an integer >= 0");
  p.integer("--max-steps", a.max_steps, 1, 1 << 30, "must be an integer >= 1");
  p.integer("-j,--jobs", a.jobs, 1, 1024, "must be an integer in 1..1024");
  p.integer("-t,--threads", a.threads, 1, 1024, "must be an integer in 1..1024");
  p.flag("--kl", a.kl);
  p.flag("--progress,!--no-progress", a.progress);
  p.flag("-q,--quiet", a.quiet);
  if (const int rc = p.parse(argc, argv); rc != 0) return rc;
  a.help = p.help();
  if (a.help) return 0;
  if (a.model.empty()) return usage("no model given (--model PATH)");
  if (a.problems.empty()) return usage("no problems given (--problems FILE.jsonl)");
  return 0;
}

// ---- problems, answers, labels ------------------------------------------------------------------

struct Problem {
  std::string id, prompt, answer, completion;
  bool has_completion = false;
  int line = 0;
  std::vector<int> tokens;  // BOS + the encoded prompt
};

/// Reads the JSONL problems; the message names the file and line of any bad one.
bool read_problems(const std::string& path, std::vector<Problem>& out, std::string& err) {
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    err = path + ": cannot open the problems file";
    return false;
  }
  std::string line;
  int no = 0;
  std::map<std::string, int> ids;
  while (std::getline(f, line)) {
    ++no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    const std::string where = path + ":" + std::to_string(no) + ": ";
    Json j;
    try {
      j = Json::parse(line);
    } catch (const Json::parse_error& e) {
      err = where + "not a JSON object (" + std::string(e.what()) + "); each line must be one problem";
      return false;
    }
    if (!j.is_object()) {
      err = where + "not a JSON object; each line must be one problem {\"prompt\": ..., \"answer\": ...}";
      return false;
    }
    Problem p;
    p.line = no;
    if (!j.contains("prompt")) {
      err = where + "field 'prompt' is missing (each problem needs 'prompt' and 'answer')";
      return false;
    }
    if (!j["prompt"].is_string() || j["prompt"].get<std::string>().empty()) {
      err = where + "field 'prompt' must be a non-empty string";
      return false;
    }
    p.prompt = j["prompt"].get<std::string>();
    if (!j.contains("answer")) {
      err = where + "field 'answer' is missing (each problem needs 'prompt' and 'answer')";
      return false;
    }
    const Json& ans = j["answer"];
    if (ans.is_string()) {
      p.answer = ans.get<std::string>();
    } else if (ans.is_number_integer()) {
      p.answer = ans.dump();
    } else {
      err = where + "field 'answer' must be a string or an integer";
      return false;
    }
    if (p.answer.empty()) {
      err = where + "field 'answer' is empty";
      return false;
    }
    if (j.contains("id")) {
      if (j["id"].is_string())
        p.id = j["id"].get<std::string>();
      else if (j["id"].is_number_integer())
        p.id = j["id"].dump();
      else {
        err = where + "field 'id' must be a string or an integer";
        return false;
      }
    } else {
      p.id = "line" + std::to_string(no);
    }
    if (auto [it, fresh] = ids.emplace(p.id, no); !fresh) {
      err = where + "id '" + p.id + "' is already used on line " + std::to_string(it->second);
      return false;
    }
    if (j.contains("completion")) {
      if (!j["completion"].is_string()) {
        err = where + "field 'completion' must be a string";
        return false;
      }
      p.completion = j["completion"].get<std::string>();
      p.has_completion = true;
    }
    out.push_back(std::move(p));
  }
  if (f.bad()) {
    err = path + ": read error";
    return false;
  }
  if (out.empty()) {
    err = path + ": no problems (one JSON object per line)";
    return false;
  }
  return true;
}

/// The answer the pattern takes from text: its last match (the first capture group, if any).
bool extract_answer(const std::regex& re, const std::string& text, std::string& out) {
  bool found = false;
  for (auto it = std::sregex_iterator(text.begin(), text.end(), re); it != std::sregex_iterator(); ++it) {
    const std::smatch& m = *it;
    out = m.size() > 1 ? m[1].str() : m[0].str();
    found = true;
  }
  return found;
}

// ---- runs ---------------------------------------------------------------------------------------

struct Config {
  Method method = Method::kFull;
  int budget = 0;
  [[nodiscard]] std::string name() const {
    return std::string(to_string(method)) + (budget > 0 ? "/" + std::to_string(budget) : std::string());
  }
};

struct Outcome {
  std::vector<int> tokens;
  std::string text, pred, thoughts;  // thoughts: R/E/T per generated token that was decoded
  bool answered = false, correct = false;
  bool truncated = false;  // stopped at --max-steps (or the context), not at EOS
  int positions = 0;
  CacheReport report;
  std::int64_t peak_held = 0;
  double seconds = 0;
  int first_divergence = -1;  // -1: identical to FullKV
  double agreement = 1.0;
  double kl = NAN;
  std::int64_t thought_tokens[kNumThoughtTypes] = {};
  std::int64_t confusion[kNumThoughtTypes][kNumThoughtTypes] = {};  // [label][classified]
  std::int64_t refreshes = 0, transitions = 0, case1_steps = 0, unreachable = 0;
  std::string method_name;
};

struct Env {
  const Model* model = nullptr;
  const Tokenizer* tok = nullptr;
  const Args* args = nullptr;
  ThoughtClassifier classifier;
  std::regex pattern;
  std::vector<LabelRule> rules;
};

Status run_one(const Env& env, const Problem& p, const Config& c, const Outcome* full,
               const std::vector<std::vector<float>>* full_logits, Outcome& out,
               std::vector<std::vector<float>>* logits_out) {
  const Model& model = *env.model;
  const int P = static_cast<int>(p.tokens.size());
  const int ctx = model.config.seq_len;
  const int steps = env.args->max_steps > 0 ? std::min(env.args->max_steps, ctx - P + 1) : ctx - P + 1;
  MethodOptions mo;
  mo.method = c.method;
  CacheFlags cf = env.args->cache;
  cf.budget = c.budget;
  mo.cache = cache_options(cf, thinkv_mode(c.method), P + steps, env.classifier, P);
  mo.selection = cf.selection;
  CacheSpec spec;
  if (Status s = make_cache_spec(model.config, mo, spec); !s.is_ok()) {
    return {s.code(), c.name() + ": cache configuration: " + s.message()};
  }
  RunOptions ro;
  ro.steps = steps;
  ro.threads = env.args->threads;
  ro.bos_id = env.tok->bos_id;
  ro.eos_id = env.tok->eos_id;
  if (logits_out != nullptr) {
    ro.on_logits = [&](int, std::span<const float> l) { logits_out->emplace_back(l.begin(), l.end()); };
  }
  RunStats st;
  THINKV_RETURN_IF_ERROR(run_sequence(model, spec, p.tokens, ro, st));
  out.tokens = st.tokens;
  out.truncated = static_cast<int>(st.tokens.size()) >= steps;
  out.positions = st.forward_passes;
  out.report = st.report;
  out.peak_held = st.peak_physical_bytes;
  out.seconds = st.seconds;
  out.method_name = st.method;
  std::vector<std::string> pieces;
  int prev = p.tokens.back();
  for (int t : st.tokens) {
    pieces.push_back(env.tok->decode_piece(prev, t));
    out.text += pieces.back();
    prev = t;
  }
  out.answered = extract_answer(env.pattern, out.text, out.pred);
  out.correct = out.answered && out.pred == p.answer;
  // ThinKV's thought types of the generated tokens that were decoded (fed back as input).
  if (on_thinkv_cache(c.method) && !st.segments.empty()) {
    out.refreshes = st.thought_stats.refreshes;
    out.transitions = st.cache_stats.transition_events;
    out.case1_steps = st.cache_stats.case1_steps;
    out.unreachable = st.cache_stats.budget_unreachable;
    const std::vector<int> labels = env.rules.empty() ? std::vector<int>() : label_tokens(env.rules, pieces);
    std::size_t seg = 0;
    for (std::size_t i = 0; i < st.tokens.size(); ++i) {
      const std::int32_t pos = P + static_cast<std::int32_t>(i);
      if (pos >= out.positions) break;  // the last token is chosen, not decoded
      while (seg + 1 < st.segments.size() && st.segments[seg + 1].start <= pos) ++seg;
      const int t = static_cast<int>(st.segments[seg].type);
      ++out.thought_tokens[t];
      out.thoughts += std::string(thinkv::to_string(static_cast<ThoughtType>(t)));
      if (!labels.empty() && labels[i] >= 0) ++out.confusion[labels[i]][t];
    }
  }
  if (full != nullptr) {  // divergence from FullKV
    const std::size_t n = std::max(full->tokens.size(), out.tokens.size());
    int same = 0;
    out.first_divergence = -1;
    for (std::size_t i = 0; i < n; ++i) {
      const bool both = i < full->tokens.size() && i < out.tokens.size();
      if (both && full->tokens[i] == out.tokens[i]) {
        ++same;
      } else if (out.first_divergence < 0) {
        out.first_divergence = static_cast<int>(i);
      }
    }
    out.agreement = full->tokens.empty() ? 1.0 : static_cast<double>(same) / static_cast<double>(full->tokens.size());
  }
  if (full != nullptr && full_logits != nullptr && !full->tokens.empty()) {  // teacher-forced KL
    RunOptions fo = ro;
    fo.forced = &full->tokens;
    double sum = 0;
    int count = 0;
    fo.on_logits = [&](int step, std::span<const float> l) {
      if (static_cast<std::size_t>(step) < full_logits->size()) {
        sum += kl_divergence((*full_logits)[static_cast<std::size_t>(step)], l);
        ++count;
      }
    };
    RunStats fs;
    THINKV_RETURN_IF_ERROR(run_sequence(model, spec, p.tokens, fo, fs));
    out.kl = count > 0 ? sum / count : 0.0;
  }
  return Status::ok();
}

// ---- aggregation and reports --------------------------------------------------------------------

struct Summary {
  Config config;
  std::string method_name;
  int n = 0, correct = 0, answered = 0, full_correct = 0, kept_correct = 0;
  double held = 0, peak = 0, allocated = 0;  // mean ratios to FullKV FP16 at the run's end
  double gen = 0, full_gen = 0, agreement = 0, kl = 0, seconds = 0;
  std::int64_t positions = 0, eviction_calls = 0, tokens_evicted = 0, gather_bytes = 0;
  std::int64_t thought_tokens[kNumThoughtTypes] = {}, confusion[kNumThoughtTypes][kNumThoughtTypes] = {};
  std::int64_t refreshes = 0, transitions = 0, case1_steps = 0, unreachable = 0;
  int median_divergence = 0, never_diverged = 0;
  bool has_kl = false, thinkv = false;
  [[nodiscard]] double accuracy() const { return n ? static_cast<double>(correct) / n : 0.0; }
};

Summary summarize(const Config& c, const std::vector<Problem>& probs, const std::vector<std::vector<Outcome>>& res,
                  std::size_t ci) {
  Summary s;
  s.config = c;
  s.thinkv = on_thinkv_cache(c.method);
  std::vector<int> div;
  for (std::size_t p = 0; p < probs.size(); ++p) {
    const Outcome& o = res[p][ci];
    const Outcome& f = res[p][0];
    s.method_name = o.method_name;
    ++s.n;
    s.correct += o.correct;
    s.answered += o.answered;
    s.full_correct += f.correct;
    s.kept_correct += f.correct && o.correct;
    const double fk = static_cast<double>(std::max<std::int64_t>(1, o.report.fullkv_fp16_bytes));
    s.held += static_cast<double>(o.report.held_bytes) / fk;
    s.peak += static_cast<double>(o.peak_held) / fk;
    s.allocated += static_cast<double>(o.report.allocated_bytes) / fk;
    s.gen += static_cast<double>(o.tokens.size());
    s.full_gen += static_cast<double>(f.tokens.size());
    s.agreement += o.agreement;
    if (!std::isnan(o.kl)) {
      s.kl += o.kl;
      s.has_kl = true;
    }
    s.seconds += o.seconds;
    s.positions += o.positions;
    s.eviction_calls += o.report.eviction_calls;
    s.tokens_evicted += o.report.tokens_evicted;
    s.gather_bytes += o.report.gather_bytes;
    for (int t = 0; t < kNumThoughtTypes; ++t) {
      s.thought_tokens[t] += o.thought_tokens[t];
      for (int u = 0; u < kNumThoughtTypes; ++u) s.confusion[t][u] += o.confusion[t][u];
    }
    s.refreshes += o.refreshes;
    s.transitions += o.transitions;
    s.case1_steps += o.case1_steps;
    s.unreachable += o.unreachable;
    const int full_len = static_cast<int>(f.tokens.size());
    div.push_back(o.first_divergence < 0 ? full_len : o.first_divergence);
    s.never_diverged += o.first_divergence < 0;
  }
  const double n = std::max(1, s.n);
  s.held /= n;
  s.peak /= n;
  s.allocated /= n;
  s.gen /= n;
  s.full_gen /= n;
  s.agreement /= n;
  s.kl /= n;
  std::sort(div.begin(), div.end());
  s.median_divergence = div.empty() ? 0 : div[div.size() / 2];
  return s;
}

std::string pct(double x, int digits = 1) { return fmt(digits == 1 ? "%.1f" : "%.2f", 100.0 * x); }

/// One row per configuration; `md` selects Markdown.
std::string table(const std::vector<Summary>& rows, bool md, bool kl) {
  std::vector<std::vector<std::string>> cells;
  std::vector<std::string> head{"method",    "budget",  "accuracy",   "kept",  "KV held", "peak",
                                "allocated", "gen len", "evict/step", "agree", "1st div", "tok/s"};
  if (kl) head.insert(head.end() - 1, "KL");
  cells.push_back(head);
  for (const Summary& s : rows) {
    std::vector<std::string> r{
        std::string(to_string(s.config.method)),
        s.config.budget > 0 ? std::to_string(s.config.budget) : "-",
        pct(s.accuracy()) + " % (" + std::to_string(s.correct) + "/" + std::to_string(s.n) + ")",
        s.full_correct ? pct(static_cast<double>(s.kept_correct) / s.full_correct) + " %" : "-",
        pct(s.held) + " %",
        pct(s.peak) + " %",
        pct(s.allocated) + " %",
        fmt("%.0f", s.gen) + " (" + fmt("%.2f", s.full_gen > 0 ? s.gen / s.full_gen : 0.0) + "x)",
        fmt("%.4f", s.positions ? static_cast<double>(s.eviction_calls) / s.positions : 0.0),
        pct(s.agreement) + " %",
        std::to_string(s.median_divergence),
        fmt("%.0f", s.seconds > 0 ? s.positions / s.seconds : 0.0)};
    if (kl) r.insert(r.end() - 1, s.has_kl ? fmt("%.4f", s.kl) : "-");
    cells.push_back(r);
  }
  std::vector<std::size_t> w(head.size(), 0);
  for (const auto& r : cells)
    for (std::size_t i = 0; i < r.size(); ++i) w[i] = std::max(w[i], r[i].size());
  std::ostringstream o;
  for (std::size_t ri = 0; ri < cells.size(); ++ri) {
    const auto& r = cells[ri];
    if (md) {
      o << "|";
      for (const auto& c : r) o << " " << c << " |";
      o << "\n";
      if (ri == 0) {
        o << "|";
        for (std::size_t i = 0; i < r.size(); ++i) o << (i < 2 ? "---|" : "---:|");
        o << "\n";
      }
    } else {
      for (std::size_t i = 0; i < r.size(); ++i) {
        const std::string pad(w[i] - r[i].size(), ' ');
        o << (i < 2 ? r[i] + pad : pad + r[i]) << (i + 1 < r.size() ? "  " : "\n");
      }
    }
  }
  return o.str();
}

const char* method_color(Method m) {
  static constexpr const char* kColors[] = {"#000000", "#7f7f7f", "#1f77b4", "#ff7f0e", "#2ca02c", "#ffbb78", "#98df8a",
                                            "#17becf", "#9467bd", "#c5b0d5", "#8c564b", "#e377c2", "#d62728"};
  return kColors[static_cast<std::size_t>(m) % (sizeof kColors / sizeof kColors[0])];
}

/// Accuracy against KV memory held (log scale), one colour per method, budgets as labels.
std::string plot(const std::vector<Summary>& rows, const std::string& title) {
  const int W = 900, H = 520, left = 70, top = 60, pw = 620, ph = 400;
  double lo = 1.0, hi = 1.0;
  for (const Summary& s : rows) {
    lo = std::min(lo, std::max(1e-4, s.held));
    hi = std::max(hi, s.held);
  }
  const double l0 = std::floor(std::log10(lo)), l1 = std::max(l0 + 1, std::ceil(std::log10(hi * 1.05)));
  auto px = [&](double x) { return left + pw * (std::log10(std::max(1e-4, x)) - l0) / (l1 - l0); };
  auto py = [&](double acc) { return top + ph * (1.0 - acc); };
  std::ostringstream s;
  s << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H
    << "\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  s << "<text x=\"" << left + pw / 2 << "\" y=\"28\" text-anchor=\"middle\" font-size=\"14\">" << title << "</text>\n";
  s << "<rect x=\"" << left << "\" y=\"" << top << "\" width=\"" << pw << "\" height=\"" << ph
    << "\" fill=\"none\" stroke=\"#000\"/>\n";
  for (double e = l0; e <= l1 + 1e-9; e += 1.0) {
    for (int m : {1, 2, 5}) {
      const double x = m * std::pow(10.0, e);
      if (std::log10(x) > l1 + 1e-9) break;
      const double xx = px(x);
      s << "<line x1=\"" << xx << "\" y1=\"" << top << "\" x2=\"" << xx << "\" y2=\"" << top + ph
        << "\" stroke=\"#eee\"/>\n<text x=\"" << xx << "\" y=\"" << top + ph + 16 << "\" text-anchor=\"middle\">"
        << fmt(x * 100 >= 1 ? "%.0f" : "%.1f", x * 100) << "</text>\n";
    }
  }
  s << "<text x=\"" << left + pw / 2 << "\" y=\"" << top + ph + 36
    << "\" text-anchor=\"middle\">KV memory held / FullKV FP16 (%, log scale)</text>\n";
  for (int t = 0; t <= 10; ++t) {
    const double yy = py(t / 10.0);
    s << "<line x1=\"" << left << "\" y1=\"" << yy << "\" x2=\"" << left + pw << "\" y2=\"" << yy
      << "\" stroke=\"#eee\"/><text x=\"" << left - 6 << "\" y=\"" << yy + 4 << "\" text-anchor=\"end\">" << t * 10
      << "</text>\n";
  }
  s << "<text transform=\"translate(" << left - 42 << "," << top + ph / 2
    << ") rotate(-90)\" text-anchor=\"middle\">accuracy (%)</text>\n";
  for (const Summary& r : rows) {  // FullKV's accuracy as a dashed line
    if (r.config.method != Method::kFull) continue;
    s << "<line x1=\"" << left << "\" y1=\"" << py(r.accuracy()) << "\" x2=\"" << left + pw << "\" y2=\""
      << py(r.accuracy()) << "\" stroke=\"#000\" stroke-dasharray=\"4,4\"/>\n";
  }
  std::vector<Method> seen;
  for (const Summary& r : rows) {
    if (std::find(seen.begin(), seen.end(), r.config.method) == seen.end()) seen.push_back(r.config.method);
  }
  int ly = top + 10;
  for (Method m : seen) {
    std::vector<const Summary*> pts;
    for (const Summary& r : rows) {
      if (r.config.method == m) pts.push_back(&r);
    }
    if (pts.size() > 1) {
      s << "<polyline fill=\"none\" stroke=\"" << method_color(m) << "\" stroke-opacity=\"0.6\" points=\"";
      for (const Summary* p : pts) s << px(p->held) << "," << py(p->accuracy()) << " ";
      s << "\"/>\n";
    }
    for (const Summary* p : pts) {
      s << "<circle cx=\"" << px(p->held) << "\" cy=\"" << py(p->accuracy()) << "\" r=\"4.5\" fill=\""
        << method_color(m) << "\"/>\n";
      if (p->config.budget > 0) {
        s << "<text x=\"" << px(p->held) + 6 << "\" y=\"" << py(p->accuracy()) - 5 << "\" font-size=\"10\" fill=\""
          << method_color(m) << "\">" << p->config.budget << "</text>\n";
      }
    }
    s << "<circle cx=\"" << left + pw + 20 << "\" cy=\"" << ly << "\" r=\"5\" fill=\"" << method_color(m)
      << "\"/><text x=\"" << left + pw + 30 << "\" y=\"" << ly + 4 << "\">" << to_string(m) << "</text>\n";
    ly += 18;
  }
  s << "<text x=\"" << left + pw + 14 << "\" y=\"" << ly + 10
    << "\" fill=\"#555\" font-size=\"10\">labels: budget</text>\n";
  s << "<text x=\"" << left + pw + 14 << "\" y=\"" << ly + 24
    << "\" fill=\"#555\" font-size=\"10\">dashed: FullKV</text>\n";
  s << "</svg>\n";
  return s.str();
}

std::string confusion_text(const Summary& s) {
  std::ostringstream o;
  o << "  thought types of " << s.config.name() << " (rows: ground-truth label, columns: ThinKV's type):\n";
  o << "           R        E        T     recall\n";
  for (int t = 0; t < kNumThoughtTypes; ++t) {
    std::int64_t row = 0;
    for (int u = 0; u < kNumThoughtTypes; ++u) row += s.confusion[t][u];
    o << "    " << thinkv::to_string(static_cast<ThoughtType>(t));
    for (int u = 0; u < kNumThoughtTypes; ++u) o << fmt("%9.0f", static_cast<double>(s.confusion[t][u]));
    o << "   " << (row ? pct(static_cast<double>(s.confusion[t][t]) / static_cast<double>(row)) + " %" : "-") << "\n";
  }
  return o.str();
}

std::string now_utc() {
  const std::time_t t = std::time(nullptr);
  char b[32];
  std::strftime(b, sizeof b, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return b;
}

}  // namespace

int run_eval(int argc, char** argv) {
  Args a;
  if (const int rc = parse(argc, argv, a); rc != 0) return rc;
  if (a.help) {
    std::printf("%s%s", kUsage, kHelp);
    return 0;
  }
  Env env;
  env.args = &a;
  try {
    env.pattern = std::regex(a.pattern, std::regex::ECMAScript);
  } catch (const std::regex_error& e) {
    return usage("--answer-pattern '" + a.pattern + "' is not a valid regular expression: " + e.what());
  }
  std::vector<Problem> problems;
  std::string err;
  if (!read_problems(a.problems, problems, err)) {
    std::fprintf(stderr, "thinkv eval: %s\n", err.c_str());
    return kExitData;
  }
  if (a.offset >= static_cast<int>(problems.size())) {
    return usage("--offset " + std::to_string(a.offset) + " skips all " + std::to_string(problems.size()) +
                 " problems of " + a.problems);
  }
  problems.erase(problems.begin(), problems.begin() + a.offset);
  if (a.limit > 0 && a.limit < static_cast<int>(problems.size())) problems.resize(static_cast<std::size_t>(a.limit));
  if (!a.labels.empty() && !read_label_rules(a.labels, env.rules, err)) {
    std::fprintf(stderr, "thinkv eval: %s\n", err.c_str());
    return kExitData;
  }
  // A pattern that cannot find the answer in a reference completion would score every run wrong.
  for (const Problem& p : problems) {
    if (!p.has_completion) continue;
    std::string got;
    if (!extract_answer(env.pattern, p.completion, got)) {
      std::fprintf(stderr,
                   "thinkv eval: %s:%d: --answer-pattern '%s' finds no answer in this problem's reference "
                   "completion; fix the pattern (it must match the answer in the model's output)\n",
                   a.problems.c_str(), p.line, a.pattern.c_str());
      return kExitData;
    }
    if (got != p.answer) {
      std::fprintf(stderr,
                   "thinkv eval: %s:%d: --answer-pattern '%s' takes '%s' from this problem's reference "
                   "completion, but its answer is '%s'; fix the pattern\n",
                   a.problems.c_str(), p.line, a.pattern.c_str(), got.c_str(), p.answer.c_str());
      return kExitData;
    }
  }
  Model model;
  Tokenizer tok;
  if (const int rc = load_model_and_tokenizer("thinkv eval", a.model, a.tokenizer, model, tok); rc != 0) return rc;
  env.model = &model;
  env.tok = &tok;
  if (const int rc = load_classifier("eval", a.cache, model, env.classifier); rc != 0) return rc;
  // Prompts: encoded, and the tokenizer must give the prompt back (else it is not this model's).
  for (Problem& p : problems) {
    p.tokens = tok.encode(p.prompt, true, false);
    std::string back;
    int prev = p.tokens.front();
    for (std::size_t i = 1; i < p.tokens.size(); ++i) {
      back += tok.decode_piece(prev, p.tokens[i]);
      prev = p.tokens[i];
    }
    if (back != p.prompt) {
      std::size_t k = 0;
      while (k < back.size() && k < p.prompt.size() && back[k] == p.prompt[k]) ++k;
      std::fprintf(stderr,
                   "thinkv eval: %s:%d: the tokenizer of %s (%s) cannot encode this prompt: it differs from "
                   "its decoding at byte %zu (0x%02X); is it the model's tokenizer?\n",
                   a.problems.c_str(), p.line, model.name.c_str(), tok.source.c_str(), k,
                   k < p.prompt.size() ? static_cast<unsigned>(static_cast<unsigned char>(p.prompt[k])) : 0u);
      return kExitData;
    }
    if (static_cast<int>(p.tokens.size()) >= model.config.seq_len) {
      std::fprintf(stderr, "thinkv eval: %s:%d: the prompt has %zu tokens; %s has a context of %d\n",
                   a.problems.c_str(), p.line, p.tokens.size(), model.name.c_str(), model.config.seq_len);
      return kExitData;
    }
  }
  // The configurations: FullKV first (the reference), then every method x budget.
  std::vector<Config> configs{{Method::kFull, 0}};
  for (Method m : a.methods) {
    if (m == Method::kFull) continue;
    if (has_budget(m)) {
      for (int b : a.budgets) configs.push_back({m, b});
    } else {
      configs.push_back({m, 0});
    }
  }
  // Every configuration must build before any decoding (a bad --segment for a budget, say).
  for (const Config& c : configs) {
    MethodOptions mo;
    mo.method = c.method;
    CacheFlags cf = a.cache;
    cf.budget = c.budget;
    mo.cache = cache_options(cf, thinkv_mode(c.method), model.config.seq_len, env.classifier);
    mo.selection = cf.selection;
    CacheSpec spec;
    if (Status s = make_cache_spec(model.config, mo, spec); !s.is_ok()) {
      return usage(c.name() + ": cache configuration for " + model.name + ": " + s.message());
    }
  }

  const std::size_t NP = problems.size(), NC = configs.size();
  std::vector<std::vector<Outcome>> results(NP, std::vector<Outcome>(NC));
  const int jobs = a.jobs > 0 ? a.jobs : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  std::atomic<std::size_t> next{0}, done_runs{0};
  std::atomic<bool> failed{false};
  std::mutex err_mu;
  std::string first_error;
  auto worker = [&]() {
    while (!failed.load()) {
      const std::size_t p = next.fetch_add(1);
      if (p >= NP) return;
      std::vector<std::vector<float>> full_logits;
      for (std::size_t c = 0; c < NC && !failed.load(); ++c) {
        const bool is_full = c == 0;
        const Status s =
            run_one(env, problems[p], configs[c], is_full ? nullptr : &results[p][0],
                    a.kl && !is_full ? &full_logits : nullptr, results[p][c], a.kl && is_full ? &full_logits : nullptr);
        if (!s.is_ok()) {
          std::lock_guard<std::mutex> lock(err_mu);
          if (first_error.empty()) {
            first_error = a.problems + ":" + std::to_string(problems[p].line) + " (" + problems[p].id + "), " +
                          configs[c].name() + ": " + s.to_string();
          }
          failed = true;
          return;
        }
        ++done_runs;
      }
    }
  };
  Progress progress(a.progress, "thinkv eval: ");
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int j = 0; j < std::min<int>(jobs, static_cast<int>(NP)); ++j) pool.emplace_back(worker);
  const std::size_t total = NP * NC;
  while (done_runs.load() < total && !failed.load()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    const double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const std::size_t d = done_runs.load();
    const double eta = d > 0 ? el * static_cast<double>(total - d) / static_cast<double>(d) : 0.0;
    progress.update(std::to_string(d) + "/" + std::to_string(total) + " runs (" + std::to_string(NP) + " problems x " +
                    std::to_string(NC) + " configurations), " + fmt("%.0f", el) + " s" +
                    (d > 0 ? ", about " + fmt("%.0f", eta) + " s left" : std::string()));
  }
  for (std::thread& t : pool) t.join();
  progress.clear();
  if (failed) {
    std::fprintf(stderr, "thinkv eval: %s\nNothing was written.\n", first_error.c_str());
    return kExitData;
  }
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // A pattern that matches no FullKV output is almost surely the wrong pattern.
  int full_answered = 0, full_finished = 0;
  for (std::size_t p = 0; p < NP; ++p) {
    full_answered += results[p][0].answered;
    full_finished += !results[p][0].truncated;
  }
  if (full_answered == 0 && full_finished > 0) {
    std::fprintf(stderr,
                 "thinkv eval: --answer-pattern '%s' matched none of the %d FullKV outputs that ended; check the "
                 "pattern against the model's output (`thinkv generate --prompt ...`). Nothing was written.\n",
                 a.pattern.c_str(), full_finished);
    return kExitData;
  }
  if (full_finished == 0 && !a.quiet) {
    std::fprintf(stderr,
                 "thinkv eval: note: no FullKV output ended within %s, so answers may be missing; raise --max-steps\n",
                 a.max_steps > 0 ? ("--max-steps " + std::to_string(a.max_steps)).c_str() : "the context");
  }

  std::vector<Summary> rows;
  for (std::size_t c = 0; c < NC; ++c) rows.push_back(summarize(configs[c], problems, results, c));
  const std::string title = model.name + ": accuracy vs KV memory, " + std::to_string(NP) + " problems of " +
                            std::filesystem::path(a.problems).filename().string();
  const std::string console = table(rows, false, a.kl);
  std::string thoughts;
  for (const Summary& s : rows) {
    if (!s.thinkv || s.config.method == Method::kFullBf16) continue;
    const std::int64_t tot = s.thought_tokens[0] + s.thought_tokens[1] + s.thought_tokens[2];
    if (tot == 0) continue;
    thoughts += "  " + s.config.name() + ": decoded tokens R/E/T " + std::to_string(s.thought_tokens[0]) + "/" +
                std::to_string(s.thought_tokens[1]) + "/" + std::to_string(s.thought_tokens[2]) + ", refreshes " +
                std::to_string(s.refreshes) + ", new transitions " + std::to_string(s.transitions) +
                " (case-1 step-downs " + std::to_string(s.case1_steps) + ")\n";
    if (!env.rules.empty() && s.config.method != Method::kTbq && s.config.method != Method::kNvfp4)
      thoughts += confusion_text(s);
  }

  // Files first (all or nothing), then the console.
  Json j;
  j["model"] = model.name;
  j["model_path"] = model.path;
  j["problems_file"] = a.problems;
  j["problems"] = NP;
  j["offset"] = a.offset;
  j["answer_pattern"] = a.pattern;
  j["calibration"] = a.cache.calibration;
  j["precision"] = a.cache.precision.to_string();
  j["date"] = now_utc();
  j["wall_seconds"] = wall;
  j["jobs"] = jobs;
  Json cj = Json::array();
  for (const Summary& s : rows) {
    Json r;
    r["config"] = s.config.name();
    r["method"] = std::string(to_string(s.config.method));
    r["budget"] = s.config.budget;
    r["cache"] = s.method_name;
    r["problems"] = s.n;
    r["correct"] = s.correct;
    r["accuracy"] = s.accuracy();
    r["answered"] = s.answered;
    r["full_correct"] = s.full_correct;
    r["kept_correct"] = s.kept_correct;
    r["held_ratio"] = s.held;
    r["peak_held_ratio"] = s.peak;
    r["allocated_ratio"] = s.allocated;
    r["generated_tokens_mean"] = s.gen;
    r["full_generated_tokens_mean"] = s.full_gen;
    r["positions"] = s.positions;
    r["eviction_calls"] = s.eviction_calls;
    r["eviction_calls_per_step"] = s.positions ? static_cast<double>(s.eviction_calls) / s.positions : 0.0;
    r["tokens_evicted"] = s.tokens_evicted;
    r["gather_bytes"] = s.gather_bytes;
    r["token_agreement"] = s.agreement;
    r["first_divergence_median"] = s.median_divergence;
    r["never_diverged"] = s.never_diverged;
    if (s.has_kl) r["mean_kl"] = s.kl;
    r["seconds"] = s.seconds;
    r["tokens_per_second"] = s.seconds > 0 ? s.positions / s.seconds : 0.0;
    if (s.thinkv) {
      r["thought_tokens"] = {{"R", s.thought_tokens[0]}, {"E", s.thought_tokens[1]}, {"T", s.thought_tokens[2]}};
      r["refreshes"] = s.refreshes;
      r["transition_events"] = s.transitions;
      r["case1_steps"] = s.case1_steps;
      r["budget_unreachable_steps"] = s.unreachable;
      if (!env.rules.empty()) {
        Json m = Json::array();
        for (int t = 0; t < kNumThoughtTypes; ++t)
          m.push_back({s.confusion[t][0], s.confusion[t][1], s.confusion[t][2]});
        r["confusion_label_by_type"] = m;
      }
    }
    cj.push_back(r);
  }
  j["configs"] = cj;
  Json pj = Json::array();
  for (std::size_t p = 0; p < NP; ++p) {
    Json q;
    q["id"] = problems[p].id;
    q["line"] = problems[p].line;
    q["answer"] = problems[p].answer;
    q["prompt_tokens"] = problems[p].tokens.size();
    Json rr = Json::array();
    for (std::size_t c = 0; c < NC; ++c) {
      const Outcome& o = results[p][c];
      Json x;
      x["config"] = configs[c].name();
      x["pred"] = o.answered ? Json(o.pred) : Json(nullptr);
      x["correct"] = o.correct;
      x["generated_tokens"] = o.tokens.size();
      x["held_bytes"] = o.report.held_bytes;
      x["peak_held_bytes"] = o.peak_held;
      x["allocated_bytes"] = o.report.allocated_bytes;
      x["fullkv_fp16_bytes"] = o.report.fullkv_fp16_bytes;
      x["eviction_calls"] = o.report.eviction_calls;
      x["first_divergence"] = o.first_divergence;
      x["token_agreement"] = o.agreement;
      if (!std::isnan(o.kl)) x["mean_kl"] = o.kl;
      x["seconds"] = o.seconds;
      rr.push_back(x);
    }
    q["runs"] = rr;
    pj.push_back(q);
  }
  j["runs"] = pj;
  std::vector<std::pair<std::string, std::string>> files;
  if (!a.json.empty()) files.emplace_back(a.json, j.dump(1, ' ', false, Json::error_handler_t::replace) + "\n");
  if (!a.md.empty()) {
    files.emplace_back(a.md, "**" + title + "** (" + now_utc() + ", answer pattern `" + a.pattern + "`)\n\n" +
                                 table(rows, true, a.kl) + (thoughts.empty() ? "" : "\n```\n" + thoughts + "```\n"));
  }
  if (!a.svg.empty()) files.emplace_back(a.svg, plot(rows, title));
  if (!a.generations.empty()) {
    std::string g;
    for (std::size_t p = 0; p < NP; ++p) {
      for (std::size_t c = 0; c < NC; ++c) {
        const Outcome& o = results[p][c];
        Json x;
        x["id"] = problems[p].id;
        x["config"] = configs[c].name();
        x["text"] = o.text;
        x["pred"] = o.answered ? Json(o.pred) : Json(nullptr);
        x["correct"] = o.correct;
        if (!o.thoughts.empty()) x["thoughts"] = o.thoughts;
        g += x.dump(-1, ' ', false, Json::error_handler_t::replace) + "\n";
      }
    }
    files.emplace_back(a.generations, g);
  }
  for (const auto& [path, content] : files) {
    if (const std::string e = write_file_atomic(path, content); !e.empty()) {
      std::fprintf(stderr, "thinkv eval: %s\n", e.c_str());
      return kExitData;
    }
  }
  std::printf("%s (%zu problems, %zu configurations, %.0f s with %d jobs)\n%s", title.c_str(), NP, NC, wall, jobs,
              console.c_str());
  if (!thoughts.empty()) std::printf("%s", thoughts.c_str());
  if (!a.quiet) {
    for (const auto& [path, content] : files) std::fprintf(stderr, "thinkv eval: wrote %s\n", path.c_str());
  }
  return 0;
}
