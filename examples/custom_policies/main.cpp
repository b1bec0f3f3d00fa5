// User-written policies through the library's cache: a classifier that reads "Wait" lines
// (no attention signal), a linear retention schedule and a keep-most-recent selector, plugged
// into BasicThinKvCache beside the library's own precision map. The "model" is a toy: each
// token's K/V are random; the text decides the thought types, the policies the memory.
//
//     custom_policies            prints the segments, their types and what they kept

#include <cstdio>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "thinkv/thinkv.hpp"
#include "user_policies.hpp"

namespace {

// A chain of thought whose second and fourth paragraphs reconsider.
const char* const kText =
    "First compute the sum of the first ten odd numbers and check it against the square of ten.\n"
    "The odd numbers are one three five seven nine eleven thirteen fifteen seventeen and nineteen.\n"
    "Wait, maybe there is a faster way: the sum of the first n odd numbers is n squared.\n"
    "So the sum is one hundred, which matches ten squared, as the formula says it should.\n"
    "Now the second part asks for the sum of the first twenty odd numbers, by the same formula.\n"
    "Wait, the question says even numbers, not odd ones, so the formula is n times n plus one.\n"
    "That gives twenty times twenty one, which is four hundred and twenty, the final answer.\n";

std::vector<std::string> words_of(const std::string& text) {
  std::vector<std::string> out;
  std::string w;
  for (char c : text) {
    w += c;
    if (c == ' ' || c == '\n') {
      out.push_back(w);
      w.clear();
    }
  }
  if (!w.empty()) out.push_back(w);
  return out;
}

}  // namespace

int main() {
  // The user's policy set: their classifier, schedule and selector with the library's precision map.
  using MyPolicy =
      thinkv::CachePolicy<user::WaitLineClassifier, thinkv::PrecisionMap, user::LinearRetention, user::KeepMostRecent>;
  thinkv::ThinKvConfig cfg;
  cfg.num_layers = 2;
  cfg.num_kv_heads = 2;
  cfg.num_q_heads = 4;
  cfg.head_dim = 64;
  cfg.max_tokens = 512;
  cfg.segment_len = 64;
  cfg.token_budget = 64;  // per stream: eviction starts once the text is longer
  MyPolicy policy;
  policy.classifier = user::WaitLineClassifier(16);    // refresh every 16 tokens
  policy.retention = user::LinearRetention{12, 4, 3};  // a 16-token window keeps 12, 8, then 4
  thinkv::BasicThinKvCache<MyPolicy> cache(cfg, policy);

  const std::vector<std::string> words = words_of(kText);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::vector<float> k(2 * 64), v(2 * 64), q(4 * 64), out(4 * 64);
  for (std::size_t i = 0; i < words.size(); ++i) {
    const thinkv::TokenHint hint{static_cast<std::int32_t>(i), words[i]};
    if (thinkv::Status s = cache.begin_token(0, hint); !s.is_ok()) {
      std::fprintf(stderr, "begin_token: %s\n", s.to_string().c_str());
      return 1;
    }
    for (int l = 0; l < cfg.num_layers; ++l) {
      for (auto& x : k) x = normal(rng);
      for (auto& x : v) x = normal(rng);
      for (auto& x : q) x = normal(rng);
      thinkv::Status s = cache.append(0, l, k, v);
      if (s.is_ok()) s = cache.attend(0, l, q, out);
      if (!s.is_ok()) {
        std::fprintf(stderr, "layer %d: %s\n", l, s.to_string().c_str());
        return 1;
      }
    }
    if (thinkv::Status s = cache.end_token(0); !s.is_ok()) {
      std::fprintf(stderr, "end_token: %s\n", s.to_string().c_str());
      return 1;
    }
  }
  std::printf("%s: %zu tokens, %lld live per stream, %lld evicted (all streams)\n", cache.method_name().c_str(),
              words.size(), static_cast<long long>(cache.live_tokens(0)),
              static_cast<long long>(cache.stats().tokens_evicted));
  int transitions = 0;
  for (const thinkv::SegmentState& s : cache.segments(0)) {
    std::printf("  segment %u at %4d: %s, level %d, %d tokens kept\n", s.id, s.start,
                std::string(thinkv::to_string(s.type)).c_str(), s.level, s.size);
    transitions += s.type == thinkv::ThoughtType::kTransition;
  }
  const thinkv::MemoryUsage m = cache.memory(0);
  std::printf("held %lld bytes (%.1f %% of FullKV FP16 of every position); %d transition segments\n",
              static_cast<long long>(m.physical_bytes()),
              100.0 * static_cast<double>(m.physical_bytes()) / static_cast<double>(cache.fullkv_sequence_bytes(0)),
              transitions);
  // The text has two "Wait" lines: each must have made a transition window.
  return transitions >= 2 ? 0 : 1;
}
