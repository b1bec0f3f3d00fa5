// llama.cpp-style sequence operations on BasicThinKvCache (remove = seq_rm with roll-back,
// keep_only = seq_keep, copy_sequence = seq_cp, shift_positions = seq_add, pos_min / pos_max, save_sequence /
// load_sequence = llama_state_seq_get_data / set_data), checked against an independent model of llama.cpp's cells
// written from its documented behaviour: a sequence is a set of positions, each with the K/V it was decoded with;
// seq_rm(p0, p1) drops the positions in [p0, p1) (p0 < 0: from 0, p1 < 0: to the end); the next token of a sequence is
// at pos_max + 1; seq_keep drops every other sequence; seq_cp(src, dst, p0, p1) gives dst src's cells in [p0, p1);
// seq_add(p0, p1, d) moves the cells in [p0, p1) by d (their keys turned by the test's own RoPE). On top of that model,
// ThinKV's two documented refusals (kUnsupported): removing staged tokens while a later one stays, and rolling back to
// a position that is not a multiple of group_size behind the open quantization group (a copy's range is cut by the same
// rules), and copies only into an empty sequence (kInvalidArgument: a stream holds one history).

#include <catch2/catch.hpp>

#include <cmath>
#include <map>
#include <random>
#include <set>
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

/// One cell of the model: a position's K/V per layer ([num_kv_heads * head_dim] each).
struct Cell {
  std::vector<std::vector<float>> k, v;
};

/// llama.cpp's cells of one sequence, as documented (llama.h, llama-kv-cells.h).
struct SeqModel {
  std::map<std::int32_t, Cell> cells;
  [[nodiscard]] std::int32_t pos_max() const { return cells.empty() ? -1 : cells.rbegin()->first; }
  [[nodiscard]] std::int32_t pos_min() const { return cells.empty() ? -1 : cells.begin()->first; }
  [[nodiscard]] std::int32_t next() const { return pos_max() + 1; }
  void seq_rm(std::int32_t p0, std::int32_t p1) {
    if (p0 < 0) p0 = 0;
    for (auto it = cells.begin(); it != cells.end();) {
      const bool in = it->first >= p0 && (p1 < 0 || it->first < p1);
      it = in ? cells.erase(it) : std::next(it);
    }
  }
  /// seq_add(p0, p1, delta): the cells in [p0, p1) move by delta; with `rope`, their keys (as
  /// BF16 stores them) turn through delta positions and are rounded to BF16 once, as ThinKV's
  /// shift stores them (`head_dim` channels per head).
  void seq_add(std::int32_t p0, std::int32_t p1, std::int32_t delta, const thinkv::RopeSpec* rope, int head_dim) {
    if (p0 < 0) p0 = 0;
    std::map<std::int32_t, Cell> out;
    for (auto& [pos, cell] : cells) {
      const bool in = pos >= p0 && (p1 < 0 || pos < p1);
      if (in && rope != nullptr) {
        for (auto& k : cell.k) {
          for (std::size_t h = 0; h * head_dim < k.size(); ++h) {
            std::vector<double> x(static_cast<std::size_t>(head_dim));
            for (int j = 0; j < head_dim; ++j) x[static_cast<std::size_t>(j)] = tt::bf16_round(k[h * head_dim + j]);
            const std::vector<double> y = tt::rope64(x, delta, *rope);
            for (int j = 0; j < head_dim; ++j) k[h * head_dim + j] = tt::bf16_nearest(y[static_cast<std::size_t>(j)]);
          }
        }
      }
      out[in ? pos + delta : pos] = std::move(cell);
    }
    cells = std::move(out);
  }
};

/// What ThinKV refuses, from the model alone: `g` the group size. The open group holds the
/// positions [g * floor(next / g), next) (groups are aligned; every roll back ThinKV accepts keeps
/// them so).
bool refused(const SeqModel& m, std::int32_t p0, std::int32_t p1, int g) {
  const std::int32_t P = m.next();
  const std::int32_t lo = std::max<std::int32_t>(p0, 0);
  const std::int32_t end = p1 < 0 ? P : std::min(p1, P);
  if (lo >= end) return false;
  const std::int32_t G = P / g * g;
  const bool tail = end >= P;
  if (!tail) return end > G;  // a staged position removed, a later one kept
  SeqModel after = m;
  after.seq_rm(p0, p1);
  const std::int32_t next = after.next();
  return next < G && next % g != 0;
}

/// What ThinKV answers shift_positions(p0, p1, delta), from the model alone (kOk: done, or nothing
/// to do): `quantized` when committed groups are in quantized pages (everything below the open
/// group, which holds [g * floor(next / g), next)). In the header's order: delta not a multiple
/// of g, a quantized token moved, the open group split, a position moved below 0 (kUnsupported);
/// the order of positions broken (kInvalidArgument); past max_tokens (kOutOfRange).
StatusCode shift_outcome(const SeqModel& m, std::int32_t p0, std::int32_t p1, std::int32_t delta, int g, bool quantized,
                         int max_tokens) {
  const std::int32_t P = m.next();
  const std::int32_t lo = std::max<std::int32_t>(p0, 0), hi = p1 < 0 ? P : std::min(p1, P);
  if (delta == 0 || lo >= hi) return StatusCode::kOk;
  std::vector<std::int32_t> in;
  std::int32_t below = -1, above = -1;
  for (const auto& [pos, x] : m.cells) {
    if (pos >= lo && pos < hi) in.push_back(pos);
    if (pos < lo) below = pos;
    if (pos >= hi && above < 0) above = pos;
  }
  if (in.empty()) return StatusCode::kOk;
  if (delta % g != 0) return StatusCode::kUnsupported;
  const std::int32_t G = P / g * g;
  if (quantized && in.front() < G) return StatusCode::kUnsupported;
  const auto staged = std::count_if(m.cells.begin(), m.cells.end(), [&](const auto& c) { return c.first >= G; });
  const auto staged_in = std::count_if(in.begin(), in.end(), [&](std::int32_t p) { return p >= G; });
  if (staged_in != 0 && staged_in != staged) return StatusCode::kUnsupported;
  if (in.front() + delta < 0) return StatusCode::kUnsupported;
  if (below >= 0 && in.front() + delta <= below) return StatusCode::kInvalidArgument;
  if (above >= 0 && in.back() + delta >= above) return StatusCode::kInvalidArgument;
  if (in.back() == P - 1 && P + delta > max_tokens) return StatusCode::kOutOfRange;
  return StatusCode::kOk;
}

