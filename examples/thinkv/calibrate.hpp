#pragma once
/// \file calibrate.hpp
/// `thinkv calibrate`: calibrates the thought classifier from sparsity traces and writes the
/// calibration file (docs/calibration.md).

/// Runs `thinkv calibrate`; argv[0] is the subcommand name. Returns the process exit status:
/// 0 on success, 1 for data errors (unreadable or corrupt traces, calibration failed, output not
/// writable), 2 for usage errors.
int run_calibrate(int argc, char** argv);
