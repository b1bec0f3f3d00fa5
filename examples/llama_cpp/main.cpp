/// \file main.cpp
/// thinkv_llama: decodes a GGUF model with a stock llama.cpp, ThinKV evicting through
/// llama_memory_seq_rm (llama_thinkv.hpp), and measures it against the same llama.cpp without
/// ThinKV. Two modes:
///   compare  --prompt TEXT --steps N: both contexts are fed the stock context's greedy tokens
///            (teacher forcing); per step: greedy agreement and KL(stock || ThinKV) of the
///            next-token distributions; cells held, evictions per step, the adapter's costs.
///   eval     --problems FILE.jsonl: each problem decoded greedily by both (free running) to EOS
///            or --max-steps; the answers (last "Answer: <digits>") against the file's, and
///            whether the outputs are identical.
/// The ThinKV context can be given fewer cells than the sequence's length (--ctx): llama.cpp
/// then allocates only those, and the sequence continues because TBE frees cells.
/// Exit status: 0 ok, 1 data error (file, model, decode), 2 usage, 3 a --require-* bar missed.

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <regex>
#include <string>
#include <vector>

#include "decoder/sampler.hpp"
#include "decoder/tokenizer.hpp"
#include "llama_thinkv.hpp"
#include "thinkv/thought/calibration_file.hpp"
#include "thinkv/thought/trace.hpp"