/// A random seq_add: half of them a context shift's second half (the range after a removed
/// block, to the end, moved down by the block's size), the others any range and delta, mostly
/// multiples of g.
struct ShiftCall {
  std::int32_t p0, p1, delta;
  std::int32_t cut = -1;  ///< >= 0: remove(cut, p0) first (a context shift)
};
ShiftCall random_shift(std::mt19937_64& rng, const SeqModel& m, int g) {
  const std::int32_t P = m.next();
  if (tt::uniform_int(rng, 0, 1) == 0 && P > 1) {
    const std::int32_t a = tt::uniform_int(rng, 0, P - 1), n = g * tt::uniform_int(rng, 1, 4);
    return {a + n, -1, -n, a};
  }
  const std::int32_t p0 = tt::uniform_int(rng, -2, P);
  const std::int32_t p1 = tt::uniform_int(rng, 0, 1) == 0 ? -1 : p0 + tt::uniform_int(rng, 0, 3 * g);
  const std::int32_t delta = tt::chance(rng, 0.8) ? g * tt::uniform_int(rng, -4, 4) : tt::uniform_int(rng, -20, 20);
  return {p0, p1, delta};
}

/// Every segment's size must be the most tokens of it any stream holds (pages and staging),
/// counted from the block table.
template <class Cache>
void check_segment_sizes(const Cache& cache, int seq) {
  const auto& t = cache.paged().table();
  const auto& c = cache.config();
  std::map<std::uint32_t, std::int32_t> most;
  for (int l = 0; l < c.num_layers; ++l) {
    for (int h = 0; h < c.num_kv_heads; ++h) {
      const int st = cache.stream_of(seq, l, h);
      std::map<std::uint32_t, std::int32_t> here;
      for (const thinkv::SlotRef r : t.live_slot_list(st)) ++here[t.slot_segment(r)];
      for (int row = 0; row < t.staged_count(st); ++row) ++here[t.staged_segment(st, row)];
      for (const auto& [id, n] : here) most[id] = std::max(most[id], n);
    }
  }
  for (const auto& seg : cache.segments(seq)) {
    INFO("segment " << seg.id << " starting at " << seg.start);
    REQUIRE(seg.size == (most.count(seg.id) != 0 ? most[seg.id] : 0));
  }
}

/// Decodes one token of `seq` at the model's next position with fresh random K/V and queries.
/// With `check_attention`, every layer's output is compared with float64 attention over the
/// model's cells (BF16-rounded, as BF16 pages store them) and the new token.
template <class Cache>
void decode_one(Cache& cache, int seq, SeqModel& m, std::mt19937_64& rng, bool check_attention) {
  const auto& c = cache.config();
  const int d = c.head_dim, hkv = c.num_kv_heads, hq = c.num_q_heads;
  const double scale = c.softmax_scale > 0 ? c.softmax_scale : 1.0 / std::sqrt(static_cast<double>(d));
  REQUIRE(cache.position(seq) == m.next());
  const Status b = cache.begin_token(seq);
  INFO(b);
  REQUIRE(b.is_ok());
  Cell cell;
  for (int l = 0; l < c.num_layers; ++l) {
    std::vector<float> k = tt::random_row(rng, hkv * d), v = tt::random_row(rng, hkv * d);
    std::vector<float> q = tt::random_row(rng, hq * d), out(static_cast<std::size_t>(hq * d), NAN);
    REQUIRE(cache.append(seq, l, k, v).is_ok());
    REQUIRE(cache.attend(seq, l, q, out).is_ok());
    cell.k.push_back(k);
    cell.v.push_back(v);
    if (!check_attention) continue;
    for (int h = 0; h < hq; ++h) {
      const int kvh = h / (hq / hkv);
      std::vector<float> ks, vs;
      auto add = [&](const Cell& x) {
        for (int j = 0; j < d; ++j) {
          ks.push_back(tt::bf16_round(x.k[static_cast<std::size_t>(l)][static_cast<std::size_t>(kvh * d + j)]));
          vs.push_back(tt::bf16_round(x.v[static_cast<std::size_t>(l)][static_cast<std::size_t>(kvh * d + j)]));
        }
      };
      for (const auto& [pos, x] : m.cells) add(x);
      add(cell);
      const std::vector<double> ref = tt::attend64(q.data() + h * d, ks, vs, d, scale);
      const double bound = tt::attention_error_bound(q.data() + h * d, ks, vs, d, scale);
      for (int j = 0; j < d; ++j) {
        INFO("seq " << seq << " position " << m.next() << " layer " << l << " head " << h << " channel " << j);
        REQUIRE(std::fabs(out[static_cast<std::size_t>(h * d + j)] - ref[static_cast<std::size_t>(j)]) <= bound);
      }
    }
  }
  REQUIRE(cache.end_token(seq).is_ok());
  m.cells[m.next()] = std::move(cell);
}

