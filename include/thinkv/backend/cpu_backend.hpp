#pragma once
/// \file cpu_backend.hpp
/// The CPU backend: host-memory pages laid out exactly as CacheLayout says, quantized with the
/// reference encoders of thinkv/formats. It is the ground truth device backends are tested against.
///
/// Page layout of one block at precision P (B = block_size, D = head_dim, g = group_size):
///   [B x row_bytes(P)] key rows | [B x row_bytes(P)] value rows | [B x D/g] value scales (E4M3)
/// Key scales live in key-scale records: record r holds D E4M3 scales, one per channel, for the
/// g tokens of one committed group; every slot names its record (BlockTable::slot_record).
///
/// Storage follows the block table: a pool's pages come in chunks (BlockTable::chunk_blocks), each
/// one allocation of the backend's allocator, made and freed as the cache grows and shrinks the
/// pool (resize_pool); records likewise (resize_records). No page ever moves. The allocator is
/// a template parameter (any standard allocator of bytes, stateful ones included), so a runtime
/// can put the pages in its own memory and a test can count every byte.

#include <algorithm>
#include <limits>
#include <cmath>
#include <memory>
#include <type_traits>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "thinkv/backend/batch.hpp"
#include "thinkv/backend/kv_backend.hpp"
#include "thinkv/formats.hpp"
#include "thinkv/kv_values.hpp"
#include "thinkv/paged/storage_view.hpp"
#include "thinkv/paged/layout.hpp"
#include "thinkv/reference/attention.hpp"
#include "thinkv/tbe/kmeans.hpp"

namespace thinkv {

template <class Alloc = std::allocator<std::uint8_t>>
class BasicCpuKvBackend {
  template <class T>
  using Vec = std::vector<T, typename std::allocator_traits<Alloc>::template rebind_alloc<T>>;

 public:
  /// Reads blocks by id and with their owner's second-level scales: a block may be shared.
  static constexpr bool kSharesPages = true;
  BasicCpuKvBackend() requires std::is_default_constructible_v<Alloc> : BasicCpuKvBackend(Alloc{}) {}
  explicit BasicCpuKvBackend(const Alloc& alloc) : alloc_(alloc), staging_(alloc_), s2_(alloc_) {}

  [[nodiscard]] std::string_view name() const { return "cpu"; }

  [[nodiscard]] Status init(const StorageConfig& config) {
    THINKV_RETURN_IF_ERROR(config.validate());
    config_ = config;
    layout_ = CacheLayout::from(config);
    pools_ = PoolMap::from(config);
    stats_ = {};
    faulted_.assign(static_cast<std::size_t>(config.num_streams), 0);
    faults_.clear();
    for (Precision p : kAllPrecisions) {
      const int i = static_cast<int>(p);
      chunks_[i] = std::vector<Vec<std::uint8_t>>{};
      pool_pages_[i] = 0;
      chunk_pages_[i] = config.pool_chunk(p);
    }
    record_chunks_.clear();
    records_ = 0;
    record_cap_ = static_cast<std::uint32_t>(effective_record_capacity(config));
    record_chunk_ = config.record_chunk(record_cap_);
    staging_ = Vec<std::uint16_t>(
        static_cast<std::size_t>(config.num_streams) * 2 * config.group_size * config.head_dim, 0, alloc_);
    s2_ = Vec<float>(static_cast<std::size_t>(config.num_streams) * 2 * kNumPrecisions, 0.0f, alloc_);
    stats_.bytes_allocated = static_cast<std::int64_t>(staging_.size() * 2 + s2_.size() * 4);
    return Status::ok();
  }

  [[nodiscard]] Status resize_pool(Precision p, std::uint32_t blocks) {
    const int i = static_cast<int>(p);
    if (blocks > pools_.count[i]) {
      return {StatusCode::kOutOfRange, "resize_pool(" + std::string(to_string(p)) + ", " + std::to_string(blocks) +
                                           "): the pool's range holds " + std::to_string(pools_.count[i]) + " blocks"};
    }
    THINKV_RETURN_IF_ERROR(resize_chunks(chunks_[i], blocks, chunk_pages_[i], pools_.count[i],
                                         static_cast<std::size_t>(layout_.page_bytes(p)),
                                         "the " + std::string(to_string(p)) + " pool's pages"));
    pool_pages_[i] = blocks;
    return Status::ok();
  }

  [[nodiscard]] Status resize_records(std::uint32_t records) {
    if (records > record_cap_) {
      return {StatusCode::kOutOfRange,
              "resize_records(" + std::to_string(records) + "): the record range holds " + std::to_string(record_cap_)};
    }
    THINKV_RETURN_IF_ERROR(resize_chunks(record_chunks_, records, record_chunk_, record_cap_,
                                         static_cast<std::size_t>(config_.head_dim), "key-scale records"));
    records_ = records;
    return Status::ok();
  }

  [[nodiscard]] Status stage(int stream, int row, const float* k, const float* v) {
    std::uint16_t* dst = staging_row(stream, row, 0);
    std::uint16_t* dv = staging_row(stream, row, 1);
    for (int c = 0; c < config_.head_dim; ++c) {
      dst[c] = encode_bf16(k[c]);
      dv[c] = encode_bf16(v[c]);
    }
    return Status::ok();
  }

