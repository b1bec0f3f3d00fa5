#pragma once
// Shared by the GPU decoder's tests (test_gpu_decoder.cpp, test_gpu_decoder_tp.cpp): finding and
// loading the model files, and the cache spec the decoder builds for a model.
//
// Models: $THINKV_MODELS, <repo>/models, <repo>/../shared/models (a model not found is skipped).

#include <catch2/catch.hpp>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "decoder/decoder.hpp"

namespace tt {

namespace fs = std::filesystem;

/// The path of model file `name` in the first of those folders holding it, or empty.
inline fs::path find_model_file(const char* name) {
  std::vector<fs::path> dirs;
  if (const char* e = std::getenv("THINKV_MODELS"); e != nullptr && *e != '\0') dirs.emplace_back(e);
  const fs::path repo = fs::path(__FILE__).parent_path() / ".." / "..";
  dirs.push_back(repo / "models");
  dirs.push_back(repo / ".." / "shared" / "models");
  for (const fs::path& d : dirs) {
    if (fs::is_regular_file(d / name)) return d / name;
  }
  return {};
}

/// Loads a model, or prints a SKIPPED line and returns false.
inline bool load_or_skip(const char* name, thinkv::decoder::Model& m) {
  if (const fs::path p = find_model_file(name); !p.empty()) {
    const thinkv::Status s = thinkv::decoder::load_model(p.string(), m);
    INFO(s.to_string());
    REQUIRE(s.is_ok());
    return true;
  }
  const std::string msg = std::string("SKIPPED: ") + name + " not found ($THINKV_MODELS, models/, ../shared/models)";
  WARN(msg);
  std::printf("%s\n", msg.c_str());
  return false;
}

/// The decoder's cache spec for model m (make_cache_config), for `sequences` sequences.
inline thinkv::decoder::ThinKvSpec spec_for(const thinkv::decoder::Model& m, thinkv::decoder::CacheMode mode,
                                            int max_tokens, int budget, int sequences,
                                            const thinkv::ThoughtClassifier& classifier = {}) {
  thinkv::decoder::CacheOptions o;
  o.mode = mode;
  o.max_tokens = max_tokens;
  o.budget = budget;
  o.classifier = classifier;
  thinkv::decoder::ThinKvSpec k;
  const thinkv::Status s = thinkv::decoder::make_cache_config(m.config, o, k);
  INFO(s.to_string());
  REQUIRE(s.is_ok());
  k.num_sequences = sequences;
  return k;
}

}  // namespace tt