/// A random seq_rm range: tails (speculative decoding's roll back, most often aligned or within
/// the open group), middles (a context shift's discard), whole sequences, empty and odd ranges.
std::pair<std::int32_t, std::int32_t> random_range(std::mt19937_64& rng, const SeqModel& m, int g) {
  const std::int32_t P = m.next();
  switch (tt::uniform_int(rng, 0, 6)) {
    case 0: return {std::max(0, P - tt::uniform_int(rng, 1, 2 * g)), -1};            // short tail
    case 1: return {std::max(0, (P - tt::uniform_int(rng, 0, 5 * g)) / g * g), -1};  // aligned tail
    case 2: {                                                                        // middle
      const std::int32_t a = tt::uniform_int(rng, 0, std::max(0, P - 1));
      return {a, a + tt::uniform_int(rng, 1, 3 * g)};
    }
    case 3: return {tt::uniform_int(rng, -3, 2), tt::uniform_int(rng, 1, std::max(1, P / 2))};  // the front
    case 4: return {-1, -1};                                                                    // everything
    case 5: return {P + tt::uniform_int(rng, 0, 5), -1};                                        // past the end
    default: {
      const std::int32_t a = tt::uniform_int(rng, 0, P + 2);
      return {a, a - tt::uniform_int(rng, 0, 2)};  // empty (p1 <= p0)
    }
  }
}

/// llama.cpp's seq_cp(src, dst, p0, p1) into an empty dst, in the model: dst gets src's cells
/// in [p0, p1).
SeqModel copied(const SeqModel& src, std::int32_t p0, std::int32_t p1) {
  SeqModel d = src;
  d.seq_rm(p1 < 0 ? INT32_MAX : p1, -1);
  d.seq_rm(-1, std::max<std::int32_t>(p0, 0));
  return d;
}

/// Whether ThinKV refuses copy_sequence(src, dst, p0, p1) (dst empty): the copy is cut as
/// remove(dst, 0, p0) then remove(dst, p1, -1) would cut it, with remove's refusals.
bool copy_refused(const SeqModel& src, std::int32_t p0, std::int32_t p1, int g) {
  const std::int32_t lo = std::max<std::int32_t>(p0, 0), hi = p1 < 0 ? src.next() : std::min(p1, src.next());
  if (src.cells.empty() || lo >= hi) return false;
  if (lo > 0 && refused(src, 0, lo, g)) return true;
  SeqModel m = src;
  m.seq_rm(0, lo);
  return hi < m.next() && refused(m, hi, -1, g);
}

/// A random seq_cp range: mostly the whole sequence (parallel sequences after a prompt).
std::pair<std::int32_t, std::int32_t> random_copy_range(std::mt19937_64& rng, const SeqModel& m, int g) {
  if (tt::uniform_int(rng, 0, 1) == 0) return {-1, -1};
  const std::int32_t P = m.next();
  const std::int32_t a = tt::uniform_int(rng, -1, std::max(0, P - 1));
  switch (tt::uniform_int(rng, 0, 2)) {
    case 0: return {a, -1};
    case 1: return {a, std::max(0, a + tt::uniform_int(rng, 0, 4 * g)) / g * g};
    default: return {a, a + tt::uniform_int(rng, 0, 4 * g)};
  }
}

}  // namespace