  [[nodiscard]] Status read_staged(int stream, int row, float* k, float* v) const {
    const std::uint16_t* sk = staging_row(stream, row, 0);
    const std::uint16_t* sv = staging_row(stream, row, 1);
    for (int c = 0; c < config_.head_dim; ++c) {
      k[c] = decode_bf16(sk[c]);
      v[c] = decode_bf16(sv[c]);
    }
    return Status::ok();
  }

  [[nodiscard]] Status commit(const CommitPlan& plan) {
    const int g = config_.group_size;
    const int d = config_.head_dim;
    const Precision p = plan.precision;
    if (static_cast<int>(plan.slots.size()) != g) {
      return {StatusCode::kInternal, "commit plan has " + std::to_string(plan.slots.size()) +
                                         " slots, expected group_size " + std::to_string(g)};
    }
    if (p == Precision::kBf16) {
      for (int i = 0; i < g; ++i) {
        for (int kv = 0; kv < 2; ++kv) {
          const std::uint16_t* src = staging_row(plan.stream, i, kv);
          std::uint8_t* dst = row_ptr(plan.slots[static_cast<std::size_t>(i)], kv);
          for (int c = 0; c < d; ++c) {
            dst[2 * c] = static_cast<std::uint8_t>(src[c] & 0xFF);
            dst[2 * c + 1] = static_cast<std::uint8_t>(src[c] >> 8);
          }
          stats_.page_bytes_written += 2 * d;
        }
      }
      ++stats_.groups_quantized;
      return Status::ok();
    }
    // Decode the staged group (g x d) of K and V to FP32.
    std::vector<float> kf(static_cast<std::size_t>(g) * d), vf(kf.size());
    for (int i = 0; i < g; ++i) {
      THINKV_RETURN_IF_ERROR(read_staged(plan.stream, i, kf.data() + i * d, vf.data() + i * d));
    }
    float& s2k = s2_ref(plan.stream, 0, p);
    float& s2v = s2_ref(plan.stream, 1, p);
    // Second-level scales are fixed by the stream's first nonzero group of this precision. An
    // all-zero group quantizes to zero codes and scales whatever s2 is, so it fixes nothing.
    const float amax_k = group_amax(kf.data(), 1, g * d);
    const float amax_v = group_amax(vf.data(), 1, g * d);
    if (s2k == 0.0f && amax_k > 0.0f) s2k = choose_stream_scale(p, amax_k);
    if (s2v == 0.0f && amax_v > 0.0f) s2v = choose_stream_scale(p, amax_v);
    const float s2k_use = s2k > 0.0f ? s2k : 1.0f;
    const float s2v_use = s2v > 0.0f ? s2v : 1.0f;
    std::vector<std::uint8_t> codes(kf.size());
    // Keys: per channel, a group = the g tokens of one channel.
    std::uint8_t* rec = record_ptr(plan.record);
    for (int c = 0; c < d; ++c) {
      if (group_scale_saturates(p, group_amax(kf.data() + c, d, g), s2k_use)) ++stats_.scale_saturations;
      rec[c] = quantize_group(p, kf.data() + c, d, g, s2k_use, codes.data() + c, d);
    }
    stats_.page_bytes_written += d;  // the record's key scales
    const int row_bytes = layout_.row_bytes(p);
    for (int i = 0; i < g; ++i) {
      std::uint8_t* dst = row_ptr(plan.slots[static_cast<std::size_t>(i)], 0);
      for (int c = 0; c < d; ++c) store_code(p, dst, c, codes[static_cast<std::size_t>(i * d + c)]);
      stats_.page_bytes_written += row_bytes;
    }
    // Values: per token, a group = g consecutive channels of one token.
    for (int i = 0; i < g; ++i) {
      const SlotRef s = plan.slots[static_cast<std::size_t>(i)];
      std::uint8_t* vs = value_scales_ptr(s);
      std::uint8_t* dst = row_ptr(s, 1);
      for (int j = 0; j < d / g; ++j) {
        const float* x = vf.data() + i * d + j * g;
        if (group_scale_saturates(p, group_amax(x, 1, g), s2v_use)) ++stats_.scale_saturations;
        vs[j] = quantize_group(p, x, 1, g, s2v_use, codes.data() + j * g, 1);
      }
      for (int c = 0; c < d; ++c) store_code(p, dst, c, codes[static_cast<std::size_t>(c)]);
      stats_.page_bytes_written += row_bytes + layout_.value_scale_bytes(p);
    }
    ++stats_.groups_quantized;
    return Status::ok();
  }

  [[nodiscard]] Status reset_stream(int stream) {
    for (int kv = 0; kv < 2; ++kv) {
      for (Precision p : kAllPrecisions) s2_ref(stream, kv, p) = 0.0f;
    }
    if (static_cast<std::size_t>(stream) < faulted_.size()) faulted_[static_cast<std::size_t>(stream)] = 0;
    return Status::ok();
  }

  // ---- batched calls (thinkv/backend/batch.hpp), host tensors, synchronous -------------------

