// `thinkv generate`: decode on a real Llama model with the KV cache in mode full / tbq / tbe /
// thinkv; `thinkv sweep`: fidelity vs memory over modes and budgets (docs/results.md).
// Flags and JSON fields: examples/thinkv/README.md. The decoder itself is header-only in
// examples/decoder/ (the attention runs inside thinkv::ThinKvCache).

#include "generate.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "../decoder/cli_util.hpp"
#include "../decoder/decoder.hpp"
#include "cache_flags.hpp"
#if defined(THINKV_HAVE_KERNELS)
#include "thinkv/backend/cuda_backend.hpp"
#if defined(THINKV_HAVE_GPU_DECODER)
#include "../decoder/gpu_transformer.hpp"
#endif
#endif
#include "thinkv/thought/calibration_file.hpp"

namespace {

using namespace thinkv;
using namespace thinkv::decoder;
using namespace thinkv::decoder::cli;
using Json = nlohmann::ordered_json;

constexpr const char* kGenerateUsage =
    "usage: thinkv generate -m PATH [-n STEPS] [-p TEXT | -f FILE | --problems FILE --problem N|ID]\n"
    "                       [-c CTX] [-t THREADS] [-s SEED] [-r REPEAT]\n"
    "                       [--mode METHOD] [--budget K] [--tokenizer PATH] [--temperature T]\n"
    "                       [--seed S] [--compare full] [--calibration calib.json] [--group G]\n"
    "                       [--segment L] [--tau T] [--precision R4E4T2] [--select kmeans|first]\n"
    "                       [--answer-pattern REGEX] [--threads N] [--backend cpu|cuda] [--json]\n"
    "                       [--progress]\n";

constexpr const char* kGenerateHelp =
    "\n"
    "Decodes on a Llama model (llama2.c .bin, llama2.c v2 Q8_0 .bin, or GGUF 'llama' in F32/F16/\n"
    "BF16/Q8_0) with every attention inside ThinKV's KV cache. Without --prompt, decoding starts\n"
    "from BOS as llama2.c does. The generated text goes to stdout as it is decoded; the summary\n"
    "(speed, KV memory vs FullKV FP16, eviction and reuse counters, fidelity) goes to stderr.\n"
    "\n"
    "  -m, --model PATH     model file; a bare file name is also looked up in $THINKV_MODELS,\n"
    "                       ./models and ../shared/models\n"
    "  --tokenizer PATH     llama2.c tokenizer.bin (default: the GGUF's own, or tok<vocab>.bin /\n"
    "                       tokenizer.bin next to a .bin model)\n"
    "  -p, --prompt TEXT    prompt (default: none, start from BOS)\n"
    "  -f, --file FILE      the prompt is the file's content\n"
    "  -c, --ctx-size N     positions at most (prompt + generated; default: the model's context)\n"
    "  -r, --repeat N       time N runs (the text is printed once): prompt processing and generation\n"
    "                       speed as mean +- standard deviation\n"
    "  --problems FILE      a JSONL problem set (as `thinkv eval` reads); --problem N or ID picks\n"
    "                       one (default 0): its prompt is decoded and its answer checked\n"
    "  --answer-pattern R   how the answer is found in the output (default: Answer: (\\d+)); with\n"
    "                       --problems or --compare the summary shows it and FullKV's\n"
    "  -n, --steps N        tokens to generate (prompt + steps must fit the model's context; with\n"
    "                       --problems the default is up to the context, ending at EOS)\n"
    "  --mode M             the KV-cache method: thinkv (TBQ + TBE, default), tbq (thought-based\n"
    "                       quantization), tbe (thought-based eviction), full (FullKV in FP16),\n"
    "                       full-bf16 (ThinKV's paged cache, BF16 pages, nothing else), nvfp4,\n"
    "                       kivi2, kivi4, streamingllm, h2o, rkv (baselines), tbe-first and\n"
    "                       thinkv-first (ablations keeping each segment's first tokens)\n"
    "  --select S           which tokens a shrinking segment keeps: kmeans (default), first, last\n"
    "  --keep-prompt        (default) the prompt is never evicted and is stored as R; the budget\n"
    "                       counts the generated tokens. --compress-prompt: the prompt too\n"
    "  --budget K           live tokens per KV stream for the methods that evict (default:\n"
    "                       context / 4)\n"
    "  --group G            quantization group 8, 16 or 32 (default 16; 8 when head_dim % 16 != "
    "0)\n"
    "  --segment L          thought segment length (default min(128, context/4), in tbe/thinkv\n"
    "                       at most --budget; a multiple of G)\n"
    "  --tau T              classifier refresh period (default: the calibration's, else "
    "--segment)\n"
    "  --precision MAP      TBQ bits per thought, e.g. R4E4T2 (default), R8E4T2, R8E8T4\n"
    "  --calibration FILE   thought classifier from `thinkv calibrate` (default: uncalibrated,\n"
    "                       every token R)\n"
    "  --temperature T      0 = greedy (default); > 0 samples softmax(logits / T)\n"
    "  -s, --seed S         sampling seed (default 42)\n"
    "  --compare full       also run FullKV (FP16) on the same prompt and report fidelity: share of\n"
    "                       identical greedy tokens, mean KL(full || mode) teacher-forced on the\n"
    "                       FullKV tokens, first divergent step\n"
    "  -t, --threads N      threads for the matrix products (default: all cores, or "
    "$THINKV_THREADS)\n"
    "  --backend B          where the model and the KV cache run: cpu (default, the reference)\n"
    "                       or cuda (the GPU decoder: weights on the GPU, FP32 for an F32 model\n"
    "                       file, else BF16; cuBLAS GEMMs; ThinKV's cache in device memory with\n"
    "                       its quantize-append, attention and K-means kernels; needs a CUDA build\n"
    "                       and a GPU). --compare's FullKV reference runs on the CPU.\n"
    "  --json               print one JSON object as the last line of stdout\n"
    "  --progress           progress line on stderr, always (default: while decoding, only when\n"
    "                       stderr is a terminal and stdout is not, so the line never tears the\n"
    "                       text; during --compare full, which runs after the text is complete,\n"
    "                       whenever stderr is a terminal)\n"
    "\n"
    "Exit status: 0 ok, 1 data error (missing or corrupt file, cache error), 2 usage error.\n"
    "\n"
    "Example:\n"
    "  thinkv generate --model stories260K.bin --steps 200 --mode full\n"
    "  thinkv generate --model stories260K.bin --steps 300 --mode thinkv --budget 64 --compare "
    "full --json\n";

std::string precision_text(const ThinKvSpec& k) {
  return quantizes(k.mode) ? k.precision.to_string() : std::string("BF16");
}

/// Reads prompts (one per line; blank lines and lines starting with '#' are skipped).
bool read_prompts(const std::string& path, std::vector<std::string>& out, std::string& err) {
  std::ifstream f(path);
  if (!f) {
    err = path + ": cannot open the prompts file";
    return false;
  }
  std::string line;
  while (std::getline(f, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || line[0] == '#') continue;
    out.push_back(line);
  }
  if (out.empty()) {
    err = path + ": no prompts (one per line; blank lines and '#' lines are skipped)";
    return false;
  }
  return true;
}

// ---- generate --------------------------------------------------------------------------------

struct GenerateArgs {
  std::string model, tokenizer, prompt;
  std::string problems, problem = "0", answer_pattern = "Answer: (\\d+)";
  bool have_prompt = false;
  int steps = -1;
  int ctx = 0;     ///< -c: positions at most (prompt + generated); 0 = the model's context
  int repeat = 1;  ///< -r: timed runs (the first prints the text)
  Method method = Method::kThinKv;
  CacheFlags cache;
  float temperature = 0.0f;
  std::uint64_t seed = 42;
  bool compare = false;
  bool json = false;
  bool progress = default_progress();
  bool help = false;
  int threads = 0;
  std::string backend = "cpu";
};

int parse_generate(int argc, char** argv, GenerateArgs& a) {
  ArgParser p("generate", kGenerateUsage);
  add_cache_options(p, a.cache);
  p.text("-m,--model", a.model, "a file");
  p.text("--tokenizer", a.tokenizer, "a file");
  p.value("-p,--prompt", [&a](const std::string& v) {
    a.prompt = v;  // may be empty: the BOS token alone
    a.have_prompt = true;
    return std::string();
  });
  p.value("-f,--file", [&a](const std::string& v) {
    if (v.empty()) return std::string("needs a prompt file");
    std::ifstream f{v, std::ios::binary};
    if (!f) return std::string("cannot open the prompt file");
    std::ostringstream all;
    all << f.rdbuf();
    a.prompt = all.str();
    a.have_prompt = true;
    return std::string();
  });
  p.integer("-c,--ctx-size", a.ctx, 1, 1 << 30, "must be an integer >= 1");
  p.integer("-r,--repeat", a.repeat, 1, 1000, "must be an integer in 1..1000");
  p.integer("-n,--steps", a.steps, 1, 1 << 30, "must be an integer >= 1");
  p.value("--mode", [&a](const std::string& v) {
    const auto m = parse_method(v);
    if (!m) return "must be one of " + method_names();
    a.method = *m;
    return std::string();
  });
  p.text("--problems", a.problems, "a JSONL file");
  p.text("--problem", a.problem, "an index or an id");
  p.text("--answer-pattern", a.answer_pattern, "a regular expression");
  p.value("--temperature", [&a](const std::string& v) {
    return parse_float(v, a.temperature) && a.temperature >= 0.0f ? std::string()
                                                                  : std::string("must be a number >= 0");
  });
  p.value("-s,--seed", [&a](const std::string& v) {
    return parse_u64(v, a.seed) ? std::string() : std::string("must be an unsigned integer");
  });
  p.value("--compare", [&a](const std::string& v) {
    if (v != "full") return std::string("only `--compare full` is supported");
    a.compare = true;
    return std::string();
  });
  p.integer("-t,--threads", a.threads, 1, 1024, "must be an integer in 1..1024");
  p.value("--backend", [&a](const std::string& v) {
    if (v != "cpu" && v != "cuda") return std::string("must be cpu or cuda");
    a.backend = v;
    return std::string();
  });
  p.flag("--json", a.json);
  p.flag("--progress", a.progress);
  if (const int rc = p.parse(argc, argv); rc != 0) return rc;
  a.help = p.help();
  if (a.help) return 0;
  if (a.model.empty()) return p.error("no model given (--model PATH)");
  if (!a.problems.empty() && a.have_prompt) return p.error("give --prompt or --problems, not both");
  if (a.steps < 0 && a.problems.empty()) return p.error("no step count given (--steps N)");
  return 0;
}

/// The prompt, answer and id of problem `which` (a 0-based index or an id) of a JSONL file.
bool read_problem(const std::string& path, const std::string& which, std::string& prompt, std::string& answer,
                  std::string& id, std::string& err) {
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    err = path + ": cannot open the problems file";
    return false;
  }
  int index = -1;
  const bool numeric = parse_int(which, 0, 1 << 30, index);
  std::string line;
  int no = 0, k = 0;
  while (std::getline(f, line)) {
    ++no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    const Json v = Json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!v.is_object()) {
      err = path + ":" + std::to_string(no) + ": not a JSON object";
      return false;
    }
    // A string as it is, a number as its JSON text, anything else as "".
    auto text_of = [&](const char* key) -> std::string {
      const auto it = v.find(key);
      if (it == v.end()) return "";
      if (it->is_string()) return it->get<std::string>();
      return it->is_number() ? it->dump() : "";
    };
    const std::string this_id = text_of("id");
    if ((numeric && k == index) || (!numeric && this_id == which)) {
      const auto p = v.find("prompt");
      if (p == v.end() || !p->is_string() || p->get_ref<const std::string&>().empty()) {
        err = path + ":" + std::to_string(no) + ": field 'prompt' is missing or not a non-empty string";
        return false;
      }
      prompt = p->get<std::string>();
      answer = text_of("answer");
      id = this_id;
      return true;
    }
    ++k;
  }
  err = path + ": no problem " +
        (numeric ? "with index " + which + " (it has " + std::to_string(k) + ")" : "with id '" + which + "'");
  return false;
}