TEST_CASE("Sequence ops: remove / keep_only / pos_min / pos_max follow llama.cpp's cells exactly without eviction",
          "[sequence_ops]") {
  // FullKV (BF16 pages): positions and attention against the model; TBQ (quantized pages, no
  // eviction): positions against the model.
  for (CacheMode mode : {CacheMode::kFull, CacheMode::kTbq}) {
    INFO("mode " << thinkv::decoder::to_string(mode));
    auto rng = tt::make_rng("sequence_ops_cells");
    const ThinKvSpec cfg = tt::sequence_spec(mode);
    with_cache(cfg, [&](auto& cache) {
      const int g = cfg.group_size;
      std::vector<SeqModel> model(static_cast<std::size_t>(cfg.num_sequences));
      const std::int64_t empty_bytes = cache.allocated_bytes();
      const std::int64_t empty_held = cache.memory().physical_bytes();  // staging and stream headers
      int removes = 0, refusals = 0, rollbacks = 0, keeps = 0, copies = 0, copy_refusals = 0, loads = 0;
      int shifts = 0, shift_refusals = 0;
      thinkv::RopeSpec rope;
      rope.style = thinkv::RopeStyle::kHalves;
      for (int op = 0; op < 1500; ++op) {
        const int seq = tt::uniform_int(rng, 0, cfg.num_sequences - 1);
        SeqModel& m = model[static_cast<std::size_t>(seq)];
        const int what = tt::uniform_int(rng, 0, 99);
        if (what < 70) {
          decode_one(cache, seq, m, rng, mode == CacheMode::kFull && op % 3 == 0);
        } else if (what < 79) {
          // llama.cpp's seq_add (a context shift, or any range): keys re-rotated, or refused as
          // the model predicts with nothing changed.
          ShiftCall c = random_shift(rng, m, g);
          INFO("op " << op << ": shift_positions(" << seq << ", " << c.p0 << ", " << c.p1 << ", " << c.delta
                     << ") after remove(" << c.cut << ", " << c.p0 << ") at next " << m.next());
          if (c.cut >= 0) {
            if (refused(m, c.cut, c.p0, g)) {
              REQUIRE(cache.remove(seq, c.cut, c.p0).code() == StatusCode::kUnsupported);
              continue;
            }
            REQUIRE(cache.remove(seq, c.cut, c.p0).is_ok());
            m.seq_rm(c.cut, c.p0);
          }
          const StatusCode want = shift_outcome(m, c.p0, c.p1, c.delta, g, mode == CacheMode::kTbq, cfg.max_tokens);
          const auto before = tt::snapshot_cache(cache.paged());
          const Status s = cache.shift_positions(seq, c.p0, c.p1, c.delta, rope);
          INFO(s);
          REQUIRE(s.code() == want);
          if (want == StatusCode::kOk) {
            m.seq_add(c.p0, c.p1, c.delta, &rope, cfg.head_dim);
            shifts += m.cells.empty() ? 0 : 1;
          } else {
            TT_REQUIRE_SAME_SNAPSHOT(before, tt::snapshot_cache(cache.paged()));
            ++shift_refusals;
          }
        } else if (what < 93) {
          const auto [p0, p1] = random_range(rng, m, g);
          INFO("op " << op << ": remove(" << seq << ", " << p0 << ", " << p1 << ") at next " << m.next());
          const bool refuse = refused(m, p0, p1, g);
          const auto before = tt::snapshot_cache(cache.paged());
          const std::int32_t pos_before = cache.position(seq);
          const Status s = cache.remove(seq, p0, p1);
          INFO(s);
          if (refuse) {
            REQUIRE(s.code() == StatusCode::kUnsupported);
            TT_REQUIRE_SAME_SNAPSHOT(before, tt::snapshot_cache(cache.paged()));
            REQUIRE(cache.position(seq) == pos_before);
            ++refusals;
          } else {
            REQUIRE(s.is_ok());
            const std::int32_t next_before = m.next();
            m.seq_rm(p0, p1);
            ++removes;
            rollbacks += m.next() < next_before ? 1 : 0;
          }
        } else if (what < 95) {
          // llama_state_seq_get_data / set_data: the state loads into a cleared sequence (another
          // one or the same) as a copy of every cell; a damaged state changes nothing.
          const int dst = tt::uniform_int(rng, 0, cfg.num_sequences - 1);
          SeqModel& md = model[static_cast<std::size_t>(dst)];
          INFO("op " << op << ": save_sequence(" << seq << ") then load_sequence(" << dst << ") at next " << m.next());
          std::vector<std::uint8_t> state;
          REQUIRE(cache.save_sequence(seq, state).is_ok());
          const SeqModel saved = m;
          REQUIRE(cache.reset_sequence(dst).is_ok());
          md.cells.clear();
          std::vector<std::uint8_t> bad = state;
          // a bit from the body size on (a version or flags bit is kUnsupported: test_sequence_state)
          bad[static_cast<std::size_t>(tt::uniform_int(rng, 16, static_cast<int>(bad.size()) - 1))] ^=
              static_cast<std::uint8_t>(1u << tt::uniform_int(rng, 0, 7));
          const auto before = tt::snapshot_cache(cache.paged());
          const Status sb = cache.load_sequence(dst, bad);
          INFO(sb);
          REQUIRE(sb.code() == StatusCode::kCorruptData);
          TT_REQUIRE_SAME_SNAPSHOT(before, tt::snapshot_cache(cache.paged()));
          const Status sl = cache.load_sequence(dst, state);
          INFO(sl);
          REQUIRE(sl.is_ok());
          md = saved;
          ++loads;
        } else if (what < 99) {
          const int dst = (seq + tt::uniform_int(rng, 1, cfg.num_sequences - 1)) % cfg.num_sequences;
          SeqModel& md = model[static_cast<std::size_t>(dst)];
          if (tt::uniform_int(rng, 0, 2) != 0) {  // llama.cpp's callers clear the target first
            REQUIRE(cache.reset_sequence(dst).is_ok());
            md.cells.clear();
          }
          const auto [p0, p1] = random_copy_range(rng, m, g);
          INFO("op " << op << ": copy_sequence(" << seq << ", " << dst << ", " << p0 << ", " << p1 << ") at next "
                     << m.next());
          const auto before = tt::snapshot_cache(cache.paged());
          const Status s = cache.copy_sequence(seq, dst, p0, p1);
          INFO(s);
          if (!md.cells.empty()) {
            REQUIRE(s.code() == StatusCode::kInvalidArgument);  // ThinKV does not merge histories
            TT_REQUIRE_SAME_SNAPSHOT(before, tt::snapshot_cache(cache.paged()));
            ++copy_refusals;
          } else if (copy_refused(m, p0, p1, g)) {
            REQUIRE(s.code() == StatusCode::kUnsupported);
            TT_REQUIRE_SAME_SNAPSHOT(before, tt::snapshot_cache(cache.paged()));
            ++copy_refusals;
          } else {
            REQUIRE(s.is_ok());
            md = copied(m, p0, p1);
            ++copies;
          }
        } else {
          INFO("op " << op << ": keep_only(" << seq << ")");
          REQUIRE(cache.keep_only(seq).is_ok());
          for (int o = 0; o < cfg.num_sequences; ++o) {
            if (o != seq) model[static_cast<std::size_t>(o)].cells.clear();
          }
          ++keeps;
        }
        // Every sequence against its model, after every operation.
        for (int s = 0; s < cfg.num_sequences; ++s) {
          const SeqModel& ms = model[static_cast<std::size_t>(s)];
          INFO("op " << op << " sequence " << s);
          REQUIRE(cache.pos_max(s) == ms.pos_max());
          REQUIRE(cache.pos_min(s) == ms.pos_min());
          REQUIRE(cache.position(s) == ms.next());
          std::set<std::int32_t> want;
          for (const auto& [pos, x] : ms.cells) want.insert(pos);
          for (const auto& held : tt::held_positions(cache, s)) REQUIRE(held == want);
          REQUIRE(cache.live_tokens(s) == static_cast<std::int64_t>(want.size()));
          std::int64_t in_segments = 0;
          for (const auto& seg : cache.segments(s)) in_segments += seg.size;
          REQUIRE(in_segments == static_cast<std::int64_t>(want.size()));
          check_segment_sizes(cache, s);
          tt::check_segment_ranges(cache, s);
        }
      }
      INFO("removes " << removes << ", refusals " << refusals << ", roll backs " << rollbacks << ", keeps " << keeps
                      << ", copies " << copies << ", copies refused " << copy_refusals << ", loads " << loads
                      << ", shifts " << shifts << ", shifts refused " << shift_refusals);
      CHECK(removes > 100);
      CHECK(shifts > (mode == CacheMode::kFull ? 30 : 3));
      CHECK(shift_refusals > 20);
      CHECK(loads > 10);
      CHECK(copies > 20);
      CHECK(copy_refusals > 5);
      CHECK(refusals > 10);
      CHECK(rollbacks > 50);
      CHECK(keeps > 3);
      CHECK(cache.stats().tokens_removed > 0);
      // Everything removed: the memory is what an empty cache holds.
      for (int s = 0; s < cfg.num_sequences; ++s) REQUIRE(cache.remove(s, -1, -1).is_ok());
      for (thinkv::Precision p : thinkv::kAllPrecisions) CHECK(cache.paged().table().allocated_blocks(p) == 0);
      CHECK(cache.memory().physical_bytes() == empty_held);
      if (mode == CacheMode::kFull) CHECK(cache.allocated_bytes() == empty_bytes);  // no key-scale records
    });
  }
}

