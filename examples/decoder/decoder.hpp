#pragma once
/// \file decoder.hpp
/// The decoder in one include: model loading by file content (GGUF magic, llama2.c "ak42"
/// magic, else a legacy llama2.c v0 checkpoint), the model search path of the `thinkv` CLI and
/// the tokenizer that goes with a model.

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "gguf.hpp"
#include "llama2c.hpp"
#include "methods.hpp"
#include "model.hpp"
#include "model_file.hpp"
#include "sampler.hpp"
#include "session.hpp"
#include "tokenizer.hpp"
#include "transformer.hpp"

namespace thinkv::decoder {

/// Where the small test models come from (docs and error messages).
inline constexpr const char* kModelSources =
    "karpathy/tinyllamas on the Hugging Face hub (stories260K/stories260K.bin and "
    "stories260K/tok512.bin) and ggml-org/models (tinyllamas/stories260K.gguf); see "
    "../shared/models/SOURCES.md";

/// Loads a model file of any supported format.
inline Status load_model(const std::string& path, Model& out) {
  std::shared_ptr<const MappedFile> f;
  THINKV_RETURN_IF_ERROR(MappedFile::open(path, f));
  std::uint32_t magic = 0;
  if (f->size() >= 4) std::memcpy(&magic, f->data(), 4);
  const bool gguf_name = path.size() >= 5 && path.compare(path.size() - 5, 5, ".gguf") == 0;
  if (magic == kGgufMagic || gguf_name) {  // a .gguf with another magic gets the GGUF reader's message
    GgufFile g;
    THINKV_RETURN_IF_ERROR(read_gguf(f, g));
    return load_gguf_model(g, out);
  }
  if (f->size() < 28) {
    return {StatusCode::kInvalidArgument,
            path + ": truncated or not a model file: " + std::to_string(f->size()) +
                " bytes (a llama2.c checkpoint has a 28-byte header, a GGUF starts with 'GGUF')"};
  }
  return load_llama2c(f, out);
}

/// Resolves --model: a path that exists is used as given; a bare file name (no '/') is also
/// looked up in $THINKV_MODELS, ./models and ../shared/models. `looked` lists every place tried.
inline bool find_model_file(const std::string& name, std::string& found, std::vector<std::string>& looked) {
  namespace fs = std::filesystem;
  std::error_code ec;
  looked.clear();
  auto try_path = [&](const std::string& p) {
    looked.push_back(p);
    if (fs::is_regular_file(p, ec)) {
      found = p;
      return true;
    }
    return false;
  };
  if (try_path(name)) return true;
  if (name.find('/') != std::string::npos) return false;
  if (const char* env = std::getenv("THINKV_MODELS"); env != nullptr && *env != '\0') {
    if (try_path(std::string(env) + "/" + name)) return true;
  } else {
    looked.push_back("$THINKV_MODELS/" + name + " ($THINKV_MODELS is not set)");
  }
  if (try_path("./models/" + name)) return true;
  if (try_path("../shared/models/" + name)) return true;
  return false;
}

/// The default tokenizer of a model: the GGUF's own; for a llama2.c model tok<vocab>.bin, then
/// tokenizer.bin, next to the model file. Empty when there is none.
inline std::string default_tokenizer_path(const Model& m) {
  if (m.tokenizer) return {};
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(m.path).parent_path();
  std::error_code ec;
  for (const std::string& n : {"tok" + std::to_string(m.config.vocab_size) + ".bin", std::string("tokenizer.bin")}) {
    const fs::path p = dir / n;
    if (fs::is_regular_file(p, ec)) return p.string();
  }
  return {};
}

/// The tokenizer for a model: `path` when given (a llama2.c tokenizer.bin), else the default.
inline Status load_tokenizer_for(const Model& m, const std::string& path, Tokenizer& out) {
  if (!path.empty()) return load_llama2c_tokenizer(path, m.config.vocab_size, out);
  if (m.tokenizer) {
    out = *m.tokenizer;
    return Status::ok();
  }
  const std::string p = default_tokenizer_path(m);
  if (p.empty()) {
    const std::string tok = "tok" + std::to_string(m.config.vocab_size) + ".bin";
    return {StatusCode::kInvalidArgument,
            m.path + ": no tokenizer: looked for " + tok +
                " and tokenizer.bin next to the model; give one with --tokenizer PATH (llama2.c "
                "tokenizer.bin format), or put it next to the model. The small test models' "
                "tokenizer (tok512.bin) comes from " +
                kModelSources};
  }
  return load_llama2c_tokenizer(p, m.config.vocab_size, out);
}

}  // namespace thinkv::decoder