/// The answer `re` takes from text: its last match (the first capture group, if any).
bool extract_last(const std::regex& re, const std::string& text, std::string& out) {
  bool found = false;
  for (auto it = std::sregex_iterator(text.begin(), text.end(), re); it != std::sregex_iterator(); ++it) {
    out = it->size() > 1 ? (*it)[1].str() : (*it)[0].str();
    found = true;
  }
  return found;
}

/// "prompt 0-133 | R 134-255 (kept 64) | T 256-383 (kept 32) | ...": the thought segments (the
/// pinned prompt's segments as one), with what each keeps when it was shrunk.
std::string segments_text(const std::vector<SegmentState>& segs) {
  std::string s;
  for (std::size_t i = 0; i < segs.size(); ++i) {
    const SegmentState& g = segs[i];
    std::size_t last = i;
    if (g.pinned) {
      while (last + 1 < segs.size() && segs[last + 1].pinned) ++last;
    }
    const std::int32_t end = last + 1 < segs.size() ? segs[last + 1].start - 1 : segs[last].start + segs[last].size - 1;
    s += (i ? " | " : "") + (g.pinned ? std::string("prompt") : std::string(to_string(g.type))) + " " +
         std::to_string(g.start) + "-" + std::to_string(std::max(g.start, end));
    if (!g.pinned && g.level > 0) s += " (kept " + std::to_string(g.size) + ")";
    i = last;
  }
  return s;
}

