#pragma once
/// \file cli_util.hpp
/// Small pieces shared by the decoder subcommands of the `thinkv` CLI (generate, sweep, trace):
/// number parsing, a progress line, and model + tokenizer loading with the model search path and
/// its error message. The command-line parser itself is examples/thinkv/cli_args.hpp (CLI11).

#include <unistd.h>

#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "decoder.hpp"
#include "progress.hpp"

namespace thinkv::decoder::cli {

using ::thinkv::cli::Progress;

inline constexpr int kExitData = 1;
inline constexpr int kExitUsage = 2;

inline bool parse_int(std::string_view s, long long lo, long long hi, int& out) {
  long long x = 0;
  const auto r = std::from_chars(s.data(), s.data() + s.size(), x);
  if (r.ec != std::errc() || r.ptr != s.data() + s.size() || x < lo || x > hi) return false;
  out = static_cast<int>(x);
  return true;
}
inline bool parse_u64(std::string_view s, std::uint64_t& out) {
  std::uint64_t x = 0;
  const auto r = std::from_chars(s.data(), s.data() + s.size(), x);
  if (r.ec != std::errc() || r.ptr != s.data() + s.size()) return false;
  out = x;
  return true;
}
inline bool parse_float(std::string_view s, float& out) {
  double x = 0;
  const auto r = std::from_chars(s.data(), s.data() + s.size(), x);
  if (r.ec != std::errc() || r.ptr != s.data() + s.size() || !std::isfinite(x)) return false;
  out = static_cast<float>(x);
  return true;
}
/// "32,64,128" -> {32, 64, 128}; false on any bad entry.
inline bool parse_int_list(std::string_view s, long long lo, long long hi, std::vector<int>& out) {
  out.clear();
  while (true) {
    const auto comma = s.find(',');
    int v = 0;
    if (!parse_int(s.substr(0, comma), lo, hi, v)) return false;
    out.push_back(v);
    if (comma == std::string_view::npos) return true;
    s.remove_prefix(comma + 1);
  }
}

/// Progress by default only when stderr is a terminal and stdout is not the same terminal (the
/// generated text would otherwise be torn by the status line); --progress forces it.
inline bool default_progress() { return ::isatty(2) != 0 && ::isatty(1) == 0; }

inline int default_threads() {
  if (const char* e = std::getenv("THINKV_THREADS"); e != nullptr && *e != '\0') {
    int n = 0;
    if (parse_int(e, 1, 1024, n)) return n;
  }
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}

/// Resolves --model through the search path and loads it with its tokenizer. On failure prints
/// "<cmd>: <message>" to stderr and returns the exit status (kExitData); 0 on success.
inline int load_model_and_tokenizer(const char* cmd, const std::string& model_arg, const std::string& tokenizer_arg,
                                    Model& model, Tokenizer& tok, std::string* resolved = nullptr) {
  std::string path;
  std::vector<std::string> looked;
  {
    std::error_code ec;
    if (std::filesystem::is_directory(model_arg, ec)) {
      std::string inside;
      for (const auto& e : std::filesystem::directory_iterator(model_arg, ec)) {
        const std::string ext = e.path().extension().string();
        if (e.is_regular_file(ec) && (ext == ".bin" || ext == ".gguf")) inside += "\n  " + e.path().string();
      }
      std::fprintf(stderr, "%s: --model %s is a directory; give the model file%s%s\n", cmd, model_arg.c_str(),
                   inside.empty() ? " (it holds no .bin or .gguf file)" : " in it:", inside.c_str());
      return kExitData;
    }
  }
  if (!find_model_file(model_arg, path, looked)) {
    std::string where;
    for (const auto& l : looked) where += "\n  " + l;
    std::fprintf(stderr,
                 "%s: model '%s' not found; looked in:%s\n"
                 "Get the small test models from %s. Pass --model PATH, or put the files in one of the "
                 "places above (or set THINKV_MODELS to their directory).\n",
                 cmd, model_arg.c_str(), where.c_str(), kModelSources);
    return kExitData;
  }
  if (Status s = load_model(path, model); !s.is_ok()) {
    std::fprintf(stderr, "%s: cannot load the model: %s\n", cmd, s.to_string().c_str());
    return kExitData;
  }
  std::string tok_path = tokenizer_arg;
  if (!tok_path.empty()) {
    std::string found;
    std::vector<std::string> tl;
    if (!find_model_file(tokenizer_arg, found, tl)) {
      std::string where;
      for (const auto& l : tl) where += "\n  " + l;
      std::fprintf(stderr, "%s: tokenizer '%s' not found; looked in:%s\nGet it from %s.\n", cmd, tokenizer_arg.c_str(),
                   where.c_str(), kModelSources);
      return kExitData;
    }
    tok_path = found;
  }
  if (Status s = load_tokenizer_for(model, tok_path, tok); !s.is_ok()) {
    std::fprintf(stderr, "%s: cannot load the tokenizer: %s\n", cmd, s.to_string().c_str());
    return kExitData;
  }
  if (resolved) *resolved = path;
  return 0;
}

}  // namespace thinkv::decoder::cli
