// `thinkv trace`: per-layer attention sparsity of every decode step, recorded on a real model
// (ThinKvConfig::trace_all_layers) and written in the sparsity-trace CSV format read by
// `thinkv calibrate` (include/thinkv/thought/trace.hpp, docs/calibration.md). By default over a
// FullKV cache (BF16 pages); with --mode tbq/tbe/thinkv over the compressed cache, which is the
// signal ThinKV's classifier sees at run time.

#include "trace.hpp"

#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "../decoder/cli_util.hpp"
#include "../decoder/decoder.hpp"
#include "cache_flags.hpp"
#include "thinkv/thought/trace.hpp"

namespace {

using namespace thinkv;
using namespace thinkv::decoder;
using namespace thinkv::decoder::cli;
using Json = nlohmann::ordered_json;

constexpr const char* kUsage =
    "usage: thinkv trace --model PATH [--prompt TEXT | --prompts FILE | --problems FILE.jsonl]\n"
    "                    [--steps N] [--until-eos] -o TRACE.csv [--texts TEXTS.jsonl]\n"
    "                    [--mode full|tbq|tbe|thinkv] [--budget K] [--calibration calib.json]\n"
    "                    [--precision MAP] [--segment L] [--tau T] [--group G]\n"
    "                    [--limit N] [--offset K] [--tokenizer PATH] [--threads N] [--progress]\n"
    "                    [--quiet]\n";

constexpr const char* kHelp =
    "\n"
    "Decodes greedily and records, after every decode step, the attention sparsity of each layer\n"
    "(share of softmax probabilities below 1% of the row maximum, mean over query heads) in the\n"
    "sparsity-trace CSV format that `thinkv calibrate` reads.\n"
    "\n"
    "  --model PATH       model file (searched like `thinkv generate --model`)\n"
    "  --prompt TEXT      one prompt (default: start from BOS); id p0\n"
    "  --prompts FILE     one prompt per line ('#' lines and blank lines skipped); ids p0, p1, ...\n"
    "  --problems FILE    JSONL with a \"prompt\" per line (and an \"id\", used as the prompt id), as\n"
    "                     `thinkv eval` reads; implies --until-eos\n"
    "  --limit N, --offset K  with --problems: N problems from the K-th\n"
    "  --steps N          decode steps per prompt (default with --until-eos: up to the context)\n"
    "  --until-eos        end a prompt's trace when the model emits EOS or BOS (default: every\n"
    "                     prompt runs --steps steps)\n"
    "  -o, --output PATH  trace file to write ('-' for stdout)\n"
    "  --texts PATH       also write each prompt's generated tokens as JSONL (id, text, pieces):\n"
    "                     step s >= 1 of the trace is the decode of generated token s - 1, so\n"
    "                     labels of the text line up with the trace (`thinkv thoughts`)\n"
    "  --mode M           the cache the signal is taken over: full (default, BF16 pages, the\n"
    "                     reference), or tbq / tbe / thinkv (the compressed cache, as ThinKV's\n"
    "                     classifier sees it at run time; with --budget, --calibration, ...)\n"
    "  --group G          cache group size (default 16; 8 when head_dim % 16 != 0)\n"
    "  --quiet            no per-layer summary on stderr\n"
    "\n"
    "Step s of a prompt is the decode step that chooses generated token s (step 0 attends over the\n"
    "prompt). The trace is written only when every prompt was recorded.\n"
    "\n"
    "Example:\n"
    "  thinkv trace --model stories260K.bin --prompts prompts.txt --steps 300 -o trace.csv\n"
    "  thinkv trace --model testbed.bin --problems calib_prompts.jsonl -o trace.csv --texts t.jsonl\n"
    "  thinkv calibrate trace.csv -o calib.json --plot densities.svg\n";

int usage_error(const std::string& msg) { return thinkv::decoder::cli::usage_error("trace", kUsage, msg); }

struct Args {
  std::string model, tokenizer, prompt, prompts_file, problems_file, output, texts;
  bool have_prompt = false;
  int steps = -1;
  int threads = 0;
  int limit = -1, offset = 0;
  bool until_eos = false;
  CacheMode mode = CacheMode::kFull;
  CacheFlags cache;
  bool progress = ::isatty(2) != 0;
  bool quiet = false;
  bool help = false;
};

int parse(int argc, char** argv, Args& a) {
  ArgParser p("trace", kUsage);
  add_cache_options(p, a.cache);
  p.text("-m,--model", a.model, "a file");
  p.text("--tokenizer", a.tokenizer, "a file");
  p.value("-p,--prompt", [&a](const std::string& v) {
    a.prompt = v;  // may be empty
    a.have_prompt = true;
    return std::string();
  });
  p.text("--prompts", a.prompts_file, "a file");
  p.text("--problems", a.problems_file, "a JSONL file");
  p.text("--texts", a.texts, "a file name");
  p.text("-o,--output", a.output, "a file name");
  p.integer("-n,--steps", a.steps, 1, 1 << 30, "must be an integer >= 1");
  p.integer("--limit", a.limit, 1, 1 << 30, "must be an integer >= 1");
  p.integer("--offset", a.offset, 0, 1 << 30, "must be an integer >= 0");
  p.flag("--until-eos", a.until_eos);
  p.value("--mode", [&a](const std::string& v) {
    const auto m = parse_cache_mode(v);
    if (!m) return std::string("must be full, tbq, tbe or thinkv");
    a.mode = *m;
    return std::string();
  });
  p.integer("-t,--threads", a.threads, 1, 1024, "must be an integer in 1..1024");
  p.flag("--progress", a.progress);
  p.flag("-q,--quiet", a.quiet);
  if (const int rc = p.parse(argc, argv); rc != 0) return rc;
  a.help = p.help();
  if (a.help) return 0;
  if (a.model.empty()) return usage_error("no model given (--model PATH)");
  if (a.output.empty()) return usage_error("no output file given (-o trace.csv)");
  if (static_cast<int>(a.have_prompt) + static_cast<int>(!a.prompts_file.empty()) +
          static_cast<int>(!a.problems_file.empty()) >
      1)
    return usage_error("give one of --prompt, --prompts and --problems");
  if (!a.problems_file.empty()) a.until_eos = true;
  if (a.steps < 0 && !a.until_eos) return usage_error("no step count given (--steps N, or --until-eos)");
  return 0;
}

/// A prompt id the trace format accepts: commas, line breaks, blanks and a leading '#' become '_'.
std::string trace_id(std::string id) {
  for (char& ch : id) {
    if (ch == ',' || ch == '\n' || ch == '\r' || ch == ' ' || ch == '\t') ch = '_';
  }
  if (id.empty()) id = "_";
  if (id.front() == '#') id.front() = '_';
  return id;
}

struct Prompt {
  std::string id, text;
};

bool read_problem_prompts(const std::string& path, std::vector<Prompt>& out, std::string& err) {
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    err = path + ": cannot open the problems file";
    return false;
  }
  std::string line;
  int no = 0;
  while (std::getline(f, line)) {
    ++no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    Json j;
    try {
      j = Json::parse(line);
    } catch (const Json::parse_error& e) {
      err = path + ":" + std::to_string(no) + ": not a JSON object (" + e.what() + ")";
      return false;
    }
    if (!j.is_object() || !j.contains("prompt") || !j["prompt"].is_string()) {
      err = path + ":" + std::to_string(no) + ": each line needs a \"prompt\" string";
      return false;
    }
    Prompt p;
    p.text = j["prompt"].get<std::string>();
    if (j.contains("id") && (j["id"].is_string() || j["id"].is_number_integer())) {
      p.id = trace_id(j["id"].is_string() ? j["id"].get<std::string>() : j["id"].dump());
    } else {
      p.id = "line" + std::to_string(no);
    }
    out.push_back(std::move(p));
  }
  if (out.empty()) {
    err = path + ": no problems";
    return false;
  }
  return true;
}

}  // namespace