Json fidelity_json(const Fidelity& f) {
  return Json{
      {"reference", "full"},  {"steps", f.steps},   {"token_agreement", f.token_agreement},
      {"mean_kl", f.mean_kl}, {"max_kl", f.max_kl}, {"first_divergence", f.first_divergence},
  };
}

}  // namespace

int run_generate(int argc, char** argv) {
  const char* cmd = "generate";
  GenerateArgs a;
  if (const int rc = parse_generate(argc, argv, a); rc != 0) return rc;
  if (a.help) {
    std::printf("%s%s", kGenerateUsage, kGenerateHelp);
    return 0;
  }
  std::regex pattern;
  try {
    pattern = std::regex(a.answer_pattern, std::regex::ECMAScript);
  } catch (const std::regex_error& e) {
    return usage_error(cmd, kGenerateUsage,
                       "--answer-pattern '" + a.answer_pattern + "' is not a valid regular expression: " + e.what());
  }
  // --problems FILE --problem N|ID: the prompt (and expected answer) of one problem.
  std::string expected, problem_id;
  if (!a.problems.empty()) {
    std::string err;
    if (!read_problem(a.problems, a.problem, a.prompt, expected, problem_id, err)) {
      std::fprintf(stderr, "thinkv generate: %s\n", err.c_str());
      return kExitData;
    }
  }
  Model model;
  Tokenizer tok;
  if (const int rc = load_model_and_tokenizer("thinkv generate", a.model, a.tokenizer, model, tok); rc != 0) return rc;
  const ModelConfig& mc = model.config;
  const std::vector<int> prompt = tok.encode(a.prompt, true, false);
  const int P = static_cast<int>(prompt.size());
  if (a.ctx > mc.seq_len) {
    return usage_error(
        cmd, kGenerateUsage,
        "-c " + std::to_string(a.ctx) + " exceeds " + model.name + "'s context of " + std::to_string(mc.seq_len));
  }
  const int ctx = a.ctx > 0 ? a.ctx : mc.seq_len;
  if (a.steps < 0) a.steps = std::max(1, ctx - P + 1);  // a problem: up to the context (or EOS)
  if (P + a.steps - 1 > ctx) {
    return usage_error(cmd, kGenerateUsage,
                       "the prompt (" + std::to_string(P) + " tokens with BOS) + " + std::to_string(a.steps) +
                           " steps need " + std::to_string(P + a.steps - 1) + " positions; " +
                           (a.ctx > 0 ? "-c allows " : model.name + " has a context of ") + std::to_string(ctx) +
                           " (use --steps " + std::to_string(std::max(1, ctx - P + 1)) + " or fewer)");
  }
  ThoughtClassifier classifier;
  if (const int rc = load_classifier(cmd, a.cache, model, classifier); rc != 0) return rc;
  auto spec_for = [&](Method m, CacheSpec& out) {
    MethodOptions mo;
    mo.method = m;
    mo.cache = cache_options(a.cache, thinkv_mode(m), P + a.steps, classifier, P);
    mo.selection = a.cache.selection;
    return make_cache_spec(mc, mo, out);
  };
  CacheSpec spec;
  if (Status s = spec_for(a.method, spec); !s.is_ok()) {
    return usage_error(cmd, kGenerateUsage,
                       "cache configuration for " + model.name + " (" + mc.to_string() + "): " + s.message());
  }
  const ThinKvSpec* cfg = std::get_if<ThinKvSpec>(&spec);
  const int threads = a.threads > 0 ? a.threads : default_threads();

  // The run: text to stdout as it is decoded.
  Progress progress(a.progress, "thinkv generate: ");
  RunOptions ro;
  ro.steps = a.steps;
  ro.temperature = a.temperature;
  ro.seed = a.seed;
  ro.bos_id = tok.bos_id;
  ro.eos_id = tok.eos_id;
  ro.threads = threads;
  if (a.backend == "cuda") {
    if (cfg == nullptr) {
      return usage_error(cmd, kGenerateUsage,
                         "--backend cuda serves ThinKV's cache (full-bf16, tbq, tbe, thinkv, nvfp4 and the "
                         "-first ablations); " +
                             std::string(to_string(a.method)) + " is a CPU baseline");
    }
#if defined(THINKV_HAVE_KERNELS)
    // --compare's teacher-forced run keeps the CPU model over the device cache.
    ro.backend = [] { return std::make_unique<BackendModel<CudaKvBackend>>(); };
#if defined(THINKV_HAVE_GPU_DECODER)
    ro.engine = gpu_engine(
        model, GpuDecoderOptions{model.weight_type == WeightType::kF32 ? GpuWeightType::kF32 : GpuWeightType::kBF16});
#endif
#else
    std::fprintf(stderr,
                 "thinkv generate: --backend cuda: this thinkv was built without CUDA kernels "
                 "(thinkv::kernels); rebuild with a CUDA toolkit (nvcc) on the PATH, or use "
                 "--backend cpu\n");
    return kExitData;
#endif
  }
  const auto t_start = std::chrono::steady_clock::now();
  std::string text;
  // When stdout is the terminal the status line is drawn on (forced with --progress), the line
  // may only be drawn where the text has just ended a line: erasing it then erases nothing of the
  // text. In the middle of a text line the text itself shows the progress.
  const bool shared_terminal = ::isatty(1) != 0 && ::isatty(2) != 0;
  bool at_line_start = true;
  ro.on_token = [&](int prev, int t) {
    const std::string piece = tok.decode_piece(prev, t);
    text += piece;
    progress.clear();
    std::fwrite(piece.data(), 1, piece.size(), stdout);
    std::fflush(stdout);
    if (!piece.empty()) at_line_start = piece.back() == '\n';
  };
  ro.on_step = [&](int step) {
    if (progress.enabled() && (!shared_terminal || at_line_start)) {
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
      progress.update("step " + std::to_string(step + 1) + "/" + std::to_string(a.steps) + ", " +
                      fmt("%.1f", s > 0 ? (step + 1) / s : 0.0) + " tok/s");
    }
  };
  RunStats st;
  if (Status s = run_sequence(model, spec, prompt, ro, st); !s.is_ok()) {
    progress.clear();
    std::fprintf(stderr, "\nthinkv generate: %s\n", s.to_string().c_str());
    return kExitData;
  }
  progress.clear();
  std::printf("\n");
  std::fflush(stdout);
  // Prompt processing and generation speed, over --repeat runs (the first is the one above).
  std::vector<double> pp_speed, tg_speed;
  auto add_speed = [&](const RunStats& r) {
    const int gen_passes = r.forward_passes - P;
    if (r.prompt_seconds > 0) pp_speed.push_back(P / r.prompt_seconds);
    if (gen_passes > 0 && r.seconds > r.prompt_seconds) tg_speed.push_back(gen_passes / (r.seconds - r.prompt_seconds));
  };
  add_speed(st);
  for (int r = 1; r < a.repeat; ++r) {
    RunOptions rr = ro;
    rr.on_token = nullptr;
    rr.on_step = nullptr;
    RunStats again;
    if (Status s = run_sequence(model, spec, prompt, rr, again); !s.is_ok()) {
      std::fprintf(stderr, "thinkv generate: repeat %d: %s\n", r + 1, s.to_string().c_str());
      return kExitData;
    }
    add_speed(again);
  }
  auto mean_sd = [](const std::vector<double>& x) {
    if (x.empty()) return std::string("-");
    double m = 0, v = 0;
    for (double y : x) m += y;
    m /= static_cast<double>(x.size());
    for (double y : x) v += (y - m) * (y - m);
    const double sd = x.size() > 1 ? std::sqrt(v / static_cast<double>(x.size() - 1)) : 0.0;
    return fmt("%.1f", m) + (x.size() > 1 ? " +- " + fmt("%.1f", sd) : std::string());
  };

  Fidelity fid;
  std::string full_text;
  if (a.compare) {
    CacheSpec full_spec;
    if (Status s = spec_for(Method::kFull, full_spec); !s.is_ok()) {
      std::fprintf(stderr, "thinkv generate: FullKV configuration: %s\n", s.to_string().c_str());
      return kExitData;
    }
    RunOptions mo = ro;  // the backend serves the method's cache; FullKV FP16 runs on the CPU
    mo.on_token = nullptr;
    mo.on_step = nullptr;
    mo.engine = nullptr;
    // The text is complete (and ended by its newline), so a status line cannot tear it: this
    // phase shows one whenever stderr is a terminal, even where the decode phase left the
    // terminal to the text (stdout and stderr on the same terminal).
    Progress compare_progress(a.progress || ::isatty(2) != 0, "thinkv generate: ");
    const bool greedy = !(a.temperature > 0.0f);
    compare_progress.update("comparing with FullKV on the same prompt (" + std::to_string(a.steps) + " steps)...",
                            true);
    // The FullKV run and the method teacher-forced on it; the method's own tokens are this run's.
    if (Status s = measure_fidelity(model, full_spec, spec, prompt, a.steps, mo, greedy ? &st.tokens : nullptr, fid);
        !s.is_ok()) {
      compare_progress.clear();
      std::fprintf(stderr, "thinkv generate: fidelity run: %s\n", s.to_string().c_str());
      return kExitData;
    }
    compare_progress.clear();
    full_text = tok.decode(fid.full_tokens, prompt.back());
  }

  // Summary (stderr).
  const int gen = static_cast<int>(st.tokens.size());
  const double tps = st.seconds > 0 ? (st.forward_passes) / st.seconds : 0.0;
  const CacheReport& rep = st.report;
  const std::int64_t positions = st.forward_passes;  // tokens the cache holds positions for
  const double ratio = rep.held_ratio();
  const int streams = mc.n_layers * mc.n_kv_heads;
  const bool calibrated = cfg != nullptr && cfg->classifier.needs_signal() && cfg->mode != CacheMode::kFull;
  const ThoughtStats& ts = st.thought_stats;
  std::fprintf(stderr, "thinkv generate: %s (%s, %s weights, %s)\n", model.name.c_str(), model.format.c_str(),
               to_string(model.weight_type), mc.to_string().c_str());
  if (cfg != nullptr) {
    std::fprintf(stderr, "  cache: mode %s (%s), precision %s, budget %s, group %d, segment %d, tau %d, block %d\n",
                 std::string(to_string(a.method)).c_str(), st.method.c_str(), precision_text(*cfg).c_str(),
                 evicts(cfg->mode) ? std::to_string(cfg->token_budget).c_str() : "none (no eviction)", cfg->group_size,
                 cfg->segment_len, cfg->classifier.tau(), cfg->block_size);
    if (cfg->mode == CacheMode::kFull) {
      std::fprintf(stderr, "  classifier: not used in mode full-bf16\n");
    } else if (calibrated) {
      std::fprintf(stderr, "  classifier: %s from %s; refreshes %lld, tokens R/E/T %lld/%lld/%lld\n",
                   cfg->classifier.to_string().c_str(), a.cache.calibration.c_str(),
                   static_cast<long long>(ts.refreshes), static_cast<long long>(ts.tokens[0]),
                   static_cast<long long>(ts.tokens[1]), static_cast<long long>(ts.tokens[2]));
    } else {
      std::fprintf(stderr,
                   "  classifier: uncalibrated (every token R); calibrate with `thinkv trace` + "
                   "`thinkv calibrate` and pass --calibration\n");
    }
    if (calibrated && evicts(cfg->mode)) std::fprintf(stderr, "  thoughts: %s\n", segments_text(st.segments).c_str());
  } else {
    std::fprintf(stderr, "  cache: mode %s (%s; a CPU baseline, keys and values in FP16 unless quantized)\n",
                 std::string(to_string(a.method)).c_str(), st.method.c_str());
  }
  std::fprintf(stderr,
               "  speed: %d tokens generated (prompt %d) in %.3f s: %.1f tokens/s (%d forward "
               "passes, %d threads, KV backend %s)\n"
               "         prompt processing %s tokens/s, generation %s tokens/s%s\n",
               gen, P, st.seconds, tps, st.forward_passes, threads, cfg ? a.backend.c_str() : "cpu",
               mean_sd(pp_speed).c_str(), mean_sd(tg_speed).c_str(),
               a.repeat > 1 ? (" (mean +- sd of " + std::to_string(a.repeat) + " runs)").c_str() : "");
  std::fprintf(stderr, "  KV memory: %s held (peak %s, allocated %s) vs FullKV FP16 %s for %lld positions: %.1f %%\n",
               human_bytes(rep.held_bytes).c_str(), human_bytes(st.peak_physical_bytes).c_str(),
               human_bytes(rep.allocated_bytes).c_str(), human_bytes(st.fullkv_fp16_bytes_all_positions).c_str(),
               static_cast<long long>(positions), 100.0 * ratio);
  std::fprintf(stderr, "             live tokens %lld per stream (max %lld; %d streams)",
               static_cast<long long>(rep.live_tokens / std::max(1, streams)),
               static_cast<long long>(st.max_live_tokens), streams);
  if (cfg != nullptr) std::fprintf(stderr, ", hole slots %lld", static_cast<long long>(st.final_memory.hole_slots));
  std::fprintf(stderr, "\n");
  const double ev_per_step =
      positions > 0 ? static_cast<double>(rep.eviction_calls) / static_cast<double>(positions) : 0.0;
  if (cfg != nullptr) {
    std::fprintf(stderr,
                 "  eviction: %.4f calls per step (%lld calls, %lld tokens evicted, %lld token selections, %lld case-1 "
                 "step-downs), slots reused %lld, gather bytes %lld, budget unreachable on %lld steps\n",
                 ev_per_step, static_cast<long long>(st.cache_stats.eviction_calls),
                 static_cast<long long>(st.cache_stats.tokens_evicted),
                 static_cast<long long>(st.cache_stats.selections), static_cast<long long>(st.cache_stats.case1_steps),
                 static_cast<long long>(st.table_stats.slots_reused), static_cast<long long>(rep.gather_bytes),
                 static_cast<long long>(st.cache_stats.budget_unreachable));
  } else {
    std::fprintf(stderr, "  eviction: %.4f calls per step (%lld calls, %lld tokens evicted), gather bytes %lld\n",
                 ev_per_step, static_cast<long long>(rep.eviction_calls), static_cast<long long>(rep.tokens_evicted),
                 static_cast<long long>(rep.gather_bytes));
  }
  if (a.compare) {
    const std::string divergence = fid.first_divergence < 0
                                       ? std::string("first divergence: none")
                                       : "first divergence at step " + std::to_string(fid.first_divergence);
    std::fprintf(stderr,
                 "  fidelity vs full (FP16, greedy, %d steps): token agreement %.1f %%, mean KL(full || "
                 "%s) %.4g nats "
                 "(max %.3g), %s\n",
                 fid.steps, 100.0 * fid.token_agreement, std::string(to_string(a.method)).c_str(), fid.mean_kl,
                 fid.max_kl, divergence.c_str());
  }
  std::string answer, full_answer;
  const bool answered = extract_last(pattern, text, answer);
  const bool full_answered = a.compare && extract_last(pattern, full_text, full_answer);
  if (!a.problems.empty() || a.compare) {
    std::string line = "  answer: " + (answered ? answer : std::string("none (no match for ") + a.answer_pattern + ")");
    if (!expected.empty())
      line += ", expected " + expected + (answered && answer == expected ? " (right)" : " (wrong)");
    if (a.compare) {
      line += "; FullKV's: " + (full_answered ? full_answer : std::string("none"));
      line += answered == full_answered && answer == full_answer ? " (the same)" : " (differs)";
    }
    if (answered || !a.problems.empty() || full_answered) std::fprintf(stderr, "%s\n", line.c_str());
  }

  if (a.json) {
    const int budget = cfg != nullptr                                ? (evicts(cfg->mode) ? cfg->token_budget : 0)
                       : std::holds_alternative<DenseKvConfig>(spec) ? std::get<DenseKvConfig>(spec).token_budget
                                                                     : 0;
    Json o{
        {"model", model.name},
        {"model_path", model.path},
        {"format", model.format},
        {"weights", to_string(model.weight_type)},
        {"mode", (std::string(to_string(a.method)))},
        {"cache", st.method},
        {"precision", (cfg ? precision_text(*cfg) : std::string("fp16"))},
        {"budget", budget},
        {"group_size", cfg ? cfg->group_size : 0},
        {"segment_len", cfg ? cfg->segment_len : 0},
        {"tau", cfg ? cfg->classifier.tau() : 0},
        {"calibrated", calibrated},
        {"temperature", a.temperature},
        {"seed", static_cast<long long>(a.seed)},
        {"prompt_tokens", P},
        {"steps", a.steps},
        {"generated_tokens", gen},
        {"forward_passes", st.forward_passes},
        {"seconds", st.seconds},
        {"tokens_per_s", tps},
        {"prompt_seconds", st.prompt_seconds},
        {"prompt_tokens_per_s", (pp_speed.empty() ? 0.0 : pp_speed.front())},
        {"generation_tokens_per_s", (tg_speed.empty() ? 0.0 : tg_speed.front())},
        {"repeat", a.repeat},
        {"threads", threads},
        {"backend", cfg ? a.backend : std::string("cpu")},
        {"kv_bytes", rep.held_bytes},
        {"kv_bytes_peak", st.peak_physical_bytes},
        {"kv_bytes_allocated", rep.allocated_bytes},
        {"fullkv_fp16_bytes", st.fullkv_fp16_bytes_all_positions},
        {"kv_ratio", ratio},
        {"live_tokens", rep.live_tokens / std::max(1, streams)},
        {"max_live_tokens", st.max_live_tokens},
        {"hole_slots", st.final_memory.hole_slots},
        {"eviction_calls", rep.eviction_calls},
        {"eviction_calls_per_step", ev_per_step},
        {"tokens_evicted", rep.tokens_evicted},
        {"case1_steps", st.cache_stats.case1_steps},
        {"slots_reused", st.table_stats.slots_reused},
        {"gather_bytes", rep.gather_bytes},
        {"budget_unreachable_steps", st.cache_stats.budget_unreachable},
        {"refreshes", ts.refreshes},
        {"thought_tokens", Json{{"R", ts.tokens[0]}, {"E", ts.tokens[1]}, {"T", ts.tokens[2]}}},
        {"answer", answered ? Json(answer) : Json(nullptr)},
        {"expected_answer", expected.empty() ? Json(nullptr) : Json(expected)},
        {"full_answer", full_answered ? Json(full_answer) : Json(nullptr)},
        {"fidelity", a.compare ? fidelity_json(fid) : Json(nullptr)},
    };
    std::printf("%s\n", o.dump(-1, ' ', false, Json::error_handler_t::replace).c_str());
    std::fflush(stdout);
  }
  return 0;
}