  /// Stages each row from host tensors k and v ([rows, head_dim] of their element type): a row
  /// holding a value that is not finite or exceeds kMaxKvMagnitude is staged as zeros and
  /// raises its fault (reported by the next poll_faults).
  [[nodiscard]] Status stage_batch(std::span<const StageRow> rows, TensorRef k, TensorRef v) {
    const int d = config_.head_dim;
    if (k.data == nullptr || v.data == nullptr) return {StatusCode::kInvalidArgument, "stage_batch: null k or v"};
    faulted_.resize(static_cast<std::size_t>(config_.num_streams), 0);
    std::vector<float> kf(static_cast<std::size_t>(d)), vf(kf.size());
    for (const StageRow& r : rows) {
      bool bad = false;
      for (int c = 0; c < d; ++c) {
        const std::size_t i = static_cast<std::size_t>(r.src) * d + c;
        kf[static_cast<std::size_t>(c)] = load_element(k.data, k.type, i);
        vf[static_cast<std::size_t>(c)] = load_element(v.data, v.type, i);
        bad = bad || !(std::fabs(kf[static_cast<std::size_t>(c)]) <= kMaxKvMagnitude) ||
              !(std::fabs(vf[static_cast<std::size_t>(c)]) <= kMaxKvMagnitude);
      }
      if (bad) {
        std::fill(kf.begin(), kf.end(), 0.0f);
        std::fill(vf.begin(), vf.end(), 0.0f);
        if (r.fault >= 0 && r.fault < config_.num_streams && faulted_[static_cast<std::size_t>(r.fault)] == 0) {
          faulted_[static_cast<std::size_t>(r.fault)] = 1;
          faults_.push_back({r.fault, r.tag});
        }
      }
      THINKV_RETURN_IF_ERROR(stage(r.stream, r.row, kf.data(), vf.data()));
    }
    return Status::ok();
  }
  /// Commits each plan in order.
  [[nodiscard]] Status commit_batch(std::span<const CommitPlan> plans) {
    for (const CommitPlan& p : plans) THINKV_RETURN_IF_ERROR(commit(p));
    return Status::ok();
  }
  /// Takes a decode step's plan (kept until the step ends: its spans stay valid until then).
  [[nodiscard]] Status prepare_step(const StepView& step) {
    if (step.num_layers < 1 || step.num_kv_heads < 1 ||
        step.layer_commits.size() != static_cast<std::size_t>(step.num_layers) + 1 ||
        step.sparsity_slot.size() != static_cast<std::size_t>(step.num_layers)) {
      return {StatusCode::kInvalidArgument, "prepare_step: the step's layer tables do not match its layer count"};
    }
    step_ = step;
    return Status::ok();
  }
  /// Layer `layer` of the step: stage_batch of each sequence's rows, then commit_batch of the
  /// layer's commits.
  [[nodiscard]] Status append_step(int layer, TensorRef k, TensorRef v) {
    THINKV_RETURN_IF_ERROR(check_step_layer(layer, "append_step"));
    const int hkv = step_.num_kv_heads;
    step_rows_.clear();
    for (std::size_t b = 0; b < step_.seqs.size(); ++b) {
      const StepSequence& q = step_.seqs[b];
      for (int h = 0; h < hkv; ++h) {
        step_rows_.push_back(StageRow{q.first_stream + layer * hkv + h, q.row, static_cast<std::int32_t>(b) * hkv + h,
                                      q.first_stream, q.tag});
      }
    }
    THINKV_RETURN_IF_ERROR(stage_batch(step_rows_, k, v));
    const auto l = static_cast<std::size_t>(layer);
    return commit_batch(
        step_.commits.subspan(step_.layer_commits[l], step_.layer_commits[l + 1] - step_.layer_commits[l]));
  }
  /// Attention of layer `layer` for each sequence of the step in turn, with the sparsity of the
  /// sequences that ask when the layer computes it (the others' rows NaN).
  [[nodiscard]] Status attend_step(int layer, TensorRef q, MutableTensorRef out) const {
    THINKV_RETURN_IF_ERROR(check_step_layer(layer, "attend_step"));
    if (q.data == nullptr || out.data == nullptr) return {StatusCode::kInvalidArgument, "attend_step: null q or out"};
    const int hkv = step_.num_kv_heads, hq = step_.num_q_heads;
    const auto batch = step_.seqs.size();
    const int slot = step_.sparsity_slot[static_cast<std::size_t>(layer)];
    std::vector<std::int32_t> streams(static_cast<std::size_t>(hkv));
    std::vector<StreamView> views;
    const std::size_t rows = static_cast<std::size_t>(hq) * config_.head_dim;
    std::vector<float> qf(rows), of(rows);
    for (std::size_t b = 0; b < batch; ++b) {
      const StepSequence& s = step_.seqs[b];
      for (int h = 0; h < hkv; ++h) streams[static_cast<std::size_t>(h)] = s.first_stream + layer * hkv + h;
      for (std::size_t i = 0; i < rows; ++i) qf[i] = load_element(q.data, q.type, b * rows + i);
      float* sp = nullptr;
      if (slot >= 0 && step_.sparsity != nullptr) {
        sp = step_.sparsity + (static_cast<std::size_t>(slot) * batch + b) * static_cast<std::size_t>(hq);
        if (s.sparsity == 0) {
          std::fill_n(sp, hq, std::numeric_limits<float>::quiet_NaN());
          sp = nullptr;
        }
      }
      DecodeAttentionArgs args;
      args.num_q_heads = hq;
      args.num_kv_heads = hkv;
      args.kv_streams = streams.data();
      args.q = qf.data();
      args.out = of.data();
      args.softmax_scale = step_.softmax_scale;
      args.sparsity = sp;
      THINKV_RETURN_IF_ERROR(attend(step_.table.attend_view(streams, views), args));
      for (std::size_t i = 0; i < rows; ++i) store_element(out.data, out.type, b * rows + i, of[i]);
    }
    return Status::ok();
  }
  /// The step's sparsity is in place as soon as attend_step returns.
  [[nodiscard]] Status wait_sparsity() { return Status::ok(); }
  /// A prompt's causal self-attention (PromptAttendArgs) over host tensors: attend_after with
  /// nothing stored (each query row over its prefix of the prompt).
  [[nodiscard]] Status attend_prompt(const PromptAttendArgs& a) const {
    THINKV_RETURN_IF_ERROR(check_prompt_attend(a));
    std::vector<float> k, v;
    for (int h = 0; h < a.num_kv_heads; ++h) {
      k.clear();
      v.clear();
      attend_after(a, h, k, v);
    }
    return Status::ok();
  }
  /// A prompt chunk's attention (batch.hpp, chunk_attending_backend) over host tensors: for each
  /// KV head, the stream's stored tokens (gather: attention order), then the chunk (attend_after).
  [[nodiscard]] Status attend_chunk(const AttendView& view, const PromptAttendArgs& a) const {
    THINKV_RETURN_IF_ERROR(check_prompt_attend(a));
    if (a.head_dim != config_.head_dim || view.streams.size() != static_cast<std::size_t>(a.num_kv_heads)) {
      return {StatusCode::kShapeMismatch, "attend_chunk: head_dim " + std::to_string(a.head_dim) + " and " +
                                              std::to_string(view.streams.size()) + " view streams for " +
                                              std::to_string(a.num_kv_heads) + " KV heads (the cache's head_dim is " +
                                              std::to_string(config_.head_dim) + ")"};
    }
    std::vector<float> k, v;
    for (int h = 0; h < a.num_kv_heads; ++h) {
      THINKV_RETURN_IF_ERROR(gather(view, view.streams[static_cast<std::size_t>(h)], k, v));
      attend_after(a, h, k, v);
    }
    return Status::ok();
  }
  /// The faults raised since the last poll (all of them: the calls are synchronous).
  [[nodiscard]] Status poll_faults(std::vector<BackendFault>& out, bool /*wait*/) {
    out.insert(out.end(), faults_.begin(), faults_.end());
    faults_.clear();
    return Status::ok();
  }
  [[nodiscard]] Status synchronize() { return Status::ok(); }
  /// TBE's selections on the host (batch.hpp, segment_selecting_backend): each segment's tokens
  /// found through `table`, their keys dequantized (read_token), kmeans_select. Nothing to mark:
  /// this backend reads the table's metadata itself.
  [[nodiscard]] Status select_segments(const TableView& table, std::span<const SegmentSelect> jobs, int max_iterations,
                                       std::vector<SlotRef>& victims, std::vector<std::uint32_t>& offsets) const {
    victims.clear();
    offsets.assign(1, 0);
    const int d = config_.head_dim;
    std::vector<TokenRef> tokens;
    std::vector<float> keys, v(static_cast<std::size_t>(d));
    for (const SegmentSelect& j : jobs) {
      table.segment_tokens(j.stream, j.segment, tokens);
      if (static_cast<std::int32_t>(tokens.size()) != j.count) {
        return {StatusCode::kInternal, "select_segments: segment " + std::to_string(j.segment) + " of stream " +
                                           std::to_string(j.stream) + " holds " + std::to_string(tokens.size()) +
                                           " live tokens, the cache expected " + std::to_string(j.count)};
      }
      keys.resize(tokens.size() * static_cast<std::size_t>(d));
      for (std::size_t i = 0; i < tokens.size(); ++i) {
        THINKV_RETURN_IF_ERROR(read_token(tokens[i], keys.data() + i * d, v.data()));
      }
      const std::vector<int> kept =
          kmeans_select(keys.data(), static_cast<int>(tokens.size()), d, j.keep, KmeansOptions{max_iterations, j.seed});
      std::size_t ki = 0;
      for (std::size_t i = 0; i < tokens.size(); ++i) {
        if (ki < kept.size() && kept[ki] == static_cast<int>(i)) {
          ++ki;
        } else {
          victims.push_back(tokens[i].slot);
        }
      }
      offsets.push_back(static_cast<std::uint32_t>(victims.size()));
    }
    return Status::ok();
  }

