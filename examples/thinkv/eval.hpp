#pragma once
/// \file eval.hpp
/// `thinkv eval`: accuracy against KV memory. Decodes every problem of a JSONL set (fields
/// `prompt` and `answer`) greedily under each KV-cache method and budget of a sweep, takes the
/// answer from the output with a pattern, and reports accuracy, KV bytes held and allocated
/// against FullKV FP16, generated length, evictions per step, divergence from FullKV and time:
/// a console table, a Markdown table, an SVG plot and JSON. examples/thinkv/README.md documents
/// every flag and field.
///
/// Exit status: 0 ok, 1 data error (a problem file, model or labels file that cannot be used; a
/// pattern that matches no output; a cache error), 2 usage error.

/// Runs `thinkv eval`; argv[0] is the subcommand name.
int run_eval(int argc, char** argv);
