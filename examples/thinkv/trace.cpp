// `thinkv trace`: per-layer attention sparsity of every decode step, recorded on a real model
// with a FullKV cache (ThinKvConfig::trace_all_layers) and written in the sparsity-trace CSV
// format read by `thinkv calibrate` (include/thinkv/thought/trace.hpp, docs/calibration.md).

#include "trace.hpp"

#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "../decoder/cli_util.hpp"
#include "../decoder/decoder.hpp"
#include "thinkv/thought/trace.hpp"

namespace {

using namespace thinkv;
using namespace thinkv::decoder;
using namespace thinkv::decoder::cli;

constexpr const char* kUsage =
    "usage: thinkv trace --model PATH [--prompt TEXT | --prompts FILE] --steps N -o TRACE.csv\n"
    "                    [--tokenizer PATH] [--group G] [--threads N] [--progress] [--quiet]\n";

constexpr const char* kHelp =
    "\n"
    "Decodes greedily with a FullKV cache and records, after every decode step, the attention\n"
    "sparsity of each layer (share of softmax probabilities below 1% of the row maximum, mean "
    "over\n"
    "query heads) in the sparsity-trace CSV format that `thinkv calibrate` reads.\n"
    "\n"
    "  --model PATH       model file (searched like `thinkv generate --model`)\n"
    "  --prompt TEXT      one prompt (default: start from BOS); id p0\n"
    "  --prompts FILE     one prompt per line ('#' lines and blank lines skipped); ids p0, p1, "
    "...\n"
    "  --steps N          decode steps per prompt (prompt + steps must fit the context)\n"
    "  -o, --output PATH  trace file to write ('-' for stdout)\n"
    "  --group G          cache group size (default 16; 8 when head_dim % 16 != 0)\n"
    "  --quiet            no per-layer summary on stderr\n"
    "\n"
    "Step s of a prompt is the decode step that chooses generated token s (step 0 attends over "
    "the\n"
    "prompt). Generation does not stop at BOS/EOS, so every prompt has N steps.\n"
    "\n"
    "Example:\n"
    "  thinkv trace --model stories260K.bin --prompts prompts.txt --steps 300 -o trace.csv\n"
    "  thinkv calibrate trace.csv -o calib.json --plot densities.svg\n";

int usage_error(const std::string& msg) {
  std::fprintf(stderr, "thinkv trace: %s\n%sRun `thinkv trace --help` for details.\n", msg.c_str(),
               kUsage);
  return kExitUsage;
}

struct Args {
  std::string model, tokenizer, prompt, prompts_file, output;
  bool have_prompt = false;
  int steps = -1;
  int group = 0;
  int threads = 0;
  bool progress = ::isatty(2) != 0;
  bool quiet = false;
  bool help = false;
};

int parse(int argc, char** argv, Args& a) {
  Options o(argc, argv);
  while (o.next()) {
    const std::string_view n = o.name();
    std::string_view v;
    auto need = [&]() { return o.value(v) && !v.empty(); };
    if (n == "-h" || n == "--help") {
      a.help = true;
    } else if (n == "--model") {
      if (!need()) return usage_error("--model needs a file");
      a.model = v;
    } else if (n == "--tokenizer") {
      if (!need()) return usage_error("--tokenizer needs a file");
      a.tokenizer = v;
    } else if (n == "--prompt") {
      if (!o.value(v)) return usage_error("--prompt needs text");
      a.prompt = v;
      a.have_prompt = true;
    } else if (n == "--prompts") {
      if (!need()) return usage_error("--prompts needs a file");
      a.prompts_file = v;
    } else if (n == "-o" || n == "--output") {
      if (!need()) return usage_error(std::string(n) + " needs a file name");
      a.output = v;
    } else if (n == "--steps") {
      if (!need() || !parse_int(v, 1, 1 << 30, a.steps))
        return usage_error("--steps must be an integer >= 1");
    } else if (n == "--group") {
      if (!need() || !parse_int(v, 1, 64, a.group) ||
          (a.group != 8 && a.group != 16 && a.group != 32)) {
        return usage_error("--group must be 8, 16 or 32");
      }
    } else if (n == "--threads") {
      if (!need() || !parse_int(v, 1, 1024, a.threads))
        return usage_error("--threads must be in 1..1024");
    } else if (n == "--progress") {
      a.progress = true;
    } else if (n == "-q" || n == "--quiet") {
      a.quiet = true;
    } else {
      return usage_error("unknown option '" + std::string(o.arg()) + "'");
    }
  }
  if (a.help) return 0;
  if (a.model.empty()) return usage_error("no model given (--model PATH)");
  if (a.steps < 0) return usage_error("no step count given (--steps N)");
  if (a.output.empty()) return usage_error("no output file given (-o trace.csv)");
  if (a.have_prompt && !a.prompts_file.empty())
    return usage_error("give --prompt or --prompts, not both");
  return 0;
}

}  // namespace

