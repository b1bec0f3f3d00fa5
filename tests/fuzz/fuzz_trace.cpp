// Sparsity traces (CSV, docs/calibration.md): a trace that reads must pass the writer's checks,
// write, and read back equal; calibration on it must return a Status.
#include <sstream>

#include "fuzz_common.hpp"
#include "thinkv/thought/calibration.hpp"
#include "thinkv/thought/trace.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace thinkv;
  if (size > (1 << 16)) return 0;
  std::istringstream in{std::string(as_text(data, size))};
  SparsityTrace t;
  if (!read_sparsity_trace(in, "fuzz.csv", t).is_ok()) return 0;
  FUZZ_CHECK(validate_sparsity_trace(t).is_ok());
  if (t.model.empty()) return 0;
  std::ostringstream out;
  FUZZ_CHECK(write_sparsity_trace(out, t).is_ok());
  std::istringstream back_in(out.str());
  SparsityTrace back;
  FUZZ_CHECK(read_sparsity_trace(back_in, "rewritten.csv", back).is_ok());
  FUZZ_CHECK(back.total_steps() == t.total_steps() && back.num_layers == t.num_layers);
  if (t.num_layers <= 8 && t.total_steps() <= 4096) {
    CalibrationOptions opt;
    opt.min_prompts = 1;
    CalibrationResult r;
    (void)calibrate(t, opt, r);
  }
  return 0;
}
