// GGUF: the header, metadata, tensor infos and the llama model built from them, and the
// embedded tokenizer (encode and decode of a text).
#include "../../examples/decoder/decoder.hpp"
#include "fuzz_common.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace thinkv::decoder;
  auto f = MappedFile::from_bytes("fuzz.gguf", as_bytes(data, size));
  GgufFile g;
  if (!read_gguf(f, g).is_ok()) return 0;
  Model m;
  if (!load_gguf_model(g, m).is_ok()) return 0;
  FUZZ_CHECK(m.config.validate("fuzz").is_ok());
  if (m.tokenizer) {
    const std::vector<int> ids = m.tokenizer->encode("Once upon a time, 3+4=7.", true, true);
    for (int id : ids) FUZZ_CHECK(id >= 0 && id < m.tokenizer->size());
    (void)m.tokenizer->decode(ids, m.tokenizer->bos_id);
  }
  return 0;
}