namespace {

using thinkv::Status;
using Json = nlohmann::json;

struct Args {
  std::string model, tokenizer, calibration, prompt, problems, selection = "kmeans", json_out, sparsity_trace;
  int steps = 256, budget = 1024, segment = 128, ctx = 0, limit = 0, max_steps = 0, threads = 1;
  std::vector<int> key_layers;
  double require_agreement = -1.0, require_max_kl = -1.0;
  bool require_evictions = false;
  bool kv_f32 = false;
};

struct Tok {
  const llama_vocab* vocab = nullptr;
  std::unique_ptr<thinkv::decoder::Tokenizer> own;  // --tokenizer: a llama2.c tokenizer file
  std::vector<llama_token> encode(const std::string& text) const {
    if (own) {
      std::vector<int> t = own->encode(text, true, false);
      return {t.begin(), t.end()};
    }
    std::vector<llama_token> out(text.size() + 8);
    int n = llama_tokenize(vocab, text.data(), static_cast<int>(text.size()), out.data(), static_cast<int>(out.size()),
                           true, false);
    if (n < 0) {
      out.resize(static_cast<std::size_t>(-n));
      n = llama_tokenize(vocab, text.data(), static_cast<int>(text.size()), out.data(), static_cast<int>(out.size()),
                         true, false);
    }
    out.resize(static_cast<std::size_t>(std::max(0, n)));
    return out;
  }
  std::string piece(llama_token prev, llama_token t) const {
    if (own) return own->decode_piece(prev, t);
    char buf[256];
    const int n = llama_token_to_piece(vocab, t, buf, sizeof buf, 0, false);
    return n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : std::string();
  }
  bool eos(llama_token t) const { return own ? t == own->eos_id : llama_vocab_is_eog(vocab, t); }
};

struct Contexts {
  llama_context* stock = nullptr;
  llama_context* thinkv = nullptr;
  ~Contexts() {
    if (stock) llama_free(stock);
    if (thinkv) llama_free(thinkv);
  }
};

llama_context_params context_params(const Args& a, int n_ctx, int n_batch) {
  llama_context_params p = llama_context_default_params();
  p.n_ctx = static_cast<std::uint32_t>(n_ctx);
  p.n_batch = p.n_ubatch = static_cast<std::uint32_t>(std::max(n_batch, 64));
  p.n_seq_max = 1;
  p.n_threads = p.n_threads_batch = a.threads;
  p.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;  // the same attention path in both contexts
  p.no_perf = true;
  if (a.kv_f32) p.type_k = p.type_v = GGML_TYPE_F32;
  return p;
}

std::string answer_of(const std::string& text) {
  static const std::regex re("Answer: (\\d+)");
  std::string last;
  for (auto it = std::sregex_iterator(text.begin(), text.end(), re); it != std::sregex_iterator(); ++it) {
    last = (*it)[1].str();
  }
  return last;
}

double ms(std::int64_t ns) { return static_cast<double>(ns) / 1e6; }

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app("thinkv_llama: ThinKV inside a stock llama.cpp (eviction through llama_memory_seq_rm)");
  app.add_option("--model", a.model, "GGUF model")->required();
  app.add_option("--tokenizer", a.tokenizer, "llama2.c tokenizer file to encode/decode with (default: the GGUF's)");
  app.add_option("--calibration", a.calibration, "ThinKV calibration file (default: every token R, budget only)");
  app.add_option("--prompt", a.prompt, "compare mode: the prompt");
  app.add_option("--steps", a.steps, "compare mode: tokens to decode")->check(CLI::Range(1, 1 << 20));
  app.add_option("--problems", a.problems, "eval mode: JSONL with \"prompt\" and \"answer\"");
  app.add_option("--limit", a.limit, "eval mode: first N problems (0 = all)")->check(CLI::Range(0, 1 << 20));
  app.add_option("--max-steps", a.max_steps, "eval mode: tokens per problem at most (0 = to the context)")
      ->check(CLI::Range(0, 1 << 20));
  app.add_option("--budget", a.budget, "ThinKV token budget (live generated positions; 0 = none)")
      ->check(CLI::Range(0, 1 << 24));
  app.add_option("--segment", a.segment, "thought segment length")->check(CLI::Range(1, 1 << 20));
  app.add_option("--key-layers", a.key_layers, "layers whose keys are K-means features (default: all)")->delimiter(',');
  app.add_option("--selection", a.selection, "kept positions: kmeans, first, last");
  app.add_option("--ctx", a.ctx, "cells of the ThinKV context (default: the whole sequence)")
      ->check(CLI::Range(0, 1 << 24));
  app.add_option("--threads", a.threads, "threads per context")->check(CLI::Range(1, 256));
  app.add_option("--json", a.json_out, "append the results as one JSON line to this file");
  app.add_option("--sparsity-trace", a.sparsity_trace,
                 "compare: write every layer's sparsity of every step of the ThinKV context, in the format of "
                 "`thinkv trace` (step s = the step that chooses generated token s; s >= 1)");
  app.add_option("--require-agreement", a.require_agreement, "compare: exit 3 below this greedy agreement");
  app.add_option("--require-max-kl", a.require_max_kl, "compare: exit 3 above this mean KL");
  app.add_flag("--kv-f32", a.kv_f32, "llama.cpp's cache cells in F32 (default F16), both contexts");
  app.add_flag("--require-evictions", a.require_evictions, "exit 3 when ThinKV evicted nothing");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) { return app.exit(e) == 0 ? 0 : 2; }
  if (a.prompt.empty() == a.problems.empty()) {
    std::fprintf(stderr, "thinkv_llama: give exactly one of --prompt (compare) or --problems (eval)\n");
    return 2;
  }
  const auto selection = thinkv::parse_segment_selection(a.selection);
  if (!selection) {
    std::fprintf(stderr, "thinkv_llama: --selection %s: must be kmeans, first or last\n", a.selection.c_str());
    return 2;
  }

  // llama.cpp's errors only (a continued line follows its first line's level).
  llama_log_set(
      [](ggml_log_level level, const char* text, void*) {
        static bool error_line = false;
        if (level != GGML_LOG_LEVEL_CONT) error_line = level == GGML_LOG_LEVEL_ERROR;
        if (error_line) std::fputs(text, stderr);
      },
      nullptr);
  llama_backend_init();
  llama_model_params mp = llama_model_default_params();
  mp.n_gpu_layers = 0;
  std::unique_ptr<llama_model, decltype(&llama_model_free)> model(llama_model_load_from_file(a.model.c_str(), mp),
                                                                  &llama_model_free);
  if (!model) {
    std::fprintf(stderr, "thinkv_llama: cannot load the model %s\n", a.model.c_str());
    return 1;
  }
  Tok tok;
  tok.vocab = llama_model_get_vocab(model.get());
  const int n_vocab = llama_vocab_n_tokens(tok.vocab);
  if (!a.tokenizer.empty()) {
    tok.own = std::make_unique<thinkv::decoder::Tokenizer>();
    if (Status s = thinkv::decoder::load_llama2c_tokenizer(a.tokenizer, n_vocab, *tok.own); !s.is_ok()) {
      std::fprintf(stderr, "thinkv_llama: %s\n", s.message().c_str());
      return 1;
    }
  }

  thinkv::llama_cpp::AdapterOptions opt;
  opt.token_budget = a.budget;
  opt.segment_len = a.segment;
  opt.key_layers = a.key_layers;
  opt.selector.selection = *selection;
  opt.trace_sparsity = !a.sparsity_trace.empty();
  if (opt.trace_sparsity && a.prompt.empty()) {
    std::fprintf(stderr, "thinkv_llama: --sparsity-trace needs --prompt (compare mode)\n");
    return 2;
  }
  if (!a.calibration.empty()) {
    thinkv::CalibrationFile f;
    if (Status s = thinkv::read_calibration_json(std::filesystem::path(a.calibration), f); !s.is_ok()) {
      std::fprintf(stderr, "thinkv_llama: %s\n", s.message().c_str());
      return 1;
    }
    // The layer count only: the llama2.c converter names every model "llama".
    if (Status s = thinkv::check_model(f, llama_model_n_layer(model.get()), ""); !s.is_ok()) {
      std::fprintf(stderr, "thinkv_llama: %s\n", s.message().c_str());
      return 1;
    }
    try {
      opt.classifier = thinkv::classifier_from_calibration(f);
    } catch (const thinkv::ConfigError& e) {
      std::fprintf(stderr, "thinkv_llama: %s: %s\n", a.calibration.c_str(), e.what());
      return 1;
    }
  }
  std::unique_ptr<thinkv::llama_cpp::Adapter> adapter;
  try {
    adapter = std::make_unique<thinkv::llama_cpp::Adapter>(model.get(), opt);
  } catch (const thinkv::ConfigError& e) {
    std::fprintf(stderr, "thinkv_llama: %s\n", e.what());
    return 2;
  }
  const int n_layer = adapter->num_layers();
  const std::int64_t cell_bytes =  // K and V, F16 or F32
      std::int64_t{2} * n_layer * adapter->num_kv_heads() * adapter->head_dim() * (a.kv_f32 ? 4 : 2);

  // ---- the prompts -------------------------------------------------------------------------------
  struct Problem {
    std::string id, prompt, answer;
    std::vector<llama_token> tokens;
  };
  std::vector<Problem> problems;
  if (!a.prompt.empty()) {
    problems.push_back({"prompt", a.prompt, "", tok.encode(a.prompt)});
  } else {
    std::ifstream in(a.problems);
    if (!in) {
      std::fprintf(stderr, "thinkv_llama: cannot open %s\n", a.problems.c_str());
      return 1;
    }
    std::string line;
    for (int n = 1; std::getline(in, line); ++n) {
      if (line.empty()) continue;
      Json j = Json::parse(line, nullptr, false);
      if (j.is_discarded() || !j.is_object() || !j.contains("prompt") || !j["prompt"].is_string() ||
          !j.contains("answer")) {
        std::fprintf(stderr, "thinkv_llama: %s:%d: expected a JSON object with \"prompt\" and \"answer\"\n",
                     a.problems.c_str(), n);
        return 1;
      }
      Problem p;
      p.id = j.value("id", std::to_string(n));
      p.prompt = j["prompt"].get<std::string>();
      p.answer = j["answer"].is_string() ? j["answer"].get<std::string>() : j["answer"].dump();
      p.tokens = tok.encode(p.prompt);
      problems.push_back(std::move(p));
      if (a.limit > 0 && static_cast<int>(problems.size()) >= a.limit) break;
    }
  }
  int max_prompt = 0;
  for (const Problem& p : problems) max_prompt = std::max(max_prompt, static_cast<int>(p.tokens.size()));
  const int n_ctx_train = llama_model_n_ctx_train(model.get());
  // The sequence's whole length. Without --max-steps, eval decodes to the model's training
  // context (llama.cpp's llama2.c converter writes 128 there whatever the model's seq_len: give
  // --max-steps for such files).
  const int full_len = !a.prompt.empty() ? max_prompt + a.steps
                       : a.max_steps > 0 ? max_prompt + a.max_steps
                                         : std::max(n_ctx_train, max_prompt + 1);
  Contexts ctx;
  ctx.stock = llama_init_from_model(model.get(), context_params(a, full_len + 1, max_prompt));
  llama_context_params tp = context_params(a, a.ctx > 0 ? a.ctx : full_len + 1, max_prompt);
  adapter->prepare(tp);
  ctx.thinkv = llama_init_from_model(model.get(), tp);
  if (!ctx.stock || !ctx.thinkv) {
    std::fprintf(stderr, "thinkv_llama: cannot create the llama.cpp contexts (n_ctx %d)\n", full_len + 1);
    return 1;
  }
  adapter->attach(ctx.thinkv);

  // ---- decode ------------------------------------------------------------------------------------
  std::int64_t steps = 0, agree = 0, live_sum = 0, full_sum = 0;
  double kl_sum = 0, kl_max = 0;
  int solved_stock = 0, solved_thinkv = 0, identical = 0, failed = 0;
  Json per_problem = Json::array();
  thinkv::PromptTrace trace_rows;
  trace_rows.id = "prompt";
  const auto t_start = std::chrono::steady_clock::now();
  for (const Problem& pr : problems) {
    const int P = static_cast<int>(pr.tokens.size());
    llama_memory_clear(llama_get_memory(ctx.stock), true);
    if (!thinkv::llama_cpp::decode_tokens(ctx.stock, 0, pr.tokens, 0)) {
      std::fprintf(stderr, "thinkv_llama: %s: llama_decode failed on the prompt (stock)\n", pr.id.c_str());
      return 1;
    }
    if (Status s = adapter->decode_prompt(0, pr.tokens); !s.is_ok()) {
      std::fprintf(stderr, "thinkv_llama: %s: %s\n", pr.id.c_str(), s.message().c_str());
      return 1;
    }
    const int limit = !a.prompt.empty() ? a.steps : full_len - P;
    std::string out_stock, out_thinkv;
    llama_token prev_s = pr.tokens.back(), prev_t = pr.tokens.back();
    bool stock_done = false, thinkv_done = false, thinkv_failed = false;
    for (int i = 0; i < limit && !(stock_done && thinkv_done); ++i) {
      const float* ls = llama_get_logits_ith(ctx.stock, -1);
      const float* lt = llama_get_logits_ith(ctx.thinkv, -1);
      const std::span<const float> ls_row(ls, static_cast<std::size_t>(n_vocab)),
          lt_row(lt, static_cast<std::size_t>(n_vocab));
      const llama_token ts = thinkv::decoder::argmax(ls_row), tt = thinkv::decoder::argmax(lt_row);
      if (!a.prompt.empty()) {  // teacher forcing: both take the stock token
        ++steps;
        agree += ts == tt;
        const double kl = thinkv::decoder::kl_divergence(ls_row, lt_row);
        kl_sum += kl;
        kl_max = std::max(kl_max, kl);
        live_sum += adapter->live(0);
        full_sum += P + i;
        if (tok.eos(ts)) break;
        if (!thinkv::llama_cpp::decode_tokens(ctx.stock, 0, {&ts, 1}, P + i)) return 1;
        if (Status s = adapter->decode_token(0, ts); !s.is_ok()) {
          std::fprintf(stderr, "thinkv_llama: step %d: %s\n", i, s.message().c_str());
          return 1;
        }
        if (opt.trace_sparsity) {  // decoding generated token i chooses token i + 1
          const std::span<const float> sp = adapter->last_sparsity();
          trace_rows.steps.push_back(i + 1);
          trace_rows.values.insert(trace_rows.values.end(), sp.begin(), sp.end());
        }
        continue;
      }
      // eval: each context runs free.
      if (!stock_done) {
        if (tok.eos(ts)) {
          stock_done = true;
        } else {
          out_stock += tok.piece(prev_s, ts);
          prev_s = ts;
          if (!thinkv::llama_cpp::decode_tokens(ctx.stock, 0, {&ts, 1}, P + i)) return 1;
        }
      }
      if (!thinkv_done) {
        if (tok.eos(tt)) {
          thinkv_done = true;
        } else {
          out_thinkv += tok.piece(prev_t, tt);
          prev_t = tt;
          ++steps;
          live_sum += adapter->live(0);
          full_sum += P + i;
          if (Status s = adapter->decode_token(0, tt); !s.is_ok()) {
            std::fprintf(stderr, "thinkv_llama: %s: step %d: %s\n", pr.id.c_str(), i, s.message().c_str());
            thinkv_done = thinkv_failed = true;
            ++failed;
          }
        }
      }
    }
    if (a.prompt.empty()) {
      const std::string as = answer_of(out_stock), at = answer_of(out_thinkv);
      solved_stock += !as.empty() && as == pr.answer;
      solved_thinkv += !thinkv_failed && !at.empty() && at == pr.answer;
      identical += out_stock == out_thinkv;
      per_problem.push_back({{"id", pr.id},
                             {"answer", pr.answer},
                             {"stock", as},
                             {"thinkv", at},
                             {"identical", out_stock == out_thinkv},
                             {"live_end", adapter->live(0)},
                             {"prompt_tokens", P},
                             {"thinkv_tokens", static_cast<std::int64_t>(out_thinkv.size())}});
    }
  }
  const double wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();

  // ---- report ------------------------------------------------------------------------------------
  const thinkv::llama_cpp::AdapterStats st = adapter->stats();
  const thinkv::seq::PositionEvictor* ev = adapter->evictor(0);
  const double mean_live = steps ? static_cast<double>(live_sum) / static_cast<double>(steps) : 0.0;
  const double mean_full = steps ? static_cast<double>(full_sum) / static_cast<double>(steps) : 0.0;
  Json r = {{"tool", "thinkv_llama"},
            {"mode", a.prompt.empty() ? "eval" : "compare"},
            {"model", a.model},
            {"budget", a.budget},
            {"segment", a.segment},
            {"selection", a.selection},
            {"calibration", a.calibration},
            {"key_layers", a.key_layers.empty() ? std::string("all") : std::to_string(a.key_layers.size())},
            {"steps", steps},
            {"ctx_cells_thinkv", llama_n_ctx(ctx.thinkv)},
            {"ctx_cells_stock", llama_n_ctx(ctx.stock)},
            {"cell_bytes", cell_bytes},
            {"mean_live_cells", mean_live},
            {"mean_fullkv_cells", mean_full},
            {"mean_held_fraction", mean_full > 0 ? mean_live / mean_full : 0.0},
            {"peak_live_cells", st.peak_live},
            {"evicted", st.evicted},
            {"evictions_per_step", steps ? static_cast<double>(st.evicted) / static_cast<double>(steps) : 0.0},
            {"transitions", st.transitions},
            {"refreshes", st.refreshes},
            {"sparsity_steps", st.sparsity_steps},
            {"feature_bytes_end", ev ? ev->held_bytes() : 0},
            {"decode_ms_per_token", st.tokens ? ms(st.decode_ns) / static_cast<double>(st.tokens) : 0.0},
            {"callback_ms_per_token", st.tokens ? ms(st.callback_ns) / static_cast<double>(st.tokens) : 0.0},
            {"evictor_ms_per_token", st.tokens ? ms(st.evictor_ns) / static_cast<double>(st.tokens) : 0.0},
            {"seq_rm_ms_per_token", st.tokens ? ms(st.seq_rm_ns) / static_cast<double>(st.tokens) : 0.0},
            {"wall_s", wall_s}};
  if (!a.prompt.empty()) {
    r["greedy_agreement"] = steps ? static_cast<double>(agree) / static_cast<double>(steps) : 0.0;
    r["mean_kl"] = steps ? kl_sum / static_cast<double>(steps) : 0.0;
    r["max_kl"] = kl_max;
    std::printf("compare: %lld steps, greedy agreement %.4f, KL mean %.3g max %.3g nats\n",
                static_cast<long long>(steps), r["greedy_agreement"].get<double>(), r["mean_kl"].get<double>(), kl_max);
  } else {
    r["problems"] = problems.size();
    r["solved_stock"] = solved_stock;
    r["solved_thinkv"] = solved_thinkv;
    r["identical_outputs"] = identical;
    r["thinkv_failed"] = failed;
    r["per_problem"] = per_problem;
    std::printf("eval: %zu problems, solved stock %d, ThinKV %d, identical outputs %d, ThinKV failures %d\n",
                problems.size(), solved_stock, solved_thinkv, identical, failed);
  }
  std::printf(
      "cells: mean live %.1f of %.1f FullKV (%.1f%%), peak %lld; ThinKV context %u cells (%.1f KiB), "
      "stock %u cells; %lld evicted (%.2f per step), %lld transitions\n",
      mean_live, mean_full, mean_full > 0 ? 100.0 * mean_live / mean_full : 0.0, static_cast<long long>(st.peak_live),
      llama_n_ctx(ctx.thinkv), static_cast<double>(llama_n_ctx(ctx.thinkv)) * static_cast<double>(cell_bytes) / 1024.0,
      llama_n_ctx(ctx.stock), static_cast<long long>(st.evicted), r["evictions_per_step"].get<double>(),
      static_cast<long long>(r["transitions"].get<std::int64_t>()));
  std::printf("per token: llama_decode %.3f ms (eval callback %.3f ms), evictor %.3f ms, seq_rm %.3f ms\n",
              r["decode_ms_per_token"].get<double>(), r["callback_ms_per_token"].get<double>(),
              r["evictor_ms_per_token"].get<double>(), r["seq_rm_ms_per_token"].get<double>());
  if (opt.trace_sparsity) {
    thinkv::SparsityTrace trace;
    trace.model = "llama.cpp " + std::filesystem::path(a.model).filename().string();
    trace.num_layers = n_layer;
    trace.prompts.push_back(std::move(trace_rows));
    std::ofstream o(a.sparsity_trace);
    if (Status s = thinkv::write_sparsity_trace(o, trace); !s.is_ok() || !o) {
      std::fprintf(stderr, "thinkv_llama: cannot write %s: %s\n", a.sparsity_trace.c_str(),
                   s.is_ok() ? "write failed" : s.message().c_str());
      return 1;
    }
  }
  if (!a.json_out.empty()) {
    std::ofstream o(a.json_out, std::ios::app);
    o << r.dump() << "\n";
  }
  int rc = 0;
  if (a.require_agreement >= 0 && r.value("greedy_agreement", 0.0) < a.require_agreement) {
    std::fprintf(stderr, "thinkv_llama: greedy agreement %.4f is below --require-agreement %.4f\n",
                 r.value("greedy_agreement", 0.0), a.require_agreement);
    rc = 3;
  }
  if (a.require_max_kl >= 0 && r.value("mean_kl", 0.0) > a.require_max_kl) {
    std::fprintf(stderr, "thinkv_llama: mean KL %.4g is above --require-max-kl %.4g\n", r.value("mean_kl", 0.0),
                 a.require_max_kl);
    rc = 3;
  }
  if (a.require_evictions && st.evicted == 0) {
    std::fprintf(stderr, "thinkv_llama: ThinKV evicted nothing (--require-evictions)\n");
    rc = 3;
  }
  return rc;
}