TEST_CASE("Sequence ops: with TBE every stream holds a subset of llama.cpp's cells and the budget holds",
          "[sequence_ops]") {
  for (CacheMode mode : {CacheMode::kTbe, CacheMode::kThinKv}) {
    INFO("mode " << thinkv::decoder::to_string(mode));
    auto rng = tt::make_rng("sequence_ops_tbe");
    const ThinKvSpec cfg = tt::sequence_spec(mode);
    with_cache(cfg, [&](auto& cache) {
      const int g = cfg.group_size;
      std::vector<SeqModel> model(static_cast<std::size_t>(cfg.num_sequences));
      const std::int64_t empty_held = cache.memory().physical_bytes();  // staging and stream headers
      int removes = 0, copies = 0, loads = 0, shifts = 0;
      for (int op = 0; op < 2500; ++op) {
        const int seq = tt::uniform_int(rng, 0, cfg.num_sequences - 1);
        SeqModel& m = model[static_cast<std::size_t>(seq)];
        const int what = tt::uniform_int(rng, 0, 99);
        const bool decoded = what < 83;
        if (what >= 83 && what < 88) {
          // seq_add: done (BF16 pages: TBE) or refused with nothing changed (quantized pages, the
          // open group split, the order broken); the held positions move with the model's cells.
          const ShiftCall c = random_shift(rng, m, g);
          INFO("op " << op << ": shift_positions(" << seq << ", " << c.p0 << ", " << c.p1 << ", " << c.delta << ")");
          const auto before = tt::snapshot_cache(cache.paged());
          std::set<std::int32_t> held_any;  // before the shift
          for (const auto& held : tt::held_positions(cache, seq)) held_any.insert(held.begin(), held.end());
          const Status s = cache.shift_positions(seq, c.p0, c.p1, c.delta, thinkv::RopeSpec{});
          INFO(s);
          REQUIRE((s.is_ok() || s.code() == StatusCode::kUnsupported || s.code() == StatusCode::kInvalidArgument));
          if (!s.is_ok()) {
            TT_REQUIRE_SAME_SNAPSHOT(before, tt::snapshot_cache(cache.paged()));
            continue;
          }
          // The model keeps the cells some stream held (ThinKV keeps the order of those only),
          // then moves the same range.
          std::erase_if(m.cells, [&](const auto& cell) { return held_any.count(cell.first) == 0; });
          m.seq_add(c.p0, c.p1, c.delta, nullptr, cfg.head_dim);
          ++shifts;
          REQUIRE(cache.position(seq) == (m.cells.empty() ? 0 : m.next()));
          REQUIRE(cache.pos_max(seq) == m.pos_max());
          check_segment_sizes(cache, seq);
          tt::check_segment_ranges(cache, seq);
          continue;
        }
        if (what >= 95 && what < 97) {
          // A saved state loads into a cleared sequence (another one or the same) holding, stream
          // by stream, exactly what the saved sequence held.
          const int dst = tt::uniform_int(rng, 0, cfg.num_sequences - 1);
          INFO("op " << op << ": save_sequence(" << seq << ") then load_sequence(" << dst << ")");
          std::vector<std::uint8_t> state;
          REQUIRE(cache.save_sequence(seq, state).is_ok());
          const std::vector<std::set<std::int32_t>> src_held = tt::held_positions(cache, seq);
          const SeqModel saved = m;
          const std::vector<thinkv::SegmentState> saved_segments = cache.segments(seq);
          REQUIRE(cache.reset_sequence(dst).is_ok());
          model[static_cast<std::size_t>(dst)].cells.clear();
          const Status s = cache.load_sequence(dst, state);
          INFO(s);
          REQUIRE(s.is_ok());
          model[static_cast<std::size_t>(dst)] = saved;
          REQUIRE(tt::held_positions(cache, dst) == src_held);
          REQUIRE(cache.segments(dst) == saved_segments);
          REQUIRE(cache.pos_max(dst) == saved.pos_max());
          check_segment_sizes(cache, dst);
          ++loads;
          continue;
        }
        if (what >= 97) {
          // seq_cp into a cleared sequence: the copy holds what the source holds of the range.
          const int dst = (seq + tt::uniform_int(rng, 1, cfg.num_sequences - 1)) % cfg.num_sequences;
          REQUIRE(cache.reset_sequence(dst).is_ok());
          SeqModel& md = model[static_cast<std::size_t>(dst)];
          md.cells.clear();
          const auto [p0, p1] = random_copy_range(rng, m, g);
          INFO("op " << op << ": copy_sequence(" << seq << ", " << dst << ", " << p0 << ", " << p1 << ")");
          const std::vector<std::set<std::int32_t>> src_held = tt::held_positions(cache, seq);
          const Status s = cache.copy_sequence(seq, dst, p0, p1);
          INFO(s);
          REQUIRE((s.is_ok() || s.code() == StatusCode::kUnsupported));
          if (!s.is_ok()) {
            REQUIRE(cache.position(dst) == 0);
            continue;
          }
          ++copies;
          md = copied(m, p0, p1);
          md.seq_rm(cache.position(dst), -1);  // as after a remove: it continues after its last held
          const std::int32_t lo = std::max<std::int32_t>(p0, 0), hi = p1 < 0 ? INT32_MAX : p1;
          const std::vector<std::set<std::int32_t>> dst_held = tt::held_positions(cache, dst);
          for (std::size_t k = 0; k < src_held.size(); ++k) {
            std::set<std::int32_t> want;
            for (std::int32_t p : src_held[k]) {
              if (p >= lo && p < hi && p < cache.position(dst)) want.insert(p);
            }
            REQUIRE(dst_held[k] == want);  // stream by stream, what the source held of the range
          }
          REQUIRE(cache.pos_max(dst) == md.pos_max());
          check_segment_sizes(cache, dst);
          continue;
        }
        if (decoded) {
          const std::int64_t unreachable = cache.stats().budget_unreachable;
          decode_one(cache, seq, m, rng, false);
          // The budget holds after every token unless the plan said it cannot.
          REQUIRE((cache.live_tokens(seq) <= cfg.token_budget + cfg.segment_len ||
                   cache.stats().budget_unreachable > unreachable));
        } else {
          const auto [p0, p1] = random_range(rng, m, g);
          INFO("op " << op << ": remove(" << seq << ", " << p0 << ", " << p1 << ")");
          const Status s = cache.remove(seq, p0, p1);
          INFO(s);
          REQUIRE((s.is_ok() || s.code() == StatusCode::kUnsupported));
          if (!s.is_ok()) continue;
          m.seq_rm(p0, p1);
          ++removes;
          // ThinKV may have evicted the last cells of a removed range's left: it continues after
          // its own last live position, which the model must then forget above.
          const std::int32_t next = cache.position(seq);
          REQUIRE(next <= m.next());
          m.seq_rm(next, -1);
        }
        INFO("op " << op << " sequence " << seq);
        std::set<std::int32_t> all;
        for (const auto& [pos, x] : m.cells) all.insert(pos);
        std::set<std::int32_t> any;
        for (const auto& held : tt::held_positions(cache, seq)) {
          for (std::int32_t p : held) REQUIRE(all.count(p) == 1);  // nothing removed comes back
          any.insert(held.begin(), held.end());
          if (decoded) REQUIRE(held.count(m.pos_max()) == 1);  // a new token is in every stream
        }
        if (!m.cells.empty()) REQUIRE(any.count(m.pos_max()) == 1);  // and the last one in some
        REQUIRE(cache.pos_max(seq) == m.pos_max());
        REQUIRE(cache.pos_min(seq) == (any.empty() ? -1 : *any.begin()));
        check_segment_sizes(cache, seq);
        tt::check_segment_ranges(cache, seq);
      }
      CHECK(removes > 100);
      CHECK(copies > 20);
      if (mode == CacheMode::kTbe) CHECK(shifts > 20);
      CHECK(loads > 20);
      CHECK(cache.stats().tokens_evicted > 0);
      for (int s = 0; s < cfg.num_sequences; ++s) REQUIRE(cache.remove(s, 0, -1).is_ok());
      // Every block chunk released (key-scale record chunks are kept once grown: block_table.hpp).
      for (thinkv::Precision p : thinkv::kAllPrecisions) CHECK(cache.paged().table().allocated_blocks(p) == 0);
      CHECK(cache.memory().physical_bytes() == empty_held);
    });
  }
}

