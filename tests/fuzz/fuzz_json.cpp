// The JSON parser under the calibration files (include/thinkv/util/json.hpp): a document that
// parses must write and parse back to the same text.
#include "fuzz_common.hpp"
#include "thinkv/util/json.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace thinkv;
  json::Value v;
  if (!json::parse(as_text(data, size), "fuzz.json", v).is_ok()) return 0;
  const std::string text = json::write(v, 0);
  json::Value w;
  FUZZ_CHECK(json::parse(text, "rewritten.json", w).is_ok());
  FUZZ_CHECK(json::write(w, 0) == text);
  return 0;
}