  [[nodiscard]] Status check_step_layer(int layer, const char* call) const {
    if (step_.seqs.empty() || layer < 0 || layer >= step_.num_layers) {
      return {StatusCode::kInvalidArgument, std::string(call) + ": layer " + std::to_string(layer) +
                                                " of no prepared step (prepare_step first; layers 0.." +
                                                std::to_string(step_.num_layers - 1) + ")"};
    }
    return Status::ok();
  }

  [[nodiscard]] Status read_token(const TokenRef& token, float* k, float* v) const {
    const SlotRef slot = token.slot;
    if (slot.block >= pools_.total || slot.slot >= static_cast<std::uint32_t>(config_.block_size)) {
      return {StatusCode::kOutOfRange,
              "slot {block " + std::to_string(slot.block) + ", slot " + std::to_string(slot.slot) + "} does not exist"};
    }
    if (!has_storage(slot.block)) {
      return {StatusCode::kInvalidArgument,
              "slot {block " + std::to_string(slot.block) + ", slot " + std::to_string(slot.slot) + "} has no storage"};
    }
    const int d = config_.head_dim;
    const Precision p = pools_.precision_of(slot.block);
    const std::uint8_t* kr = row_ptr(slot, 0);
    const std::uint8_t* vr = row_ptr(slot, 1);
    if (p == Precision::kBf16) {
      dequantize_token(p, kr, vr, nullptr, nullptr, 0.0f, 0.0f, d, config_.group_size, k, v);
      return Status::ok();
    }
    const std::int32_t owner = token.stream;
    const std::uint32_t r = token.record;
    if (owner < 0 || owner >= config_.num_streams || r == kNoRecord) {
      return {StatusCode::kInvalidArgument,
              "slot {block " + std::to_string(slot.block) + ", slot " + std::to_string(slot.slot) + "} holds no token"};
    }
    // 0 (unset) only when every group so far was all zero: their codes decode to 0 for any s2.
    if (r >= records_) { return {StatusCode::kInvalidArgument, "record " + std::to_string(r) + " has no storage"}; }
    dequantize_token(p, kr, vr, value_scales_ptr(slot), record_ptr(r), s2_[s2_index(owner, 0, p)],
                     s2_[s2_index(owner, 1, p)], d, config_.group_size, k, v);
    return Status::ok();
  }