// ---- sweep ------------------------------------------------------------------------------------

namespace {

constexpr const char* kSweepUsage =
    "usage: thinkv sweep --model PATH [--tokenizer PATH] [--prompts FILE] [--steps N]\n"
    "                    [--modes full,tbq,tbe,thinkv] [--budgets 32,64,128,256] [--group G]\n"
    "                    [--segment L] [--tau T] [--precision MAP] [--calibration FILE]\n"
    "                    [--md TABLE.md] [--svg PLOT.svg] [--json FILE] [--csv FILE] [--threads N]\n"
    "                    [--progress]\n";

constexpr const char* kSweepHelp =
    "\n"
    "Fidelity vs memory: for every mode and budget (budgets only matter for tbe and thinkv) and\n"
    "every prompt, decodes `--steps` greedy tokens and compares with FullKV on the same prompt\n"
    "(token agreement, mean KL(full || mode) teacher-forced on the FullKV tokens, first\n"
    "divergence), and measures the KV bytes held at the end against FullKV FP16 for the same\n"
    "positions. Prints a markdown table (to stdout, or --md FILE) and writes an SVG plot (--svg).\n"
    "\n"
    "  --prompts FILE   one prompt per line ('#' lines and blank lines skipped); default: five\n"
    "                   built-in story openings\n"
    "  --steps N        tokens per prompt (default 300)\n"
    "  --modes LIST     default full,tbq,tbe,thinkv\n"
    "  --budgets LIST   default 32,64,128,256\n"
    "  other cache flags as in `thinkv generate`\n";

const std::vector<std::string> kDefaultPrompts = {
    "Once upon a time, there was a little dog", "Tom and his sister went to the park",  "One day, a big bird flew",
    "Lily wanted to bake a cake for her mom",   "The sun was shining and the children",
};

struct SweepArgs {
  std::string model, tokenizer, prompts_file, md, svg, json, csv;
  int steps = 300;
  std::vector<CacheMode> modes{CacheMode::kFull, CacheMode::kTbq, CacheMode::kTbe, CacheMode::kThinKv};
  std::vector<int> budgets{32, 64, 128, 256};
  CacheFlags cache;
  int threads = 0;
  bool progress = false;
  bool help = false;
};

int parse_sweep(int argc, char** argv, SweepArgs& a) {
  ArgParser p("sweep", kSweepUsage);
  a.progress = ::isatty(2) != 0;
  add_cache_options(p, a.cache);
  p.text("--model", a.model, "a file");
  p.text("--tokenizer", a.tokenizer, "a file");
  p.text("--prompts", a.prompts_file, "a file");
  p.text("--md", a.md, "a file");
  p.text("--svg", a.svg, "a file");
  p.text("--json", a.json, "a file");
  p.text("--csv", a.csv, "a file");
  p.integer("--steps", a.steps, 1, 1 << 30, "must be an integer >= 1");
  p.integer("--threads", a.threads, 1, 1024, "must be an integer in 1..1024");
  p.value("--budgets", [&a](const std::string& v) {
    return parse_int_list(v, 1, 1 << 30, a.budgets) ? std::string()
                                                    : std::string("a comma-separated list of integers >= 1");
  });
  p.value("--modes", [&a](const std::string& v) {
    a.modes.clear();
    std::string_view rest = v;
    while (true) {
      const auto comma = rest.find(',');
      const auto m = parse_cache_mode(rest.substr(0, comma));
      if (!m) return "'" + std::string(rest.substr(0, comma)) + "' is not full, tbq, tbe or thinkv";
      a.modes.push_back(*m);
      if (comma == std::string_view::npos) return std::string();
      rest.remove_prefix(comma + 1);
    }
  });
  p.flag("--progress", a.progress);
  if (const int rc = p.parse(argc, argv); rc != 0) return rc;
  a.help = p.help();
  if (a.help) return 0;
  if (p.app().count("--budget") > 0) return p.error("use --budgets LIST in a sweep");
  if (a.model.empty()) return p.error("no model given (--model PATH)");
  return 0;
}

struct Cell {
  CacheMode mode{};
  int budget = 0;  ///< 0 for modes without eviction
  double memory = 0, memory_peak = 0, agreement = 0, kl = 0, agreement_min = 1, agreement_max = 0;
  double ev_per_step = 0, unreachable = 0;
  std::vector<int> divergences;
  int prompts = 0;
};

const char* mode_color(CacheMode m) {
  switch (m) {
    case CacheMode::kFull: return "#444444";
    case CacheMode::kTbq: return "#1f77b4";
    case CacheMode::kTbe: return "#ff7f0e";
    case CacheMode::kThinKv: return "#2ca02c";
  }
  return "#000000";
}

/// The sweep plot: token agreement and mean KL against memory share, one colour per mode,
/// points labelled with their budget.
std::string sweep_svg(const std::vector<Cell>& cells, const std::string& title) {
  const int W = 980, H = 430, pw = 400, ph = 300, top = 70, left0 = 70, gap = 90;
  double xmax = 0;
  double klmin = 1e9, klmax = 0;
  for (const Cell& c : cells) {
    xmax = std::max(xmax, 100.0 * c.memory);
    if (c.kl > 0) {
      klmin = std::min(klmin, c.kl);
      klmax = std::max(klmax, c.kl);
    }
  }
  double xstep = 10;  // x ticks at a round step, at most 8 of them
  for (double st : {10.0, 20.0, 25.0, 50.0, 100.0, 200.0}) {
    xstep = st;
    if (std::ceil(xmax / st) <= 8) break;
  }
  xmax = std::max(xstep, std::ceil(xmax / xstep) * xstep);
  const int xticks = static_cast<int>(std::lround(xmax / xstep));
  if (klmax <= 0) {
    klmin = 1e-4;
    klmax = 1;
  }
  const double lo = std::floor(std::log10(std::max(klmin, 1e-6))), hi = std::ceil(std::log10(klmax));
  std::ostringstream s;
  s << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H
    << "\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" "
       "fill=\"white\"/>\n";
  s << "<text x=\"" << W / 2 << "\" y=\"24\" text-anchor=\"middle\" font-size=\"15\">" << title << "</text>\n";
  for (int panel = 0; panel < 2; ++panel) {
    const int x0 = left0 + panel * (pw + gap), y0 = top;
    auto px = [&](double mem) { return x0 + pw * (100.0 * mem) / xmax; };
    auto py = [&](const Cell& c) {
      if (panel == 0) return y0 + ph * (1.0 - c.agreement);
      const double v = std::log10(std::max(c.kl, std::pow(10.0, lo)));
      return y0 + ph * (1.0 - (v - lo) / std::max(1e-9, hi - lo));
    };
    s << "<rect x=\"" << x0 << "\" y=\"" << y0 << "\" width=\"" << pw << "\" height=\"" << ph
      << "\" fill=\"none\" stroke=\"#000\"/>\n";
    for (int t = 0; t <= xticks; ++t) {  // x ticks
      const double xv = xstep * t;
      const double xx = x0 + pw * xv / xmax;
      s << "<line x1=\"" << xx << "\" y1=\"" << y0 + ph << "\" x2=\"" << xx << "\" y2=\"" << y0 + ph + 5
        << "\" stroke=\"#000\"/><text x=\"" << xx << "\" y=\"" << y0 + ph + 18 << "\" text-anchor=\"middle\">"
        << fmt("%.0f", xv) << "</text>\n";
      s << "<line x1=\"" << xx << "\" y1=\"" << y0 << "\" x2=\"" << xx << "\" y2=\"" << y0 + ph
        << "\" stroke=\"#eee\"/>\n";
    }
    s << "<text x=\"" << x0 + pw / 2 << "\" y=\"" << y0 + ph + 36
      << "\" text-anchor=\"middle\">KV memory held / FullKV FP16 (%)</text>\n";
    if (panel == 0) {
      for (int t = 0; t <= 5; ++t) {
        const double yy = y0 + ph * (1.0 - t / 5.0);
        s << "<line x1=\"" << x0 - 5 << "\" y1=\"" << yy << "\" x2=\"" << x0 << "\" y2=\"" << yy
          << "\" stroke=\"#000\"/><text x=\"" << x0 - 8 << "\" y=\"" << yy + 4 << "\" text-anchor=\"end\">" << 20 * t
          << "</text>\n";
      }
      s << "<text transform=\"translate(" << x0 - 45 << "," << y0 + ph / 2
        << ") rotate(-90)\" text-anchor=\"middle\">greedy token agreement with FullKV (%)</text>\n";
    } else {
      for (double e = lo; e <= hi + 1e-9; e += 1.0) {
        const double yy = y0 + ph * (1.0 - (e - lo) / std::max(1e-9, hi - lo));
        s << "<line x1=\"" << x0 - 5 << "\" y1=\"" << yy << "\" x2=\"" << x0 << "\" y2=\"" << yy
          << "\" stroke=\"#000\"/><text x=\"" << x0 - 8 << "\" y=\"" << yy + 4 << "\" text-anchor=\"end\">1e"
          << fmt("%.0f", e) << "</text>\n";
        s << "<line x1=\"" << x0 << "\" y1=\"" << yy << "\" x2=\"" << x0 + pw << "\" y2=\"" << yy
          << "\" stroke=\"#eee\"/>\n";
      }
      s << "<text transform=\"translate(" << x0 - 50 << "," << y0 + ph / 2
        << ") rotate(-90)\" text-anchor=\"middle\">mean KL(full || mode), nats (log)</text>\n";
      s << "<text x=\"" << x0 + pw - 4 << "\" y=\"" << y0 + ph - 6
        << "\" text-anchor=\"end\" font-size=\"10\" fill=\"#555\">KL = 0 (full) drawn on the "
           "bottom axis</text>\n";
    }
    // Lines through each mode's budgets, then the points.
    for (CacheMode m : {CacheMode::kFull, CacheMode::kTbq, CacheMode::kTbe, CacheMode::kThinKv}) {
      std::vector<const Cell*> pts;
      for (const Cell& c : cells) {
        if (c.mode == m) pts.push_back(&c);
      }
      if (pts.size() > 1) {
        s << "<polyline fill=\"none\" stroke=\"" << mode_color(m) << "\" stroke-opacity=\"0.5\" points=\"";
        for (const Cell* c : pts) s << px(c->memory) << "," << py(*c) << " ";
        s << "\"/>\n";
      }
      for (std::size_t i = 0; i < pts.size(); ++i) {
        const Cell* c = pts[i];
        s << "<circle cx=\"" << px(c->memory) << "\" cy=\"" << py(*c) << "\" r=\"4.5\" fill=\"" << mode_color(m)
          << "\"/>\n";
        if (c->budget > 0) {  // labels alternate above and below the point
          s << "<text x=\"" << px(c->memory) + 6 << "\" y=\"" << py(*c) + (i % 2 ? 14 : -6)
            << "\" font-size=\"10\" fill=\"" << mode_color(m) << "\">" << c->budget << "</text>\n";
        }
      }
    }
  }
  int lx = left0;
  for (CacheMode m : {CacheMode::kFull, CacheMode::kTbq, CacheMode::kTbe, CacheMode::kThinKv}) {
    s << "<circle cx=\"" << lx << "\" cy=\"48\" r=\"5\" fill=\"" << mode_color(m) << "\"/><text x=\"" << lx + 9
      << "\" y=\"52\">" << to_string(m) << "</text>\n";
    lx += 90;
  }
  s << "<text x=\"" << lx + 20 << "\" y=\"52\" fill=\"#555\">(labels: token budget)</text>\n";
  s << "</svg>\n";
  return s.str();
}

}  // namespace