TEST_CASE("Sequence ops: context shifts of long sequences follow llama.cpp's cells, keys re-rotated",
          "[sequence_ops][position_shift]") {
  // A runtime with a context window: decode until the window is full, then llama.cpp's context
  // shift (seq_rm(keep, keep + n), seq_add(keep + n, -1, -n)), among random shifts of any range.
  // FullKV: every outcome as the model predicts, attention exact over the model's rotated keys;
  // TBE (BF16 pages, evicting): positions a subset of the model's. Segments keep their ranges.
  for (CacheMode mode : {CacheMode::kFull, CacheMode::kTbe}) {
    INFO("mode " << thinkv::decoder::to_string(mode));
    auto rng = tt::make_rng("sequence_ops_context_shift");
    const ThinKvSpec cfg = tt::sequence_spec(mode);
    with_cache(cfg, [&](auto& cache) {
      const int g = cfg.group_size;
      thinkv::RopeSpec rope;
      rope.theta = 1000.0;
      SeqModel m;
      int context_shifts = 0, shifts = 0, refusals = 0;
      for (int op = 0; op < 2000; ++op) {
        const bool full_window = m.next() >= 200;
        if (!full_window && tt::uniform_int(rng, 0, 19) != 0) {
          decode_one(cache, 0, m, rng, mode == CacheMode::kFull && op % 4 == 0);
        } else {
          ShiftCall c = random_shift(rng, m, g);
          c.cut = -1;  // any range and delta
          if (full_window) c = {0, -1, 0, tt::uniform_int(rng, 0, 40)};
          if (full_window) {
            const std::int32_t n = g * tt::uniform_int(rng, 4, 12);
            c.p0 = c.cut + n;
            c.delta = -n;
          }
          INFO("op " << op << ": shift_positions(0, " << c.p0 << ", " << c.p1 << ", " << c.delta << ") after remove("
                     << c.cut << ", " << c.p0 << ") at next " << m.next());
          if (c.cut >= 0) {
            const Status r = cache.remove(0, c.cut, c.p0);
            REQUIRE(r.code() == (refused(m, c.cut, c.p0, g) ? StatusCode::kUnsupported : StatusCode::kOk));
            if (!r.is_ok()) continue;
            m.seq_rm(c.cut, c.p0);
            if (mode == CacheMode::kTbe) m.seq_rm(cache.position(0), -1);  // continues after its last held
          }
          std::set<std::int32_t> held_any;
          for (const auto& held : tt::held_positions(cache, 0)) held_any.insert(held.begin(), held.end());
          const auto before = tt::snapshot_cache(cache.paged());
          const Status s = cache.shift_positions(0, c.p0, c.p1, c.delta, rope);
          INFO(s);
          if (mode == CacheMode::kFull) {
            REQUIRE(s.code() == shift_outcome(m, c.p0, c.p1, c.delta, g, false, cfg.max_tokens));
          } else {
            REQUIRE((s.is_ok() || s.code() == StatusCode::kUnsupported || s.code() == StatusCode::kInvalidArgument));
            std::erase_if(m.cells, [&](const auto& cell) { return held_any.count(cell.first) == 0; });
          }
          if (!s.is_ok()) {
            TT_REQUIRE_SAME_SNAPSHOT(before, tt::snapshot_cache(cache.paged()));
            ++refusals;
            continue;
          }
          m.seq_add(c.p0, c.p1, c.delta, &rope, cfg.head_dim);
          ++shifts;
          context_shifts += full_window ? 1 : 0;
        }
        INFO("op " << op);
        REQUIRE(cache.position(0) == m.next());
        REQUIRE(cache.pos_max(0) == m.pos_max());
        std::set<std::int32_t> any;
        for (const auto& held : tt::held_positions(cache, 0)) {
          std::set<std::int32_t> want;
          for (const auto& [pos, x] : m.cells) want.insert(pos);
          if (mode == CacheMode::kFull) REQUIRE(held == want);
          for (std::int32_t p : held) REQUIRE(want.count(p) == 1);
          any.insert(held.begin(), held.end());
        }
        REQUIRE(cache.pos_min(0) == (any.empty() ? -1 : *any.begin()));
        check_segment_sizes(cache, 0);
        tt::check_segment_ranges(cache, 0);
      }
      INFO("context shifts " << context_shifts << ", shifts " << shifts << ", refused " << refusals);
      CHECK(context_shifts > 20);
      CHECK(shifts > 40);
      CHECK(refusals > 10);
    });
  }
}

