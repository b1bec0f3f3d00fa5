// thinkv: the command-line tool. `thinkv <subcommand> [args]`; `thinkv --help` lists them.
// Adding a subcommand is one line in kSubcommands (plus its run_<name> function).

#include <cstdio>
#include <cstring>
#include <string_view>

#include "calibrate.hpp"
#include "eval.hpp"
#include "generate.hpp"
#include "thoughts.hpp"
#include "trace.hpp"

namespace {

struct Subcommand {
  const char* name;
  const char* summary;
  int (*run)(int argc, char** argv);  ///< argv[0] is the subcommand name; returns the exit status
};

constexpr Subcommand kSubcommands[] = {
    {"generate", "decode on a Llama model (llama2.c .bin / GGUF) with the KV cache in full/tbq/tbe/thinkv mode",
     run_generate},
    {"trace", "record per-layer attention sparsity traces for `thinkv calibrate`", run_trace},
    {"calibrate", "calibrate the thought classifier from sparsity traces (writes calib.json)", run_calibrate},
    {"thoughts", "does sparsity separate the thought types? a trace against ground-truth labels", run_thoughts},
    {"eval", "accuracy vs KV memory on a JSONL problem set, every method and budget (docs/results.md)", run_eval},
    {"sweep", "fidelity vs KV memory over cache modes and budgets on free text", run_sweep},
};

void print_help(std::FILE* out) {
  std::fprintf(out,
               "usage: thinkv <subcommand> [options]\n"
               "\n"
               "ThinKV: KV-cache compression for reasoning models.\n"
               "\n"
               "subcommands:\n");
  for (const Subcommand& s : kSubcommands) std::fprintf(out, "  %-12s %s\n", s.name, s.summary);
  std::fprintf(out,
               "\n"
               "`thinkv <subcommand> --help` describes a subcommand; `thinkv --version` prints the version.\n");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {  // no subcommand: the overview (exit 0, so a bare run is a smoke test)
    print_help(stdout);
    return 0;
  }
  const std::string_view cmd = argv[1];
  if (cmd == "--version" || cmd == "-V" || cmd == "version") {
#if defined(THINKV_VERSION)
    std::printf("thinkv %s\n", THINKV_VERSION);
#else
    std::printf("thinkv (version unknown)\n");
#endif
    return 0;
  }
  if (cmd == "-h" || cmd == "--help" || cmd == "help") {
    if (cmd == "help" && argc >= 3) {  // `thinkv help calibrate`
      for (const Subcommand& s : kSubcommands) {
        if (std::string_view(argv[2]) == s.name) {
          char help[] = "--help";
          char* sub_argv[] = {argv[2], help, nullptr};
          return s.run(2, sub_argv);
        }
      }
    }
    print_help(stdout);
    return 0;
  }
  for (const Subcommand& s : kSubcommands) {
    if (cmd == s.name) return s.run(argc - 1, argv + 1);
  }
  std::fprintf(stderr, "thinkv: unknown subcommand '%s'\n\n", argv[1]);
  print_help(stderr);
  return 2;
}
