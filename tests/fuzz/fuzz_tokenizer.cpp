// llama2.c tokenizer.bin: the first two bytes give the model's vocabulary size (1..65536), the
// rest is the file. A tokenizer that loads must encode and decode any text without reading out of
// bounds (the text: a fixed sentence and the file's own bytes).
#include "../../examples/decoder/decoder.hpp"
#include "fuzz_common.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace thinkv::decoder;
  if (size < 2) return 0;
  const int vocab = 1 + (data[0] | (data[1] << 8));
  auto f = MappedFile::from_bytes("fuzz-tok.bin", as_bytes(data + 2, size - 2));
  Tokenizer t;
  if (!load_llama2c_tokenizer(f, vocab, t).is_ok()) return 0;
  FUZZ_CHECK(t.size() == vocab);
  for (const std::string_view text :
       {std::string_view("Values: a=12, b=7.\nAnswer: 19"), as_text(data, std::min<std::size_t>(size, 256))}) {
    const std::vector<int> ids = t.encode(text, true, true);
    for (int id : ids) FUZZ_CHECK(id >= 0 && id < t.size());
    (void)t.decode(ids, t.bos_id);
  }
  for (int id = 0; id < t.size() && id < 4096; ++id) (void)t.decode_piece(t.bos_id, id);
  return 0;
}