  /// One stored token from its raw bytes: K and V rows at precision p, the slot's D/g value-scale
  /// codes and its record's D key-scale codes (both unused for kBf16), the stream's second-level
  /// scales. The expression of dequantize(): element * (decode_e4m3(scale) * s2), via lookup
  /// tables (bit-identical; tests compare against dequantize()). Device backends call it on bytes
  /// they copied back, so every backend reads tokens exactly as this one does.
  static void dequantize_token(Precision p, const std::uint8_t* kr, const std::uint8_t* vr,
                               const std::uint8_t* value_scales, const std::uint8_t* key_scales, float s2k, float s2v,
                               int d, int g, float* k, float* v) {
    if (p == Precision::kBf16) {
      for (int c = 0; c < d; ++c) {
        k[c] = decode_bf16(static_cast<std::uint16_t>(kr[2 * c] | (kr[2 * c + 1] << 8)));
        v[c] = decode_bf16(static_cast<std::uint16_t>(vr[2 * c] | (vr[2 * c + 1] << 8)));
      }
      return;
    }
    const auto& lut = tables();
    auto element = [&](const std::uint8_t* row, int c) -> float {
      switch (p) {
        case Precision::kFp8E4M3: return lut.e4m3[row[c]];
        case Precision::kNvfp4: return lut.e2m1[(row[c >> 1] >> ((c & 1) * 4)) & 0xF];
        default: return lut.ternary[(row[c >> 2] >> ((c & 3) * 2)) & 0x3];
      }
    };
    for (int c = 0; c < d; ++c) k[c] = element(kr, c) * (lut.e4m3[key_scales[c]] * s2k);
    for (int j = 0; j < d / g; ++j) {
      const float scale = lut.e4m3[value_scales[j]] * s2v;
      for (int c = j * g; c < (j + 1) * g; ++c) v[c] = element(vr, c) * scale;
    }
  }

  /// Reference decode attention: dequantizes each KV head's live slots (block-list order, then
  /// slot order) and staged tokens once, and attends all the query heads that share it in FP32.
  [[nodiscard]] Status attend(const AttendView& view, const DecodeAttentionArgs& args) const {
    THINKV_RETURN_IF_ERROR(check_attention_args(args, config_.num_streams));
    THINKV_RETURN_IF_ERROR(check_attend_view(view, args));
    const int d = config_.head_dim;
    const float scale = args.softmax_scale > 0.0f ? args.softmax_scale : 1.0f / std::sqrt(static_cast<float>(d));
    const int group = args.num_q_heads / args.num_kv_heads;
    std::vector<float> k, v;
    for (int h = 0; h < args.num_kv_heads; ++h) {
      THINKV_RETURN_IF_ERROR(gather(view, view.streams[static_cast<std::size_t>(h)], k, v));
      const int n = static_cast<int>(k.size() / static_cast<std::size_t>(d));
      reference::attend_tokens(args.q + static_cast<std::ptrdiff_t>(h) * group * d, group, k.data(), v.data(), n, d,
                               scale, args.out + static_cast<std::ptrdiff_t>(h) * group * d,
                               args.sparsity ? args.sparsity + static_cast<std::ptrdiff_t>(h) * group : nullptr);
    }
    return Status::ok();
  }

