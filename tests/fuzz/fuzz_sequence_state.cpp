// A saved sequence state (BasicThinKvCache::load_sequence, docs/formats.md §10), structure-aware:
// the input chooses a valid state and how to damage it, so the parser behind the CRC is reached.
//   byte 0      how many tokens the saved sequence decoded ((byte % 128) x 2, 0..254; TBE evicts
//               past 128), its K/V drawn from byte 1
//   byte 1      the random seed of those tokens
//   byte 2      bit 0: reseal the CRC after the edits (else the checksum must catch them);
//               bit 1: truncate to the length in bytes 3..4 (little-endian, modulo the size)
//   bytes 5..   edits of 5 bytes each: a little-endian u32 offset (modulo the size) and a byte to
//               XOR there
// The state is loaded into an empty sequence of a cache whose other sequence holds tokens. A load
// that fails must leave the cache exactly as it was (a second save of the other sequence is byte
// for byte the same, nothing is allocated, the target stays empty); a load that succeeds must
// save back to the same bytes, and decoding a token after it may fail only with a Status.
#include <array>
#include <random>
#include <vector>

#include "fuzz_common.hpp"
#include "thinkv/thinkv.hpp"

namespace {

constexpr int kLayers = 2, kKvHeads = 2, kQHeads = 4, kHeadDim = 16;

void decode(thinkv::ThinKvCache<>& cache, int seq, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  std::vector<float> k(kKvHeads * kHeadDim), v(k.size()), q(kQHeads * kHeadDim), out(q.size());
  FUZZ_CHECK(cache.begin_token(seq).is_ok());
  for (int l = 0; l < kLayers; ++l) {
    for (float& x : k) x = normal(rng);
    for (float& x : v) x = normal(rng);
    for (float& x : q) x = normal(rng);
    FUZZ_CHECK(cache.append(seq, l, k, v).is_ok());
    FUZZ_CHECK(cache.attend(seq, l, q, out).is_ok());
  }
  FUZZ_CHECK(cache.end_token(seq).is_ok());
}

thinkv::ThinKvCache<> make_cache() {
  thinkv::ThinKvConfig cfg;
  cfg.num_sequences = 3;
  cfg.num_layers = kLayers;
  cfg.num_kv_heads = kKvHeads;
  cfg.num_q_heads = kQHeads;
  cfg.head_dim = kHeadDim;
  cfg.group_size = 8;
  cfg.segment_len = 64;
  cfg.max_tokens = 1024;
  cfg.token_budget = 128;
  thinkv::ThinKvPolicy policy;  // R4E4T2 with TBE (K-means); every token R without calibration
  policy.precision = thinkv::kR4E4T2;
  return thinkv::ThinKvCache<>(cfg, policy);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 5 || size > 4096) return 0;
  static thinkv::ThinKvCache<> cache = make_cache();
  for (int s = 0; s < 3; ++s) FUZZ_CHECK(cache.reset_sequence(s).is_ok());
  // The state: sequence 0 decodes (data[0] % 128) * 2 tokens from seed data[1]; sequence 2 holds 20.
  std::mt19937 rng(data[1]);
  for (int t = 0; t < data[0] % 128 * 2; ++t) decode(cache, 0, rng);
  for (int t = 0; t < 20; ++t) decode(cache, 2, rng);
  std::vector<std::uint8_t> state;
  FUZZ_CHECK(cache.save_sequence(0, state).is_ok());
  // Its damage.
  if ((data[2] & 2) != 0) state.resize((data[3] | std::size_t{data[4]} << 8) % state.size());
  for (std::size_t e = 5; e + 5 <= size && !state.empty(); e += 5) {
    const std::uint32_t at =
        data[e] | std::uint32_t{data[e + 1]} << 8 | std::uint32_t{data[e + 2]} << 16 | std::uint32_t{data[e + 3]} << 24;
    state[at % state.size()] ^= data[e + 4];
  }
  if ((data[2] & 1) != 0 && state.size() >= thinkv::kSequenceStateHeaderBytes + 4) {
    state.resize(state.size() - 4);  // reseal: the CRC of what is left, as finish_state writes it
    const std::uint32_t crc = thinkv::crc32(state);
    thinkv::StateWriter(state).put(crc);
  }
  // The load, into empty sequence 1 beside sequence 2.
  std::vector<std::uint8_t> other_before, other_after;
  FUZZ_CHECK(cache.save_sequence(2, other_before).is_ok());
  const std::int64_t allocated = cache.allocated_bytes();
  const thinkv::Status s = cache.load_sequence(1, state);
  FUZZ_CHECK(cache.save_sequence(2, other_after).is_ok());
  FUZZ_CHECK(other_after == other_before);
  if (!s.is_ok()) {
    FUZZ_CHECK(!s.message().empty());
    FUZZ_CHECK(cache.position(1) == 0 && cache.live_tokens(1) == 0);
    FUZZ_CHECK(cache.allocated_bytes() == allocated);
    return 0;
  }
  std::vector<std::uint8_t> again;
  FUZZ_CHECK(cache.save_sequence(1, again).is_ok());
  FUZZ_CHECK(again == state);
  // A loaded state decodes on, or answers a Status (it may hold what this cache cannot grow from).
  std::vector<float> kv(kKvHeads * kHeadDim, 0.5f), q(kQHeads * kHeadDim, 0.25f), out(q.size());
  if (cache.begin_token(1).is_ok()) {
    for (int l = 0; l < kLayers; ++l) {
      if (!cache.append(1, l, kv, kv).is_ok() || !cache.attend(1, l, q, out).is_ok()) break;
    }
    (void)cache.end_token(1);
  }
  return 0;
}
