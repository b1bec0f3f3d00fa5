// llama2.c checkpoints: legacy v0 (FP32) and v2 (Q8_0) headers and weights.
#include "../../examples/decoder/decoder.hpp"
#include "fuzz_common.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace thinkv::decoder;
  auto f = MappedFile::from_bytes("fuzz.bin", as_bytes(data, size));
  Model m;
  if (size < 28) return 0;  // load_model refuses these before the reader
  if (!load_llama2c(f, m).is_ok()) return 0;
  FUZZ_CHECK(m.config.validate("fuzz").is_ok());
  FUZZ_CHECK(m.config.vocab_size > 0 && m.config.dim > 0);
  return 0;
}