  /// Dequantized K and V ([n, head_dim] each) of a stream's live slots (block-list order, then
  /// slot order) then staged tokens: attention order.
  [[nodiscard]] Status gather(const AttendView& view, const StreamView& stream, std::vector<float>& k,
                              std::vector<float>& v) const {
    const int d = config_.head_dim;
    const std::size_t n = static_cast<std::size_t>(stream.live) + static_cast<std::size_t>(stream.staged);
    k.resize(n * d);
    v.resize(n * d);
    std::size_t j = 0;
    for (std::uint32_t b : stream.blocks) {
      const int p = view.pool_of(b);
      for (int s = 0; s < view.block_size; ++s) {
        if (!view.live(p, b, s)) continue;
        if (j >= static_cast<std::size_t>(stream.live)) {
          return {StatusCode::kInvalidArgument, "attend: stream " + std::to_string(stream.stream) +
                                                    " has more live slots than the " + std::to_string(stream.live) +
                                                    " its view lists"};
        }
        THINKV_RETURN_IF_ERROR(read_token(view.token(p, b, s), k.data() + j * d, v.data() + j * d));
        ++j;
      }
    }
    if (j != static_cast<std::size_t>(stream.live)) {
      return {StatusCode::kInvalidArgument, "attend: stream " + std::to_string(stream.stream) + " lists " +
                                                std::to_string(stream.live) + " live slots but its blocks hold " +
                                                std::to_string(j)};
    }
    for (int r = 0; r < stream.staged; ++r, ++j) {
      THINKV_RETURN_IF_ERROR(read_staged(stream.stream, r, k.data() + j * d, v.data() + j * d));
    }
    return Status::ok();
  }

  [[nodiscard]] BackendStats stats() const { return stats_; }

  /// Second-level scale of (stream, K = 0 / V = 1, precision); 0 until the stream's first group of
  /// that precision is committed.
  [[nodiscard]] float stream_scale(int stream, int kv, Precision p) const { return s2_[s2_index(stream, kv, p)]; }
  /// Raw bytes of a block's page (for tests and debugging); poison (0xA5) for a block without
  /// storage.
  [[nodiscard]] std::span<const std::uint8_t> page(std::uint32_t block) const {
    const Precision p = pools_.precision_of(block);
    const auto bytes = static_cast<std::size_t>(layout_.page_bytes(p));
    if (!has_storage(block)) return poison(bytes);
    return {page_ptr(block), bytes};
  }
  /// The head_dim E4M3 key scales of a record (poison for a record without storage).
  [[nodiscard]] std::span<const std::uint8_t> record_scales(std::uint32_t record) const {
    const auto d = static_cast<std::size_t>(config_.head_dim);
    if (record >= records_) return poison(d);
    return {record_ptr(record), d};
  }
  // ---- raw storage access (state_io_backend: saving and loading sequence state) ---------------

  [[nodiscard]] Status read_page(Precision p, std::uint32_t page, std::span<std::uint8_t> out) const {
    THINKV_RETURN_IF_ERROR(check_page(p, page, out.size(), "read_page"));
    std::copy_n(page_ptr(pools_.base[static_cast<int>(p)] + page), out.size(), out.data());
    return Status::ok();
  }
  [[nodiscard]] Status write_page(Precision p, std::uint32_t page, std::span<const std::uint8_t> in) {
    THINKV_RETURN_IF_ERROR(check_page(p, page, in.size(), "write_page"));
    std::copy_n(in.data(), in.size(), const_cast<std::uint8_t*>(page_ptr(pools_.base[static_cast<int>(p)] + page)));
    return Status::ok();
  }
  [[nodiscard]] Status read_record(std::uint32_t record, std::span<std::uint8_t> out) const {
    THINKV_RETURN_IF_ERROR(check_record(record, out.size(), "read_record"));
    std::copy_n(record_ptr(record), out.size(), out.data());
    return Status::ok();
  }
  [[nodiscard]] Status write_record(std::uint32_t record, std::span<const std::uint8_t> in) {
    THINKV_RETURN_IF_ERROR(check_record(record, in.size(), "write_record"));
    std::copy_n(in.data(), in.size(), record_ptr(record));
    return Status::ok();
  }
  [[nodiscard]] Status read_stream_scales(int stream, std::span<float> out) const {
    THINKV_RETURN_IF_ERROR(check_scales(stream, out.size(), "read_stream_scales"));
    std::copy_n(s2_.data() + static_cast<std::size_t>(stream) * 2 * kNumPrecisions, out.size(), out.data());
    return Status::ok();
  }
  [[nodiscard]] Status write_stream_scales(int stream, std::span<const float> in) {
    THINKV_RETURN_IF_ERROR(check_scales(stream, in.size(), "write_stream_scales"));
    std::copy_n(in.data(), in.size(), s2_.data() + static_cast<std::size_t>(stream) * 2 * kNumPrecisions);
    return Status::ok();
  }

  /// Pages of pool p with storage, and records with storage.
  [[nodiscard]] std::uint32_t pool_pages(Precision p) const noexcept { return pool_pages_[static_cast<int>(p)]; }
  [[nodiscard]] std::uint32_t records_allocated() const noexcept { return records_; }

