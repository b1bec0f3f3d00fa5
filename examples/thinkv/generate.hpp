#pragma once
/// \file generate.hpp
/// `thinkv generate`: decodes a prompt on a real Llama model (llama2.c .bin or GGUF) with the KV
/// cache in one of the modes full / tbq / tbe / thinkv and reports speed, memory and, with
/// `--compare full`, fidelity against FullKV. `thinkv sweep`: the fidelity-vs-memory sweep over
/// modes and budgets behind docs/results.md (a markdown table and an SVG plot).
/// examples/thinkv/README.md documents every flag and the JSON fields.
///
/// Exit status of both: 0 ok, 1 data error (model, tokenizer or calibration file missing or
/// corrupt; a cache error), 2 usage error.

/// Runs `thinkv generate`; argv[0] is the subcommand name.
int run_generate(int argc, char** argv);

/// Runs `thinkv sweep`; argv[0] is the subcommand name.
int run_sweep(int argc, char** argv);
