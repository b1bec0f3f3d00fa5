// copy_sequence (llama.cpp's seq_cp) shares a pinned prompt's full blocks with the copy instead of
// copying them (ThinKvConfig::share_prompt_blocks, CPU backend), and remove() copies a shared
// block before it writes into it (copy on write). Checked differentially: two caches, one sharing
// and one copying whole, run the same random operations (decodes with random K/V/Q, copies, removes
// in and past the prompt, resets, keep_only, states saved and loaded) and must give bit for bit the
// same attention outputs, statuses, positions and held positions, while the sharing one holds less.

#include <catch2/catch.hpp>

#include <cstring>
#include <vector>

#include "../../examples/decoder/thinkv_spec.hpp"
#include "thinkv/thinkv_cache.hpp"

#include "sequence_test_util.hpp"
#include "test_util.hpp"

using thinkv::Status;
using thinkv::StatusCode;
using thinkv::decoder::CacheMode;
using thinkv::decoder::ThinKvSpec;
using thinkv::decoder::with_cache;

namespace {

/// One token of `seq` in both caches: the same random K/V per layer and Q; outputs bit for bit equal.
template <class A, class B>
void decode_both(A& a, B& b, int seq, std::mt19937_64& rng) {
  const auto& c = a.config();
  const int d = c.head_dim, hkv = c.num_kv_heads, hq = c.num_q_heads;
  REQUIRE(a.begin_token(seq).is_ok());
  REQUIRE(b.begin_token(seq).is_ok());
  for (int l = 0; l < c.num_layers; ++l) {
    const std::vector<float> k = tt::random_row(rng, hkv * d), v = tt::random_row(rng, hkv * d);
    const std::vector<float> q = tt::random_row(rng, hq * d);
    std::vector<float> oa(static_cast<std::size_t>(hq * d), NAN), ob(oa.size(), NAN);
    REQUIRE(a.append(seq, l, k, v).is_ok());
    REQUIRE(b.append(seq, l, k, v).is_ok());
    REQUIRE(a.attend(seq, l, q, oa).is_ok());
    REQUIRE(b.attend(seq, l, q, ob).is_ok());
    INFO("sequence " << seq << " layer " << l << " position " << a.position(seq));
    REQUIRE(std::memcmp(oa.data(), ob.data(), oa.size() * sizeof(float)) == 0);
  }
  REQUIRE(a.end_token(seq).is_ok());
  REQUIRE(b.end_token(seq).is_ok());
}

/// Whether a stream of the sequence holds a shared block.
template <class C>
bool holds_shared(const C& cache, int seq) {
  const auto& t = cache.paged().table();
  for (int l = 0; l < cache.config().num_layers; ++l) {
    for (int h = 0; h < cache.config().num_kv_heads; ++h) {
      for (const std::uint32_t b : t.blocks(cache.stream_of(seq, l, h))) {
        if (t.is_shared(b)) return true;
      }
    }
  }
  return false;
}

ThinKvSpec sharing_spec(CacheMode mode, bool share) {
  ThinKvSpec c = tt::sequence_spec(mode);
  c.pinned_prefix = 40;  // 2.5 blocks of 16: two shareable blocks per stream
  c.share_prompt_blocks = share;
  return c;
}

}  // namespace