 private:
  /// KV head h of a prompt attention after `k`, `v` ([stored, head_dim] each, FP32): the
  /// chunk's K/V rows of head h appended to them, then each query row of the head's group
  /// attends the stored rows and its prefix of the chunk (reference::attend_tokens).
  void attend_after(const PromptAttendArgs& a, int h, std::vector<float>& k, std::vector<float>& v) const {
    const int d = a.head_dim, hkv = a.num_kv_heads, hq = a.num_q_heads, group = hq / hkv, n = a.tokens;
    const float scale = a.softmax_scale > 0.0f ? a.softmax_scale : 1.0f / std::sqrt(static_cast<float>(d));
    const std::size_t stored = k.size() / static_cast<std::size_t>(d);
    k.resize((stored + static_cast<std::size_t>(n)) * d);
    v.resize(k.size());
    for (int t = 0; t < n; ++t) {
      for (int c = 0; c < d; ++c) {
        const std::size_t i = (static_cast<std::size_t>(t) * hkv + h) * d + c;
        k[(stored + static_cast<std::size_t>(t)) * d + c] = load_element(a.k.data, a.k.type, i);
        v[(stored + static_cast<std::size_t>(t)) * d + c] = load_element(a.v.data, a.v.type, i);
      }
    }
    std::vector<float> q(static_cast<std::size_t>(group) * d), out(q.size());
    for (int t = 0; t < n; ++t) {
      const std::size_t row = (static_cast<std::size_t>(t) * hq + static_cast<std::size_t>(h) * group) * d;
      for (std::size_t i = 0; i < q.size(); ++i) q[i] = load_element(a.q.data, a.q.type, row + i);
      reference::attend_tokens(q.data(), group, k.data(), v.data(), static_cast<int>(stored) + t + 1, d, scale,
                               out.data());
      for (std::size_t i = 0; i < out.size(); ++i) store_element(a.out.data, a.out.type, row + i, out[i]);
    }
  }
  struct Tables {
    float e4m3[256];
    float e2m1[16];
    float ternary[4];
  };
  static const Tables& tables() {
    static const Tables t = [] {
      Tables x{};
      for (int i = 0; i < 256; ++i) x.e4m3[i] = decode_e4m3(static_cast<std::uint8_t>(i));
      for (int i = 0; i < 16; ++i) x.e2m1[i] = decode_e2m1(static_cast<std::uint8_t>(i));
      for (int i = 0; i < 4; ++i) x.ternary[i] = decode_element(Precision::kTernary, static_cast<std::uint8_t>(i));
      return x;
    }();
    return t;
  }
  [[nodiscard]] std::size_t s2_index(int stream, int kv, Precision p) const {
    return (static_cast<std::size_t>(stream) * 2 + kv) * kNumPrecisions + static_cast<int>(p);
  }
  float& s2_ref(int stream, int kv, Precision p) { return s2_[s2_index(stream, kv, p)]; }
  [[nodiscard]] std::uint16_t* staging_row(int stream, int row, int kv) {
    return staging_.data() +
           ((static_cast<std::size_t>(stream) * 2 + kv) * config_.group_size + row) * config_.head_dim;
  }
  [[nodiscard]] const std::uint16_t* staging_row(int stream, int row, int kv) const {
    return staging_.data() +
           ((static_cast<std::size_t>(stream) * 2 + kv) * config_.group_size + row) * config_.head_dim;
  }
  /// Makes `chunks` cover items 0 .. n - 1 of `item_bytes` each: chunk c holds `per_chunk` items,
  /// the last one cut at `cap`; new chunks are poisoned (a read of a never-written byte shows up
  /// as garbage in tests, not as zeros). All-or-nothing: out of memory frees what it allocated.
  Status resize_chunks(std::vector<Vec<std::uint8_t>>& chunks, std::size_t n, std::size_t per_chunk, std::size_t cap,
                       std::size_t item_bytes, const std::string& what) {
    const std::size_t want = (n + per_chunk - 1) / per_chunk;
    const std::size_t before = chunks.size();
    try {
      while (chunks.size() < want) {
        const std::size_t items = std::min(per_chunk, cap - chunks.size() * per_chunk);
        chunks.emplace_back(items * item_bytes, std::uint8_t{0xA5}, alloc_);
        stats_.bytes_allocated += static_cast<std::int64_t>(chunks.back().size());
      }
    } catch (const std::bad_alloc&) {
      free_chunks_from(chunks, before);
      return {StatusCode::kPoolExhausted,
              "out of host memory giving storage to " + what + " (" + std::to_string(n) + " in all)"};
    }
    free_chunks_from(chunks, want);
    return Status::ok();
  }
  /// Frees chunks from index `keep` on.
  void free_chunks_from(std::vector<Vec<std::uint8_t>>& chunks, std::size_t keep) {
    while (chunks.size() > keep) {
      stats_.bytes_allocated -= static_cast<std::int64_t>(chunks.back().size());
      chunks.pop_back();
    }
  }
  [[nodiscard]] Status check_page(Precision p, std::uint32_t page, std::size_t bytes, const char* call) const {
    if (page >= pool_pages_[static_cast<int>(p)]) {
      return {StatusCode::kOutOfRange, std::string(call) + ": page " + std::to_string(page) + " of the " +
                                           std::string(to_string(p)) + " pool has no storage (" +
                                           std::to_string(pool_pages_[static_cast<int>(p)]) + " pages have)"};
    }
    return check_state_io_size(bytes, static_cast<std::size_t>(layout_.page_bytes(p)), call);
  }
  [[nodiscard]] Status check_record(std::uint32_t record, std::size_t bytes, const char* call) const {
    if (record >= records_) {
      return {StatusCode::kOutOfRange, std::string(call) + ": record " + std::to_string(record) + " has no storage (" +
                                           std::to_string(records_) + " records have)"};
    }
    return check_state_io_size(bytes, static_cast<std::size_t>(config_.head_dim), call);
  }
  [[nodiscard]] Status check_scales(int stream, std::size_t n, const char* call) const {
    if (stream < 0 || stream >= config_.num_streams) {
      return {StatusCode::kOutOfRange, std::string(call) + ": stream " + std::to_string(stream) + " does not exist"};
    }
    return check_state_io_size(n, 2 * static_cast<std::size_t>(kNumPrecisions), call);
  }
  [[nodiscard]] bool has_storage(std::uint32_t block) const noexcept {
    return block < pools_.total &&
           pools_.local_index(block) < pool_pages_[static_cast<int>(pools_.precision_of(block))];
  }
  [[nodiscard]] std::span<const std::uint8_t> poison(std::size_t bytes) const {
    if (poison_.size() < bytes) poison_.assign(bytes, 0xA5);
    return {poison_.data(), bytes};
  }
  [[nodiscard]] const std::uint8_t* page_ptr(std::uint32_t block) const {
    const int p = static_cast<int>(pools_.precision_of(block));
    const std::uint32_t local = pools_.local_index(block);
    return chunks_[p][local / chunk_pages_[p]].data() +
           static_cast<std::size_t>(local % chunk_pages_[p]) *
               static_cast<std::size_t>(layout_.page_bytes(static_cast<Precision>(p)));
  }
  [[nodiscard]] const std::uint8_t* record_ptr(std::uint32_t r) const {
    return record_chunks_[r / record_chunk_].data() +
           static_cast<std::size_t>(r % record_chunk_) * static_cast<std::size_t>(config_.head_dim);
  }
  std::uint8_t* record_ptr(std::uint32_t r) { return const_cast<std::uint8_t*>(std::as_const(*this).record_ptr(r)); }
  [[nodiscard]] const std::uint8_t* row_ptr(SlotRef s, int kv) const {
    const Precision p = pools_.precision_of(s.block);
    const std::size_t rb = static_cast<std::size_t>(layout_.row_bytes(p));
    return page_ptr(s.block) + (static_cast<std::size_t>(kv) * config_.block_size + s.slot) * rb;
  }
  std::uint8_t* row_ptr(SlotRef s, int kv) { return const_cast<std::uint8_t*>(std::as_const(*this).row_ptr(s, kv)); }
  [[nodiscard]] const std::uint8_t* value_scales_ptr(SlotRef s) const {
    const Precision p = pools_.precision_of(s.block);
    const std::size_t rb = static_cast<std::size_t>(layout_.row_bytes(p));
    return page_ptr(s.block) + 2 * static_cast<std::size_t>(config_.block_size) * rb +
           static_cast<std::size_t>(s.slot) * layout_.value_scale_bytes(p);
  }
  std::uint8_t* value_scales_ptr(SlotRef s) {
    return const_cast<std::uint8_t*>(std::as_const(*this).value_scales_ptr(s));
  }