TEST_CASE("Sequence ops: roll backs within the open group and to group boundaries are exact, and holes refill in place",
          "[sequence_ops]") {
  // Speculative decoding's pattern: decode, roll back to an accepted prefix, decode on. Every
  // token decoded after a roll back attends to exactly the model's cells (FullKV: BF16 pages).
  const ThinKvSpec cfg = tt::sequence_spec(CacheMode::kFull);
  with_cache(cfg, [&](auto& cache) {
    auto rng = tt::make_rng("sequence_ops_replay");
    const auto& table = cache.paged().table();
    const int streams = cfg.num_layers * cfg.num_kv_heads;
    SeqModel m;
    for (int t = 0; t < 77; ++t) decode_one(cache, 0, m, rng, false);
    // The accepted prefix ends inside the open group (72..76 staged): roll back 3 tokens.
    REQUIRE(cache.remove(0, 74, -1).is_ok());
    m.seq_rm(74, -1);
    REQUIRE(cache.position(0) == 74);
    REQUIRE(table.staged_count(cache.stream_of(0, 0, 0)) == 2);
    // Behind the open group and not aligned: refused, naming the position to use.
    const Status r = cache.remove(0, 70, -1);
    INFO(r);
    REQUIRE(r.code() == StatusCode::kUnsupported);
    REQUIRE(r.message().find("remove(0, 64, -1)") != std::string::npos);
    // Aligned: accepted; the block of 64..71 had nothing else and went back to its pool.
    REQUIRE(cache.remove(0, 64, -1).is_ok());
    m.seq_rm(64, -1);
    REQUIRE(cache.position(0) == 64);
    REQUIRE(table.staged_count(cache.stream_of(0, 0, 0)) == 0);
    REQUIRE(cache.segments(0).size() == 2);
    REQUIRE(!cache.segments(0).back().closed);
    REQUIRE(table.blocks(cache.stream_of(0, 1, 1)).size() == 4);
    // A middle range leaves holes, which the next group's commit fills in place.
    REQUIRE(cache.remove(0, 8, 16).is_ok());
    m.seq_rm(8, 16);
    CHECK(cache.stats().tokens_removed == (77 - 64 + 8) * streams);
    for (int t = 64; t < 96; ++t) decode_one(cache, 0, m, rng, true);
    CHECK(table.stats().slots_reused == 8 * streams);
    CHECK(table.blocks(cache.stream_of(0, 1, 1)).size() == 6);  // 88 tokens in blocks of 16
    CHECK(cache.paged().moved_bytes() == 0);
  });
}

