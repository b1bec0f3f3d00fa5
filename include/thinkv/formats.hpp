#pragma once
/// \file formats.hpp
/// Umbrella header for the number formats (FP8 E4M3, E2M1/NVFP4, BF16, FP16) and group quantization.
/// See docs/formats.md.

#include "thinkv/formats/bf16.hpp"            // IWYU pragma: export
#include "thinkv/formats/bits.hpp"            // IWYU pragma: export
#include "thinkv/formats/e2m1.hpp"            // IWYU pragma: export
#include "thinkv/formats/fp16.hpp"            // IWYU pragma: export
#include "thinkv/formats/fp16_placement.hpp"  // IWYU pragma: export
#include "thinkv/formats/fp8_e4m3.hpp"        // IWYU pragma: export
#include "thinkv/formats/group_quant.hpp"     // IWYU pragma: export
