#pragma once
/// \file thoughts.hpp
/// `thinkv thoughts`: whether attention sparsity separates the thought types on a model, from a
/// sparsity trace and ground-truth labels of the generated text (examples/thinkv/README.md).

/// Runs `thinkv thoughts`; argv[0] is the subcommand name. Exit status 0 ok, 1 data error, 2 usage.
int run_thoughts(int argc, char** argv);