int run_trace(int argc, char** argv) {
  Args a;
  if (const int rc = parse(argc, argv, a); rc != 0) return rc;
  if (a.help) {
    std::printf("%s%s", kUsage, kHelp);
    return 0;
  }
  std::vector<Prompt> prompts;
  std::string err;
  if (!a.problems_file.empty()) {
    if (!read_problem_prompts(a.problems_file, prompts, err)) {
      std::fprintf(stderr, "thinkv trace: %s\n", err.c_str());
      return kExitData;
    }
    if (a.offset >= static_cast<int>(prompts.size()))
      return usage_error("--offset " + std::to_string(a.offset) + " skips every problem");
    prompts.erase(prompts.begin(), prompts.begin() + a.offset);
    if (a.limit > 0 && a.limit < static_cast<int>(prompts.size())) prompts.resize(static_cast<std::size_t>(a.limit));
  } else if (!a.prompts_file.empty()) {
    std::ifstream f(a.prompts_file);
    if (!f) {
      std::fprintf(stderr, "thinkv trace: %s: cannot open the prompts file\n", a.prompts_file.c_str());
      return kExitData;
    }
    std::string line;
    while (std::getline(f, line)) {
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line.empty() || line[0] == '#') continue;
      prompts.push_back({"p" + std::to_string(prompts.size()), line});
    }
    if (prompts.empty()) {
      std::fprintf(stderr, "thinkv trace: %s: no prompts (one per line)\n", a.prompts_file.c_str());
      return kExitData;
    }
  } else {
    prompts.push_back({"p0", a.prompt});
  }
  Model model;
  Tokenizer tok;
  if (const int rc = load_model_and_tokenizer("thinkv trace", a.model, a.tokenizer, model, tok); rc != 0) return rc;
  ThoughtClassifier classifier;
  if (const int rc = load_classifier("trace", a.cache, model, classifier); rc != 0) return rc;
  const ModelConfig& mc = model.config;
  const int threads = a.threads > 0 ? a.threads : default_threads();

  SparsityTrace trace;
  trace.model = model.name;
  trace.num_layers = mc.n_layers;
  std::string texts;
  Progress progress(a.progress, "thinkv trace: ");
  const auto L = static_cast<std::size_t>(mc.n_layers);
  for (std::size_t p = 0; p < prompts.size(); ++p) {
    const std::vector<int> ptoks = tok.encode(prompts[p].text, true, false);
    const int P = static_cast<int>(ptoks.size());
    const int steps = a.steps > 0 ? a.steps : mc.seq_len - P + 1;
    if (steps < 1 || P + steps - 1 > mc.seq_len) {
      return usage_error("prompt " + prompts[p].id + " (" + std::to_string(P) + " tokens) + " + std::to_string(steps) +
                         " steps exceed the context " + std::to_string(mc.seq_len));
    }
    CacheOptions co = cache_options(a.cache, a.mode, P + steps, classifier, P);
    co.trace_all_layers = true;
    ThinKvSpec cfg;
    if (Status s = make_cache_config(mc, co, cfg); !s.is_ok())
      return usage_error("cache configuration: " + s.message());
    PromptTrace pt;
    pt.id = prompts[p].id;
    RunOptions ro;
    ro.steps = steps;
    ro.threads = threads;
    ro.stop_at_bos_eos = a.until_eos;
    ro.bos_id = tok.bos_id;
    ro.eos_id = tok.eos_id;
    ro.after_step = [&](int step, const thinkv::DecodeCache& dc) -> Status {
      const std::span<const float> sp = thinkv_of(dc)->layer_sparsity(0);
      for (std::size_t l = 0; l < L; ++l) {
        if (!(sp[l] >= 0.0f && sp[l] <= 1.0f)) {
          return {StatusCode::kInternal,
                  "layer " + std::to_string(l) + " sparsity was not recorded at step " + std::to_string(step)};
        }
      }
      pt.steps.push_back(step);
      pt.values.insert(pt.values.end(), sp.begin(), sp.begin() + static_cast<std::ptrdiff_t>(L));
      progress.update("prompt " + std::to_string(p + 1) + "/" + std::to_string(prompts.size()) + ", step " +
                      std::to_string(step + 1) + (a.until_eos ? "" : "/" + std::to_string(steps)));
      return Status::ok();
    };
    RunStats st;
    if (Status s = run_sequence(model, cfg, ptoks, ro, st); !s.is_ok()) {
      progress.clear();
      std::fprintf(stderr, "thinkv trace: %s\n", s.to_string().c_str());
      return kExitData;
    }
    if (!a.texts.empty()) {
      Json j;
      j["id"] = pt.id;
      std::string text;
      Json pieces = Json::array();
      int prev = ptoks.back();
      for (int t : st.tokens) {
        const std::string piece = tok.decode_piece(prev, t);
        text += piece;
        pieces.push_back(piece);
        prev = t;
      }
      j["text"] = text;
      j["pieces"] = pieces;
      texts += j.dump(-1, ' ', false, Json::error_handler_t::replace) + "\n";
    }
    trace.prompts.push_back(std::move(pt));
  }
  progress.clear();

  std::ostringstream csv;
  if (Status ws = write_sparsity_trace(csv, trace); !ws.is_ok()) {
    std::fprintf(stderr, "thinkv trace: %s\n", ws.to_string().c_str());
    return kExitData;
  }
  if (a.output == "-") {
    std::cout << csv.str();
    std::cout.flush();
    if (!std::cout) {
      std::fprintf(stderr, "thinkv trace: cannot write to stdout\n");
      return kExitData;
    }
  } else if (const std::string e = write_file_atomic(a.output, csv.str()); !e.empty()) {
    std::fprintf(stderr, "thinkv trace: %s\n", e.c_str());
    return kExitData;
  }
  if (!a.texts.empty()) {
    if (const std::string e = write_file_atomic(a.texts, texts); !e.empty()) {
      std::fprintf(stderr, "thinkv trace: %s\n", e.c_str());
      return kExitData;
    }
  }
  if (!a.quiet) {
    const std::string steps_text = a.until_eos ? std::to_string(trace.total_steps()) + " steps in all (to EOS)"
                                               : std::to_string(a.steps) + " steps";
    std::fprintf(stderr, "thinkv trace: %s: %zu prompts x %s, %d layers, signal over the %s cache -> %s\n",
                 model.name.c_str(), prompts.size(), steps_text.c_str(), mc.n_layers,
                 std::string(to_string(a.mode)).c_str(), a.output.c_str());
    std::fprintf(stderr, "  layer  mean sparsity  min    max\n");
    for (std::size_t l = 0; l < L; ++l) {
      double sum = 0, lo = 1, hi = 0;
      long n = 0;
      for (const PromptTrace& pt : trace.prompts) {
        for (std::size_t i = 0; i < pt.steps.size(); ++i) {
          const double x = pt.values[i * L + l];
          sum += x;
          lo = std::min(lo, x);
          hi = std::max(hi, x);
          ++n;
        }
      }
      std::fprintf(stderr, "  l%-5zu %.3f          %.3f  %.3f\n", l, n ? sum / static_cast<double>(n) : 0.0, lo, hi);
    }
  }
  return 0;
}
