// basic_cache: the smallest end-to-end use of ThinKV's compressed paged KV cache.
//
// Builds a PagedKvCache for a stream layout, appends tokens with shifting thought types (the
// thought classifier of a real decoder is not wired in yet: types come from a fixed synthetic
// schedule), evicts a share of old slots to show in-place reuse, runs one decode-attention step,
// and prints memory held against FullKV FP16 and the attention error against the uncompressed
// tokens, for FullKV (BF16 pages) and for each TBQ precision map asked for.
//
//   basic_cache [--streams N] [--tokens N] [--head-dim D] [--group G] [--block B]
//               [--maps R4E4T2,R8E4T2] [--evict-share F] [--seed S]

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "thinkv/thinkv.hpp"

namespace {

struct Options {
  int streams = 32;
  int tokens = 2048;
  int head_dim = 128;
  int group = 16;
  int block = 16;
  int q_per_kv = 4;
  double evict_share = 0.25;
  unsigned seed = 1;
  std::vector<std::string> maps = {"R16E16T16", "R8E4T2", "R4E4T2"};
};

[[noreturn]] void usage_error(const std::string& msg) {
  std::fprintf(stderr,
               "basic_cache: %s\n"
               "usage: basic_cache [--streams N] [--tokens N] [--head-dim D] [--group 8|16|32]\n"
               "                   [--block B] [--maps R4E4T2,...] [--evict-share 0..0.9] [--seed S]\n",
               msg.c_str());
  std::exit(2);
}

int parse_int(std::string_view flag, const char* v, int lo, int hi) {
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (end == v || *end != '\0' || x < lo || x > hi) {
    usage_error(std::string(flag) + " " + v + " is not an integer in " + std::to_string(lo) + ".." +
                std::to_string(hi));
  }
  return static_cast<int>(x);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) usage_error(std::string(a) + " needs a value");
      return argv[++i];
    };
    if (a == "--streams")
      o.streams = parse_int(a, next(), 1, 4096);
    else if (a == "--tokens")
      o.tokens = parse_int(a, next(), 1, 1 << 20);
    else if (a == "--head-dim")
      o.head_dim = parse_int(a, next(), 1, 1024);
    else if (a == "--group")
      o.group = parse_int(a, next(), 1, 64);
    else if (a == "--block")
      o.block = parse_int(a, next(), 1, 4096);
    else if (a == "--seed")
      o.seed = static_cast<unsigned>(parse_int(a, next(), 0, 1 << 30));
    else if (a == "--evict-share") {
      const char* v = next();
      char* end = nullptr;
      o.evict_share = std::strtod(v, &end);
      if (end == v || *end != '\0' || !(o.evict_share >= 0.0 && o.evict_share <= 0.9)) {
        usage_error(std::string("--evict-share ") + v + " is not a number in 0..0.9");
      }
    } else if (a == "--maps") {
      o.maps.clear();
      std::string s = next();
      for (std::size_t p = 0; p <= s.size();) {
        const std::size_t q = s.find(',', p);
        o.maps.push_back(s.substr(p, q == std::string::npos ? std::string::npos : q - p));
        if (q == std::string::npos) break;
        p = q + 1;
      }
    } else if (a == "--help" || a == "-h") {
      usage_error("help");
    } else {
      usage_error("unknown flag " + std::string(a));
    }
  }
  return o;
}