int run_sweep(int argc, char** argv) {
  const char* cmd = "sweep";
  SweepArgs a;
  if (const int rc = parse_sweep(argc, argv, a); rc != 0) return rc;
  if (a.help) {
    std::printf("%s%s", kSweepUsage, kSweepHelp);
    return 0;
  }
  std::vector<std::string> prompts = kDefaultPrompts;
  if (!a.prompts_file.empty()) {
    prompts.clear();
    std::string err;
    if (!read_prompts(a.prompts_file, prompts, err)) {
      std::fprintf(stderr, "thinkv sweep: %s\n", err.c_str());
      return kExitData;
    }
  }
  Model model;
  Tokenizer tok;
  if (const int rc = load_model_and_tokenizer("thinkv sweep", a.model, a.tokenizer, model, tok); rc != 0) return rc;
  ThoughtClassifier classifier;
  if (const int rc = load_classifier(cmd, a.cache, model, classifier); rc != 0) return rc;
  const int threads = a.threads > 0 ? a.threads : default_threads();
  Progress progress(a.progress, "thinkv sweep: ");

  std::vector<Cell> cells;
  for (CacheMode m : a.modes) {
    const std::vector<int> budgets = evicts(m) ? a.budgets : std::vector<int>{0};
    for (int b : budgets) {
      Cell cell;
      cell.mode = m;
      cell.budget = b;
      for (std::size_t p = 0; p < prompts.size(); ++p) {
        const std::vector<int> ptoks = tok.encode(prompts[p], true, false);
        const int P = static_cast<int>(ptoks.size());
        if (P + a.steps - 1 > model.config.seq_len) {
          std::fprintf(stderr, "thinkv sweep: prompt %zu (%d tokens) + %d steps exceed the context %d\n", p, P, a.steps,
                       model.config.seq_len);
          return kExitUsage;
        }
        CacheFlags cf = a.cache;
        cf.budget = b;
        ThinKvSpec cfg;
        CacheSpec full_cfg;  // the reference: FullKV in FP16
        Status s = make_cache_config(model.config, cache_options(cf, m, P + a.steps, classifier, P), cfg);
        if (s.is_ok()) {
          MethodOptions fo;
          fo.method = Method::kFull;
          fo.cache.max_tokens = P + a.steps;
          s = make_cache_spec(model.config, fo, full_cfg);
        }
        if (!s.is_ok()) return usage_error(cmd, kSweepUsage, "cache configuration: " + s.message());
        progress.update(std::string(to_string(m)) + (b ? " budget " + std::to_string(b) : std::string()) + ", prompt " +
                        std::to_string(p + 1) + "/" + std::to_string(prompts.size()));
        RunOptions ro;
        ro.steps = a.steps;
        ro.threads = threads;
        ro.bos_id = tok.bos_id;
        ro.eos_id = tok.eos_id;
        // Fixed-length runs: a story model emits BOS/EOS between stories; keep decoding so every
        // cell covers the same number of positions.
        ro.stop_at_bos_eos = false;
        RunStats st;
        if (s = run_sequence(model, cfg, ptoks, ro, st); !s.is_ok()) {
          progress.clear();
          std::fprintf(stderr, "thinkv sweep: %s\n", s.to_string().c_str());
          return kExitData;
        }
        Fidelity f;
        if (s = measure_fidelity(model, full_cfg, cfg, ptoks, a.steps, ro, &st.tokens, f); !s.is_ok()) {
          progress.clear();
          std::fprintf(stderr, "thinkv sweep: %s\n", s.to_string().c_str());
          return kExitData;
        }
        const double mem = static_cast<double>(st.final_memory.physical_bytes()) /
                           static_cast<double>(std::max<std::int64_t>(1, st.fullkv_fp16_bytes_all_positions));
        const double peak = static_cast<double>(st.peak_physical_bytes) /
                            static_cast<double>(std::max<std::int64_t>(1, st.fullkv_fp16_bytes_all_positions));
        cell.memory += mem;
        cell.memory_peak += peak;
        cell.agreement += f.token_agreement;
        cell.agreement_min = std::min(cell.agreement_min, f.token_agreement);
        cell.agreement_max = std::max(cell.agreement_max, f.token_agreement);
        cell.kl += f.mean_kl;
        cell.ev_per_step += static_cast<double>(st.cache_stats.eviction_calls) / std::max(1, st.forward_passes);
        cell.unreachable += static_cast<double>(st.cache_stats.budget_unreachable);
        cell.divergences.push_back(f.first_divergence);
        ++cell.prompts;
      }
      const double n = std::max(1, cell.prompts);
      cell.memory /= n;
      cell.memory_peak /= n;
      cell.agreement /= n;
      cell.kl /= n;
      cell.ev_per_step /= n;
      cell.unreachable /= n;
      cells.push_back(cell);
    }
  }
  progress.clear();

  std::ostringstream md;
  md << "| mode | budget | KV held / FullKV FP16 (end) | peak | token agreement (mean, min-max) | "
        "mean KL(full‖mode) "
        "(nats) | first divergence (median step) | eviction calls / step | budget-unreachable "
        "steps |\n";
  md << "|---|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (Cell& c : cells) {
    std::vector<int> d = c.divergences;
    for (int& x : d) {
      if (x < 0) x = a.steps;  // never diverged: count as the full length
    }
    std::sort(d.begin(), d.end());
    const int med = d.empty() ? -1 : d[d.size() / 2];
    md << "| " << to_string(c.mode) << " | " << (c.budget > 0 ? std::to_string(c.budget) : std::string("–")) << " | "
       << fmt("%.1f %%", 100 * c.memory) << " | " << fmt("%.1f %%", 100 * c.memory_peak) << " | "
       << fmt("%.1f %%", 100 * c.agreement) << " (" << fmt("%.0f", 100 * c.agreement_min) << "–"
       << fmt("%.0f", 100 * c.agreement_max) << ") | " << fmt("%.4f", c.kl) << " | "
       << (med >= a.steps ? std::string("none (") + std::to_string(a.steps) + ")" : std::to_string(med)) << " | "
       << fmt("%.3f", c.ev_per_step) << " | " << fmt("%.0f", c.unreachable) << " |\n";
  }
  // The same rows as JSON and CSV.
  std::ostringstream csv;
  csv << "mode,budget,prompts,kv_held_ratio,kv_peak_ratio,token_agreement,token_agreement_min,"
         "token_agreement_max,mean_kl,first_divergence_median,eviction_calls_per_step,budget_unreachable_steps\n";
  Json rows = Json::array();
  for (const Cell& c : cells) {
    std::vector<int> d = c.divergences;
    for (int& x : d) x = x < 0 ? a.steps : x;
    std::sort(d.begin(), d.end());
    const int med = d.empty() ? -1 : d[d.size() / 2];
    csv << to_string(c.mode) << "," << c.budget << "," << c.prompts << "," << c.memory << "," << c.memory_peak << ","
        << c.agreement << "," << c.agreement_min << "," << c.agreement_max << "," << c.kl << "," << med << ","
        << c.ev_per_step << "," << c.unreachable << "\n";
    rows.push_back(Json{{"mode", (std::string(to_string(c.mode)))},
                        {"budget", c.budget},
                        {"prompts", c.prompts},
                        {"kv_held_ratio", c.memory},
                        {"kv_peak_ratio", c.memory_peak},
                        {"token_agreement", c.agreement},
                        {"token_agreement_min", c.agreement_min},
                        {"token_agreement_max", c.agreement_max},
                        {"mean_kl", c.kl},
                        {"first_divergence_median", med},
                        {"eviction_calls_per_step", c.ev_per_step},
                        {"budget_unreachable_steps", c.unreachable}});
  }
  const Json doc{{"model", model.name}, {"steps", a.steps}, {"reference", "full (FP16)"}, {"cells", std::move(rows)}};
  const std::string json_text = doc.dump(1, ' ', false, Json::error_handler_t::replace) + "\n";
  for (const auto& [path, content] :
       {std::pair<std::string, std::string>{a.md, md.str()}, {a.json, json_text}, {a.csv, csv.str()}}) {
    if (path.empty()) continue;
    if (const std::string e = write_file_atomic(path, content); !e.empty()) {
      std::fprintf(stderr, "thinkv sweep: %s\n", e.c_str());
      return kExitData;
    }
    std::fprintf(stderr, "thinkv sweep: wrote %s\n", path.c_str());
  }
  if (a.md.empty()) std::printf("%s", md.str().c_str());
  if (!a.svg.empty()) {
    const std::string title = model.name + ": fidelity vs KV memory, " + std::to_string(prompts.size()) +
                              " prompts x " + std::to_string(a.steps) + " greedy steps";
    std::ofstream f(a.svg);
    f << sweep_svg(cells, title);
    if (!f) {
      std::fprintf(stderr, "thinkv sweep: cannot write %s\n", a.svg.c_str());
      return kExitData;
    }
    std::fprintf(stderr, "thinkv sweep: wrote %s\n", a.svg.c_str());
  }
  return 0;
}