int run_trace(int argc, char** argv) {
  Args a;
  if (const int rc = parse(argc, argv, a); rc != 0) return rc;
  if (a.help) {
    std::printf("%s%s", kUsage, kHelp);
    return 0;
  }
  std::vector<std::string> prompts;
  if (!a.prompts_file.empty()) {
    std::ifstream f(a.prompts_file);
    if (!f) {
      std::fprintf(stderr, "thinkv trace: %s: cannot open the prompts file\n",
                   a.prompts_file.c_str());
      return kExitData;
    }
    std::string line;
    while (std::getline(f, line)) {
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line.empty() || line[0] == '#') continue;
      prompts.push_back(line);
    }
    if (prompts.empty()) {
      std::fprintf(stderr, "thinkv trace: %s: no prompts (one per line)\n", a.prompts_file.c_str());
      return kExitData;
    }
  } else {
    prompts.push_back(a.prompt);
  }
  Model model;
  Tokenizer tok;
  if (const int rc = load_model_and_tokenizer("thinkv trace", a.model, a.tokenizer, model, tok);
      rc != 0)
    return rc;
  const ModelConfig& mc = model.config;
  const int threads = a.threads > 0 ? a.threads : default_threads();

  SparsityTrace trace;
  trace.model = model.name;
  trace.num_layers = mc.n_layers;
  Progress progress(a.progress, "thinkv trace: ");
  const auto L = static_cast<std::size_t>(mc.n_layers);
  for (std::size_t p = 0; p < prompts.size(); ++p) {
    const std::vector<int> ptoks = tok.encode(prompts[p], true, false);
    const int P = static_cast<int>(ptoks.size());
    if (P + a.steps - 1 > mc.seq_len) {
      return usage_error("prompt " + std::to_string(p) + " (" + std::to_string(P) + " tokens) + " +
                         std::to_string(a.steps) + " steps exceed the context " +
                         std::to_string(mc.seq_len));
    }
    CacheOptions co;
    co.mode = CacheMode::kFull;
    co.max_tokens = P + a.steps;
    co.group_size = a.group;
    co.trace_all_layers = true;
    ThinKvConfig cfg;
    if (Status s = make_cache_config(mc, co, cfg); !s.is_ok())
      return usage_error("cache configuration: " + s.message());
    PromptTrace pt;
    pt.id = "p" + std::to_string(p);
    RunOptions ro;
    ro.steps = a.steps;
    ro.threads = threads;
    ro.stop_at_bos_eos = false;
    ro.after_step = [&](int step, const SessionCache& cache) -> Status {
      const std::span<const float> sp = cache.layer_sparsity(0);
      for (std::size_t l = 0; l < L; ++l) {
        if (!(sp[l] >= 0.0f && sp[l] <= 1.0f)) {
          return {StatusCode::kInternal, "layer " + std::to_string(l) +
                                             " sparsity was not recorded at step " +
                                             std::to_string(step)};
        }
      }
      pt.steps.push_back(step);
      pt.values.insert(pt.values.end(), sp.begin(), sp.begin() + static_cast<std::ptrdiff_t>(L));
      progress.update("prompt " + std::to_string(p + 1) + "/" + std::to_string(prompts.size()) +
                      ", step " + std::to_string(step + 1) + "/" + std::to_string(a.steps));
      return Status::ok();
    };
    RunStats st;
    if (Status s = run_sequence(model, cfg, ptoks, ro, st); !s.is_ok()) {
      progress.clear();
      std::fprintf(stderr, "thinkv trace: %s\n", s.to_string().c_str());
      return kExitData;
    }
    trace.prompts.push_back(std::move(pt));
  }
  progress.clear();

  Status ws;
  if (a.output == "-") {
    ws = write_sparsity_trace(std::cout, trace);
  } else {
    std::ofstream f(a.output, std::ios::binary);
    if (!f) {
      std::fprintf(stderr, "thinkv trace: cannot write %s\n", a.output.c_str());
      return kExitData;
    }
    ws = write_sparsity_trace(f, trace);
  }
  if (!ws.is_ok()) {
    std::fprintf(stderr, "thinkv trace: %s\n", ws.to_string().c_str());
    return kExitData;
  }
  if (!a.quiet) {
    std::fprintf(stderr, "thinkv trace: %s: %zu prompts x %d steps, %d layers -> %s\n",
                 model.name.c_str(), prompts.size(), a.steps, mc.n_layers, a.output.c_str());
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
      std::fprintf(stderr, "  l%-5zu %.3f          %.3f  %.3f\n", l,
                   n ? sum / static_cast<double>(n) : 0.0, lo, hi);
    }
  }
  return 0;
}