  Alloc alloc_;
  StorageConfig config_{};
  CacheLayout layout_{};
  PoolMap pools_{};
  BackendStats stats_{};
  std::vector<Vec<std::uint8_t>> chunks_[kNumPrecisions];  // per pool: chunks of [pages, page_bytes]
  std::uint32_t pool_pages_[kNumPrecisions] = {};          // pages with storage per pool
  std::uint32_t chunk_pages_[kNumPrecisions] = {1, 1, 1, 1};
  std::vector<Vec<std::uint8_t>> record_chunks_;  // chunks of [record_chunk_, head_dim] E4M3
  std::uint32_t record_chunk_ = 1;
  std::uint32_t record_cap_ = 0;              // the record range (effective_record_capacity)
  std::uint32_t records_ = 0;                 // records with storage
  Vec<std::uint16_t> staging_;                // [streams, 2, g, head_dim] BF16
  Vec<float> s2_;                             // [streams, 2, precisions]
  mutable std::vector<std::uint8_t> poison_;  // what page() shows of a block without storage
  std::vector<std::uint8_t> faulted_;         // [streams] fault raised (stage_batch), until reset_stream
  std::vector<BackendFault> faults_;          // raised, not yet polled
  StepView step_;                             // the open decode step (prepare_step)
  std::vector<StageRow> step_rows_;           // append_step scratch
};

/// The CPU backend with the standard allocator.
using CpuKvBackend = BasicCpuKvBackend<>;
static_assert(kv_backend<CpuKvBackend> && batched_kv_backend<CpuKvBackend> && segment_selecting_backend<CpuKvBackend> &&
              state_io_backend<CpuKvBackend> && prompt_attending_backend<CpuKvBackend> &&
              chunk_attending_backend<CpuKvBackend>);

}  // namespace thinkv
