// Calibration files (JSON, docs/calibration.md) into the run-time classifier, as `thinkv
// generate --calibration` loads them.
#include <sstream>

#include "fuzz_common.hpp"
#include "thinkv/thought/calibration_file.hpp"
#include "thinkv/thought/classifier.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace thinkv;
  std::istringstream in{std::string(as_text(data, size))};
  CalibrationFile f;
  if (!read_calibration_json(in, "fuzz.json", f).is_ok()) return 0;
  FUZZ_CHECK(f.num_types >= 1 && f.num_types <= 3);
  try {
    std::vector<ThoughtType> bands(f.band_types.begin(), f.band_types.begin() + f.num_types);
    const ThoughtClassifier c(f.thresholds, f.layers, f.tau, bands, f.num_layers);
    std::vector<float> sp(static_cast<std::size_t>(c.num_layers()), 0.5f);
    (void)c.classify(c.signal(sp));
  } catch (const ConfigError&) {}
  return 0;
}