/// Synthetic thought schedule: 128-token segments, mostly R and E with occasional T.
thinkv::ThoughtType thought_at(int segment, std::mt19937& rng) {
  (void)segment;
  const int r = static_cast<int>(rng() % 10);
  return r < 5 ? thinkv::ThoughtType::kReasoning
               : (r < 8 ? thinkv::ThoughtType::kExecution : thinkv::ThoughtType::kTransition);
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  std::printf(
      "ThinKV basic_cache: %d streams x %d tokens, head_dim %d, group %d, block %d, "
      "evicting %.0f%% of the oldest quarter's slots, seed %u\n",
      o.streams, o.tokens, o.head_dim, o.group, o.block, 100.0 * o.evict_share, o.seed);
  std::printf("%-10s %14s %14s %8s %10s %8s %12s\n", "map", "physical B", "FullKV FP16 B", "ratio", "holes", "reused",
              "attn relerr");
  // The tokens (post-RoPE K, V) every map sees: Gaussian with a few outlier channels.
  std::mt19937 rng(o.seed);
  std::normal_distribution<float> normal;
  const std::size_t row = static_cast<std::size_t>(o.head_dim);
  std::vector<float> keys(static_cast<std::size_t>(o.tokens) * row), values(keys.size());
  for (std::size_t i = 0; i < keys.size(); ++i) {
    const bool outlier = (i % row) % 37 == 5;
    keys[i] = normal(rng) * (outlier ? 8.0f : 1.0f);
    values[i] = normal(rng);
  }
  std::vector<thinkv::ThoughtType> thought(static_cast<std::size_t>(o.tokens));
  for (int t = 0; t < o.tokens; ++t) {
    if (t % 128 == 0)
      thought[static_cast<std::size_t>(t)] = thought_at(t / 128, rng);
    else
      thought[static_cast<std::size_t>(t)] = thought[static_cast<std::size_t>(t - 1)];
  }
  std::vector<float> q(static_cast<std::size_t>(o.q_per_kv) * row);
  for (auto& x : q) x = normal(rng);

  for (const std::string& map_text : o.maps) {
    thinkv::CacheConfig cfg;
    cfg.num_streams = o.streams;
    cfg.head_dim = o.head_dim;
    cfg.group_size = o.group;
    cfg.block_size = o.block;
    if (thinkv::Status s = thinkv::PrecisionMap::parse(map_text, cfg.precision); !s.is_ok()) {
      std::fprintf(stderr, "basic_cache: %s\n", s.to_string().c_str());
      return 2;
    }
    const int blocks_per_stream = (o.tokens + o.block - 1) / o.block + 2;
    for (thinkv::Precision p : thinkv::kAllPrecisions) {
      if (cfg.precision.uses(p)) { cfg.pool_blocks[static_cast<int>(p)] = o.streams * blocks_per_stream; }
    }
    try {
      thinkv::PagedKvCache<> cache(cfg);
      // Append every token to every stream, evicting part of the oldest quarter half-way, so
      // the second half reuses those slots in place.
      std::vector<std::vector<thinkv::SlotRef>> evicted(static_cast<std::size_t>(o.streams));
      for (int t = 0; t < o.tokens; ++t) {
        for (int s = 0; s < o.streams; ++s) {
          const std::span<const float> k(keys.data() + static_cast<std::size_t>(t) * row, row);
          const std::span<const float> v(values.data() + static_cast<std::size_t>(t) * row, row);
          if (thinkv::Status st =
                  cache.append(s, k, v, thought[static_cast<std::size_t>(t)], static_cast<std::uint32_t>(t / 128));
              !st.is_ok()) {
            std::fprintf(stderr, "basic_cache: append failed: %s\n", st.to_string().c_str());
            return 1;
          }
          if (t == o.tokens / 2 && o.evict_share > 0.0) {
            std::vector<thinkv::SlotRef> victims;
            for (thinkv::SlotRef r : cache.table().live_slot_list(s)) {
              if (cache.table().slot_position(r) < o.tokens / 4 &&
                  std::uniform_real_distribution<double>(0, 1)(rng) < o.evict_share) {
                victims.push_back(r);
              }
            }
            if (thinkv::Status st = cache.evict(s, victims); !st.is_ok()) {
              std::fprintf(stderr, "basic_cache: evict failed: %s\n", st.to_string().c_str());
              return 1;
            }
          }
        }
      }
      // One decode step on stream 0 with GQA (q_per_kv query heads), against FP32 attention over
      // the same live tokens before compression.
      std::vector<float> out(q.size(), NAN);
      const std::int32_t stream0 = 0;
      thinkv::DecodeAttentionArgs args;
      args.num_q_heads = o.q_per_kv;
      args.num_kv_heads = 1;
      args.kv_streams = &stream0;
      args.q = q.data();
      args.out = out.data();
      if (thinkv::Status st = cache.attend(args); !st.is_ok()) {
        std::fprintf(stderr, "basic_cache: attend failed: %s\n", st.to_string().c_str());
        return 1;
      }
      std::vector<float> lk, lv;
      for (thinkv::SlotRef r : cache.table().live_slot_list(0)) {
        const auto pos = static_cast<std::size_t>(cache.table().slot_position(r));
        lk.insert(lk.end(), keys.begin() + pos * row, keys.begin() + (pos + 1) * row);
        lv.insert(lv.end(), values.begin() + pos * row, values.begin() + (pos + 1) * row);
      }
      for (int r = 0; r < cache.table().staged_count(0); ++r) {
        const auto pos = static_cast<std::size_t>(cache.table().staged_position(0, r));
        lk.insert(lk.end(), keys.begin() + pos * row, keys.begin() + (pos + 1) * row);
        lv.insert(lv.end(), values.begin() + pos * row, values.begin() + (pos + 1) * row);
      }
      std::vector<float> want(q.size());
      thinkv::reference::attend_tokens(q.data(), o.q_per_kv, lk.data(), lv.data(), static_cast<int>(lk.size() / row),
                                       o.head_dim, 1.0f / std::sqrt(static_cast<float>(o.head_dim)), want.data());
      double num = 0, den = 0;
      for (std::size_t i = 0; i < out.size(); ++i) {
        num += (out[i] - want[i]) * (out[i] - want[i]);
        den += want[i] * want[i];
      }
      const thinkv::MemoryUsage m = cache.memory();
      std::printf("%-10s %14lld %14lld %7.2f%% %10lld %8lld %12.2e\n", map_text.c_str(),
                  static_cast<long long>(m.physical_bytes()), static_cast<long long>(m.fullkv_fp16_bytes),
                  100.0 * m.ratio(), static_cast<long long>(m.hole_slots),
                  static_cast<long long>(cache.table().stats().slots_reused), std::sqrt(num / den));
    } catch (const thinkv::ConfigError& e) {
      std::fprintf(stderr, "basic_cache: invalid configuration: %s\n", e.what());
      return 2;
    }
  }
  std::printf(
      "ratio = physical bytes held (pages with holes, scales, metadata, staging) / FullKV "
      "FP16 bytes of the same live tokens; attn relerr = ||out - out_fp32|| / ||out_fp32||\n");
  return 0;
}
