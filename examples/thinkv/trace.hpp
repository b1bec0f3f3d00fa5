#pragma once
/// \file trace.hpp
/// `thinkv trace`: records the per-layer attention sparsity of every decode step of one or more
/// prompts (FullKV cache, every layer traced) in the sparsity-trace CSV format that
/// `thinkv calibrate` reads (include/thinkv/thought/trace.hpp, docs/calibration.md).
///
/// Exit status: 0 ok, 1 data error, 2 usage error.

/// Runs `thinkv trace`; argv[0] is the subcommand name.
int run_trace(int argc, char** argv);
