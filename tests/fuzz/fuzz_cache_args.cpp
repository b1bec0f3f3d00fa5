// CLI arguments into a cache configuration: the input is a newline-separated argument list for
// the cache flags `thinkv generate` and `eval` share (--mode, --budget, --group, --segment, --tau,
// --precision, --select, --keep-prompt, ...) plus a prompt length; a configuration that builds
// must construct its cache and decode a few tokens of a tiny model shape.
#include <string>
#include <vector>

#include "../../examples/thinkv/cache_flags.hpp"
#include "fuzz_common.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace thinkv;
  using namespace thinkv::decoder;
  using namespace thinkv::decoder::cli;
  if (size > 4096) return 0;
  std::vector<std::string> args{"fuzz"};
  std::string cur;
  for (std::size_t i = 0; i < size; ++i) {
    if (data[i] == '\n') {
      args.push_back(cur);
      cur.clear();
    } else {
      cur += static_cast<char>(data[i]);
    }
  }
  if (!cur.empty()) args.push_back(cur);
  // Model shape: 2 layers, 4 query / 2 KV heads of 16, context 96.
  ModelConfig mc;
  mc.dim = 64;
  mc.hidden_dim = 96;
  mc.n_layers = 2;
  mc.n_heads = 4;
  mc.n_kv_heads = 2;
  mc.head_dim = 16;
  mc.rope_dim = 16;
  mc.vocab_size = 32;
  mc.seq_len = 96;
  CacheFlags flags;
  Method method = Method::kThinKv;
  int prompt = 5;
  // The parser of `thinkv generate` for these flags: usage errors print to stderr (run with
  // -close_fd_mask=2) and end the input.
  ArgParser p("fuzz", "");
  add_cache_options(p, flags);
  p.value("--mode", [&method](const std::string& v) {
    const auto m = parse_method(v);
    if (!m) return std::string("not a method");
    method = *m;
    return std::string();
  });
  p.integer("--prompt-tokens", prompt, 1, 95, "must be in 1..95");
  args.erase(args.begin());  // the program name
  if (p.parse(args) != 0) return 0;
  MethodOptions mo;
  mo.method = method;
  mo.cache = cache_options(flags, thinkv_mode(method), mc.seq_len, ThoughtClassifier{}, prompt);
  mo.selection = flags.selection;
  CacheSpec spec;
  if (!make_cache_spec(mc, mo, spec).is_ok()) return 0;
  std::unique_ptr<DecodeCache> cache;
  if (!make_session_cache(spec, {}, cache).is_ok()) return 0;
  const CacheShape sh = cache->shape();
  std::vector<float> k(sh.kv_size()), v(sh.kv_size()), q(sh.q_size()), out(sh.q_size());
  for (int t = 0; t < 40; ++t) {
    for (std::size_t i = 0; i < k.size(); ++i) {
      k[i] = static_cast<float>((i * 7 + static_cast<std::size_t>(t) * 3) % 11) - 5.0f;
      v[i] = static_cast<float>((i * 5 + static_cast<std::size_t>(t)) % 7) - 3.0f;
    }
    for (std::size_t i = 0; i < q.size(); ++i) q[i] = static_cast<float>((i + static_cast<std::size_t>(t)) % 5) - 2.0f;
    FUZZ_CHECK(cache->begin_token(0).is_ok());
    for (int l = 0; l < sh.num_layers; ++l) {
      FUZZ_CHECK(cache->append(0, l, k, v).is_ok());
      FUZZ_CHECK(cache->attend(0, l, q, out).is_ok());
    }
    FUZZ_CHECK(cache->end_token(0).is_ok());
  }
  const CacheReport r = cache->report(0);
  FUZZ_CHECK(r.positions == 40 && r.held_bytes > 0);
  return 0;
}
