// Calibration files (JSON, docs/calibration.md) into the run-time classifier, as `thinkv
// generate --calibration` loads them; a file that reads writes and reads back the same.
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
  // A file that reads writes, and reads back to the same content.
  std::ostringstream os;
  FUZZ_CHECK(write_calibration_json(os, f).is_ok());
  std::istringstream again(os.str());
  CalibrationFile g;
  FUZZ_CHECK(read_calibration_json(again, "rewritten.json", g).is_ok());
  FUZZ_CHECK(g.thresholds == f.thresholds && g.layers == f.layers && g.tau == f.tau && g.num_types == f.num_types &&
             g.band_types == f.band_types && g.model_name == f.model_name && g.provenance.date == f.provenance.date);
  try {
    std::vector<ThoughtType> bands(f.band_types.begin(), f.band_types.begin() + f.num_types);
    const ThoughtClassifier c(f.thresholds, f.layers, f.tau, bands, f.num_layers);
    std::vector<float> sp(static_cast<std::size_t>(c.num_layers()), 0.5f);
    (void)c.classify(c.signal(sp));
  } catch (const ConfigError&) {}
  return 0;
}
