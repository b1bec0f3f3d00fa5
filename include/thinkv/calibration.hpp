#pragma once
/// \file calibration.hpp
/// Umbrella header of the calibration component (`thinkv::calibration`, CMake package component
/// `calibration`): offline tooling, not needed to decode. Sparsity traces (CSV, trace.hpp), the
/// KDE calibration of the thought classifier (calibration.hpp), the calibration file (JSON,
/// calibration_file.hpp: `read_calibration_json` + `classifier_from_calibration`, what a decoder
/// calls once at start-up) and the density plot (SVG, density_plot.hpp).
///
/// The runtime (`<thinkv/thinkv.hpp>`, `thinkv::core`) includes none of this; a decoder that
/// builds its classifier from thresholds it already has (`ThoughtClassifier::three_types`) never
/// needs it. Header-only and dependency-free like the core.

#include "thinkv/thinkv.hpp"
#include "thinkv/thought/calibration.hpp"
#include "thinkv/thought/calibration_file.hpp"
#include "thinkv/thought/density_plot.hpp"
#include "thinkv/thought/trace.hpp"