TEST_CASE("Prompt sharing: copies share the pinned prompt's blocks and every operation gives what whole copies give",
          "[prompt_sharing][sequence_ops]") {
  for (CacheMode mode : {CacheMode::kTbq, CacheMode::kThinKv}) {
    INFO("mode " << thinkv::decoder::to_string(mode));
    auto rng = tt::make_rng("prompt_sharing");
    const ThinKvSpec sa = sharing_spec(mode, true), sb = sharing_spec(mode, false);
    with_cache(sa, [&](auto& a) {
      with_cache(sb, [&](auto& b) {
        const int n = sa.num_sequences, g = sa.group_size;
        std::size_t most_shared = 0;
        int copies = 0, less = 0, saves = 0;
        for (int op = 0; op < 2000; ++op) {
          int seq = tt::uniform_int(rng, 0, n - 1);
          const int what = tt::uniform_int(rng, 0, 99);
          if (what >= 80 && what < 88 && tt::chance(rng, 0.7)) {  // copy the longest sequence
            for (int x = 0; x < n; ++x) seq = a.position(x) > a.position(seq) ? x : seq;
          }
          if (what >= 88 && what < 96 && tt::chance(rng, 0.8)) {  // remove in a sequence that shares
            for (int x = 0; x < n; ++x) seq = holds_shared(a, x) ? x : seq;
          }
          if (what < 80) {
            if (a.position(seq) >= sa.max_tokens - 1) continue;
            decode_both(a, b, seq, rng);
          } else if (what < 88) {
            // seq_cp of the whole sequence or a range starting in the prompt, into an emptied sequence
            const int dst = (seq + tt::uniform_int(rng, 1, n - 1)) % n;
            const std::int32_t p0 = tt::chance(rng, 0.6) ? -1 : g * tt::uniform_int(rng, 0, 6);
            const std::int32_t p1 = tt::chance(rng, 0.8) ? -1 : a.position(seq) - tt::uniform_int(rng, 0, 20);
            INFO("op " << op << ": copy_sequence(" << seq << ", " << dst << ", " << p0 << ", " << p1 << ")");
            REQUIRE(a.reset_sequence(dst).is_ok());
            REQUIRE(b.reset_sequence(dst).is_ok());
            const Status x = a.copy_sequence(seq, dst, p0, p1), y = b.copy_sequence(seq, dst, p0, p1);
            INFO(x << " / " << y);
            REQUIRE(x.code() == y.code());
            copies += x.is_ok() ? 1 : 0;
          } else if (what < 96) {
            // seq_rm, mostly within the prompt (where the shared blocks are)
            const std::int32_t p0 = tt::chance(rng, 0.5) ? tt::uniform_int(rng, 0, 40) : g * tt::uniform_int(rng, 0, 8);
            const std::int32_t p1 = tt::chance(rng, 0.3) ? -1 : p0 + tt::uniform_int(rng, 1, 24);
            INFO("op " << op << ": remove(" << seq << ", " << p0 << ", " << p1 << ") at " << a.position(seq));
            const Status x = a.remove(seq, p0, p1), y = b.remove(seq, p0, p1);
            INFO(x << " / " << y);
            REQUIRE(x.code() == y.code());
          } else if (what < 98) {
            REQUIRE(a.reset_sequence(seq).is_ok());
            REQUIRE(b.reset_sequence(seq).is_ok());
          } else if (what < 99) {
            REQUIRE(a.keep_only(seq).is_ok());
            REQUIRE(b.keep_only(seq).is_ok());
          } else {
            // a state saved and loaded into another sequence (llama_state_seq_get/set_data)
            const int dst = (seq + tt::uniform_int(rng, 1, n - 1)) % n;
            std::vector<std::uint8_t> x, y;
            REQUIRE(a.save_sequence(seq, x).is_ok());
            REQUIRE(b.save_sequence(seq, y).is_ok());
            REQUIRE(x.size() == y.size());
            REQUIRE(a.reset_sequence(dst).is_ok());
            REQUIRE(b.reset_sequence(dst).is_ok());
            REQUIRE(a.load_sequence(dst, x).is_ok());
            REQUIRE(b.load_sequence(dst, y).is_ok());
            ++saves;
          }
          most_shared = std::max(most_shared, a.paged().table().shared_blocks());
          for (int s = 0; s < n; ++s) {
            REQUIRE(a.position(s) == b.position(s));
            REQUIRE(a.pos_min(s) == b.pos_min(s));
            REQUIRE(tt::held_positions(a, s) == tt::held_positions(b, s));
          }
          {  // the table's record counts: each stream owns the records it counts
            const auto& t = a.paged().table();
            std::vector<std::int64_t> owned(static_cast<std::size_t>(t.num_streams()), 0);
            for (int r = 0; r < t.record_capacity(); ++r) {
              const std::int32_t o = t.record_owner(static_cast<std::uint32_t>(r));
              if (o >= 0) ++owned[static_cast<std::size_t>(o)];
            }
            for (int st = 0; st < t.num_streams(); ++st) {
              INFO("op " << op << " (" << what << "): stream " << st);
              REQUIRE(owned[static_cast<std::size_t>(st)] == t.records_held(st));
            }
          }
          const std::int64_t ha = a.memory().physical_bytes(), hb = b.memory().physical_bytes();
          INFO("op " << op << " (" << what << "): sharing " << tt::describe(a.memory()) << ", whole "
                     << tt::describe(b.memory()));
          REQUIRE(ha <= hb);
          less += ha < hb ? 1 : 0;
          REQUIRE(a.memory().physical_bytes() <= a.paged().allocated_bytes());
        }
        {  // at the end, a fresh sequence past its pinned prompt copied whole, so that sharing at
           // scale is checked for every seed (the random walk sometimes shares fewer blocks at once)
          const int src = 0, dst = 1;
          REQUIRE(a.reset_sequence(src).is_ok());
          REQUIRE(b.reset_sequence(src).is_ok());
          for (int t = 0; t < sa.pinned_prefix + g; ++t) decode_both(a, b, src, rng);
          REQUIRE(a.reset_sequence(dst).is_ok());
          REQUIRE(b.reset_sequence(dst).is_ok());
          REQUIRE(a.copy_sequence(src, dst, -1, -1).is_ok());
          REQUIRE(b.copy_sequence(src, dst, -1, -1).is_ok());
          REQUIRE(tt::held_positions(a, dst) == tt::held_positions(b, dst));
          most_shared = std::max(most_shared, a.paged().table().shared_blocks());
        }
        const std::int64_t cows = a.paged().table().stats().blocks_copied_on_write;
        INFO("copies " << copies << ", copies on write " << cows << ", most shared " << most_shared
                       << ", ops with less " << less << ", saves " << saves);
        CHECK(copies >= 20);
        CHECK(most_shared >= 8);
        CHECK(cows >= 8);
        CHECK(b.paged().table().stats().blocks_copied_on_write == 0);
        CHECK(b.paged().table().stats().blocks_shared == 0);
        CHECK(less >= 100);
      });
    });
  }
}

