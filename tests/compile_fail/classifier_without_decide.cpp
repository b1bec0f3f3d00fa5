// Must NOT compile: a policy set whose classifier lacks decide(). The build test
// (tests/CMakeLists.txt, compile_fail.policy_static_assert) passes when the compiler's output
// carries CachePolicy's static_assert message naming the concept and the call list.

#include "thinkv/thinkv_cache.hpp"

struct NoDecide {
  [[nodiscard]] thinkv::Status check(int) const { return thinkv::Status::ok(); }
  [[nodiscard]] int tau() const { return 128; }
  [[nodiscard]] bool emits(thinkv::ThoughtType) const { return true; }
  [[nodiscard]] bool needs_signal() const { return false; }
  [[nodiscard]] bool uses_layer(int) const { return false; }
  void observe(std::int64_t, const thinkv::TokenHint&) {}
  [[nodiscard]] std::string to_string() const { return "no decide"; }
};

using Broken = thinkv::CachePolicy<NoDecide, thinkv::PrecisionMap, thinkv::NoEviction, thinkv::NoSelection>;

int main() {
  thinkv::ThinKvConfig cfg;
  thinkv::BasicThinKvCache<Broken> cache(cfg);
  return cache.position(0);
}