TEST_CASE("Sequence ops: a roll back continues after the last position any stream holds, before p0 if need be",
          "[sequence_ops]") {
  // TBE keeping each segment's last tokens: a shrunk segment holds only its end. Removing from
  // inside a segment before its survivors leaves nothing of it below p0, so the sequence continues
  // after the previous segment's last survivor, earlier than p0 (llama.cpp: pos_max + 1).
  ThinKvSpec cfg = tt::sequence_spec(CacheMode::kTbe);
  cfg.selection = thinkv::SegmentSelection::kLast;
  cfg.classifier = thinkv::ThoughtClassifier{};  // every token R: only the budget evicts
  with_cache(cfg, [&](auto& cache) {
    auto rng = tt::make_rng("sequence_ops_rollback_before_p0");
    SeqModel m;
    for (int t = 0; t < 260; ++t) decode_one(cache, 0, m, rng, false);
    const auto segs = cache.segments(0);
    std::size_t i = 0;
    while (i + 2 < segs.size() && !(segs[i].size == 4 && segs[i + 1].size == 4)) ++i;
    REQUIRE(i + 2 < segs.size());
    const std::int32_t start = segs[i + 1].start;  // its survivors: start + 28 .. start + 31
    for (const auto& held : tt::held_positions(cache, 0)) {
      REQUIRE(held.count(start + 28) == 1);
      REQUIRE(held.count(start + 8) == 0);
      REQUIRE(held.count(start - 1) == 1);  // the segment before ends with its survivors
    }
    REQUIRE(cache.remove(0, start + 8, -1).is_ok());
    CHECK(cache.position(0) == start);
    CHECK(cache.pos_max(0) == start - 1);
    CHECK(cache.segments(0).size() == i + 1);
    CHECK(!cache.segments(0).back().closed);
    check_segment_sizes(cache, 0);
  });
}

TEST_CASE("Sequence ops: seq_cp of a range the source holds nothing of copies nothing, whatever precedes it",
          "[sequence_ops]") {
  // Found by the randomized run: a copy of [9, 21) from a sequence whose 9..20 were removed was
  // refused, because the tail cut was checked with the tokens before 9 still there (the copy
  // continues at 9, inside the committed group 8..15); the copy loses those tokens with the
  // front cut, so it is simply empty, as llama.cpp's seq_cp copies no cell.
  with_cache(tt::sequence_spec(CacheMode::kFull), [&](auto& cache) {
    auto rng = tt::make_rng("sequence_ops_copy_empty_range");
    SeqModel m;
    for (int t = 0; t < 34; ++t) decode_one(cache, 2, m, rng, false);
    REQUIRE(cache.remove(2, 9, 21).is_ok());
    const auto before = tt::snapshot_cache(cache.paged());
    REQUIRE(cache.copy_sequence(2, 1, 9, 21).is_ok());
    CHECK(cache.position(1) == 0);
    CHECK(cache.live_tokens(1) == 0);
    TT_REQUIRE_SAME_SNAPSHOT(before, tt::snapshot_cache(cache.paged()));
    // A range holding position 8 would continue at 9 inside that group: refused, as before.
    const Status e = cache.copy_sequence(2, 1, 8, 21);
    CHECK(e.code() == StatusCode::kUnsupported);
    CHECK(e.message().find("continue at position 9") != std::string::npos);
    TT_REQUIRE_SAME_SNAPSHOT(before, tt::snapshot_cache(cache.paged()));
    // One that ends at a group boundary is copied.
    REQUIRE(cache.copy_sequence(2, 1, 0, 8).is_ok());
    CHECK(cache.pos_min(1) == 0);
    CHECK(cache.pos_max(1) == 7);
  });
}

TEST_CASE("Sequence ops: bad calls are refused and change nothing", "[sequence_ops]") {
  const ThinKvSpec cfg = tt::sequence_spec(CacheMode::kTbq);
  with_cache(cfg, [&](auto& cache) {
    auto rng = tt::make_rng("sequence_ops_errors");
    SeqModel m0, m1;
    for (int t = 0; t < 50; ++t) decode_one(cache, 0, m0, rng, false);
    for (int t = 0; t < 20; ++t) decode_one(cache, 1, m1, rng, false);
    const auto before = tt::snapshot_cache(cache.paged());
    auto unchanged = [&] {
      TT_REQUIRE_SAME_SNAPSHOT(before, tt::snapshot_cache(cache.paged()));
      REQUIRE(cache.position(0) == 50);
      REQUIRE(cache.position(1) == 20);
    };
    Status s = cache.remove(3, 0, -1);
    CHECK(s.code() == StatusCode::kOutOfRange);
    CHECK(s.message().find("sequence 3") != std::string::npos);
    unchanged();
    CHECK(cache.keep_only(-1).code() == StatusCode::kOutOfRange);
    unchanged();
    // The open group (48, 49) with a later token kept.
    s = cache.remove(0, 42, -1);  // 42 is behind the open group and not a multiple of 8
    CHECK(s.code() == StatusCode::kUnsupported);
    CHECK(s.message().find("remove(0, 40, -1)") != std::string::npos);
    unchanged();
    s = cache.remove(0, 48, 49);
    CHECK(s.code() == StatusCode::kUnsupported);
    CHECK(s.message().find("open quantization group") != std::string::npos);
    unchanged();
    // An open token: nothing may change under it.
    REQUIRE(cache.begin_token(1).is_ok());
    s = cache.remove(1, 0, 8);
    CHECK(s.code() == StatusCode::kInvalidArgument);
    CHECK(s.message().find("open token") != std::string::npos);
    s = cache.keep_only(0);
    CHECK(s.code() == StatusCode::kInvalidArgument);
    CHECK(s.message().find("sequence 1") != std::string::npos);
    REQUIRE(cache.position(1) == 20);
    CHECK(cache.pos_max(1) == 19);
    // A middle range in pages is fine; the empty range and a range past the end do nothing.
    REQUIRE(cache.remove(0, 50, 60).is_ok());
    REQUIRE(cache.remove(0, 30, 30).is_ok());
    REQUIRE(cache.remove(0, 20, 10).is_ok());
    CHECK(cache.stats().tokens_removed == 0);
    REQUIRE(cache.remove(0, 8, 16).is_ok());
    CHECK(cache.stats().tokens_removed == 8 * cfg.num_layers * cfg.num_kv_heads);
    CHECK(cache.pos_min(0) == 0);
    REQUIRE(cache.remove(0, -5, 8).is_ok());
    CHECK(cache.pos_min(0) == 16);
    CHECK(cache.pos_max(0) == 49);
  });
}