TEST_CASE("Prompt sharing: a copy holds only what differs, and the source's end leaves the copy whole",
          "[prompt_sharing]") {
  const ThinKvSpec sa = sharing_spec(CacheMode::kTbq, true), sb = sharing_spec(CacheMode::kTbq, false);
  auto rng = tt::make_rng("prompt_sharing_memory");
  with_cache(sa, [&](auto& a) {
    with_cache(sb, [&](auto& b) {
      for (int t = 0; t < 60; ++t) decode_both(a, b, 0, rng);
      const std::int64_t before = a.memory().physical_bytes();
      REQUIRE(a.copy_sequence(0, 1).is_ok());
      REQUIRE(b.copy_sequence(0, 1).is_ok());
      // Two full blocks of the 40-token prompt per stream (positions 0..31) are shared.
      const int streams = sa.num_layers * sa.num_kv_heads;
      CHECK(a.paged().table().shared_blocks() == static_cast<std::size_t>(2 * streams));
      CHECK(a.memory(1).blocks_shared == 2 * streams);
      CHECK(a.memory(0).blocks_shared == 0);
      const std::int64_t page = a.paged().layout().page_bytes(thinkv::Precision::kNvfp4) +
                                a.paged().layout().block_meta_bytes() + thinkv::CacheLayout::kBlockTableEntryBytes;
      const std::int64_t records = 2 * (sa.block_size / sa.group_size) * a.paged().layout().record_bytes();
      CHECK(b.memory().physical_bytes() - a.memory().physical_bytes() == streams * (2 * page + records));
      CHECK(a.memory().physical_bytes() > before);
      // The source ends: the copy owns the shared blocks and decodes on exactly as a whole copy.
      REQUIRE(a.reset_sequence(0).is_ok());
      REQUIRE(b.reset_sequence(0).is_ok());
      CHECK(a.paged().table().shared_blocks() == 0);
      CHECK(a.memory(1).blocks_shared == 0);
      CHECK(a.memory().physical_bytes() == b.memory().physical_bytes());
      for (int t = 0; t < 40; ++t) decode_both(a, b, 1, rng);
    });
  });
}

TEST_CASE("Prompt sharing: a remove that must copy a shared block the pool cannot hold fails and changes nothing",
          "[prompt_sharing][errors]") {
  ThinKvSpec s = sharing_spec(CacheMode::kTbq, true);
  s.chunk_blocks = 1;
  auto rng = tt::make_rng("prompt_sharing_full");
  // The limit: what sequence 0 and its copy hold after 48 tokens, plus a little (no room for a copied block).
  std::int64_t limit = 0;
  with_cache(s, [&](auto& probe) {
    ThinKvSpec sb = s;
    with_cache(sb, [&](auto& twin) {
      for (int t = 0; t < 48; ++t) decode_both(probe, twin, 0, rng);
    });
    REQUIRE(probe.copy_sequence(0, 1).is_ok());
    limit = probe.paged().allocated_bytes() + 16;
  });
  s.memory_limit_bytes = limit;
  rng = tt::make_rng("prompt_sharing_full");
  with_cache(s, [&](auto& a) {
    with_cache(s, [&](auto& b) {
      for (int t = 0; t < 48; ++t) decode_both(a, b, 0, rng);
    });
    REQUIRE(a.copy_sequence(0, 1).is_ok());
    REQUIRE(a.paged().table().shared_blocks() > 0);
    const auto before = tt::snapshot_cache(a.paged());
    const Status e = a.remove(1, 0, 8);  // in the first (shared) block of every stream
    INFO(e);
    CHECK(e.code() == StatusCode::kPoolExhausted);
    CHECK_THAT(e.message(), Catch::Matchers::Contains("shared"));
    TT_REQUIRE_SAME_SNAPSHOT(before, tt::snapshot_cache(a.paged()));
    CHECK(a.position(1) == 48);
    // Where the range lies past the shared blocks nothing is copied, and the remove goes through.
    REQUIRE(a.remove(1, 32, 40).is_ok());
    CHECK(a.pos_min(1) == 0);
  });
}
