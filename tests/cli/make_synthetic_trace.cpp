// Writes a synthetic sparsity trace for the CLI tests: per prompt and step, layers 1 and 3 draw
// from a trimodal mixture (modes 0.25 / 0.55 / 0.85), the other layers from one mode, or (kind
// "unimodal") every layer from one mode; 8 prompts of 800 steps unless PROMPTS says otherwise.
//   make_synthetic_trace OUT.csv trimodal|unimodal [seed [prompts]]

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>

#include "thinkv/thought/trace.hpp"

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: make_synthetic_trace OUT.csv trimodal|unimodal [seed [prompts]]\n");
    return 2;
  }
  const std::string kind = argv[2];
  std::mt19937 rng(argc > 3 ? static_cast<unsigned>(std::strtoul(argv[3], nullptr, 10)) : 1u);
  const int prompts = argc > 4 ? std::atoi(argv[4]) : 8;
  if (prompts < 1) {
    std::fprintf(stderr, "make_synthetic_trace: prompts '%s' must be an integer >= 1\n", argv[4]);
    return 2;
  }
  std::normal_distribution<float> noise(0.0f, 0.045f);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  thinkv::SparsityTrace t;
  t.model = "synthetic-5L";
  t.num_layers = 5;
  for (int p = 0; p < prompts; ++p) {
    thinkv::PromptTrace pt;
    pt.id = "p" + std::to_string(p);
    for (int s = 0; s < 800; ++s) {
      pt.steps.push_back(s);
      for (int l = 0; l < t.num_layers; ++l) {
        float centre = 0.5f;
        if (kind == "trimodal" && (l == 1 || l == 3)) {
          const float r = u(rng);
          centre = r < 0.4f ? 0.25f : (r < 0.8f ? 0.55f : 0.85f);
        }
        pt.values.push_back(std::clamp(centre + noise(rng), 0.0f, 1.0f));
      }
    }
    t.prompts.push_back(std::move(pt));
  }
  std::ofstream out(argv[1]);
  if (thinkv::Status s = thinkv::write_sparsity_trace(out, t); !s.is_ok()) {
    std::fprintf(stderr, "make_synthetic_trace: %s\n", s.to_string().c_str());
    return 1;
  }
  return 0;
}
