#pragma once
/// \file kv_backend.hpp
/// The KV-backend interface: where K/V bytes live and how they are written and read.
///
/// The cache (PagedKvCache) owns the host metadata (BlockTable) and decides where data goes; a
/// backend owns the bytes (pages, key-scale records, staging buffers, second-level scales) and
/// executes: give a pool storage for n blocks, stage a token, commit a staged group into planned
/// slots, read a token back, attend. It sees plain values only (paged/storage_view.hpp: the
/// geometry, commit plans, token references, an attention's view of its streams' blocks and the
/// pools' metadata), never the BlockTable or a policy setting. Pages of pool p are numbered by their index in the pool
/// (block id - PoolMap::base[p]); the cache grows and shrinks a pool's storage in whole chunks.
/// Two forms of the same interface:
///   - `kv_backend<B>`: a C++20 concept for header-only code (no virtual calls);
///   - `KvBackend`: one coarse virtual interface for runtimes that choose a backend at run time,
///     with `DynamicBackend` (a concept model holding a KvBackend) and `BackendModel<B>` (a
///     KvBackend wrapping any concept model) to go either way.

#include <concepts>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include "thinkv/paged/layout.hpp"
#include "thinkv/paged/storage_view.hpp"
#include "thinkv/reference/attention.hpp"
#include "thinkv/status.hpp"

namespace thinkv {

/// Counters a backend keeps.
struct BackendStats {
  std::int64_t groups_quantized = 0;   ///< staged groups committed (quantized or copied)
  std::int64_t scale_saturations = 0;  ///< groups whose E4M3 scale saturated (values clipped)
  /// Bytes the backend holds now: pages, key-scale records' scales, staging and second-level
  /// scales (it follows resize_pool / resize_records).
  std::int64_t bytes_allocated = 0;
  /// Bytes commits stored into pages and key-scale records (K/V codes, value scales, key
  /// scales), counted where they are written. PagedKvCache compares it with what its commit
  /// plans of new tokens account for: any other write (a compaction) shows as moved bytes. A
  /// backend must count it (both in-tree backends do; tests check it against the formats).
  std::int64_t page_bytes_written = 0;
  /// A backend that mirrors the block metadata in another memory (a device): the metadata bytes
  /// it copied there (pools' fill, masks and slot records, and the attended streams' block
  /// lists), and how many of its attends had to copy the pools' metadata whole (the first one,
  /// and after its storage grew or shrank); the others copy only the pages changed since. 0 for
  /// the CPU backend, which reads the table's metadata in place.
  std::int64_t metadata_bytes_uploaded = 0;
  std::int64_t metadata_full_uploads = 0;
  /// A device backend's batched calls (batch.hpp): every byte they copied host to device
  /// (stage rows, commit jobs, metadata, block lists, attended streams, K-means jobs) and device
  /// to host (sparsity, faults, kept indices). The tensors are the caller's, already on the device.
  std::int64_t host_to_device_bytes = 0;
  std::int64_t device_to_host_bytes = 0;
  /// Times a backend moved its storage to a buffer of another size (a pool's pages or the
  /// key-scale records grew or shrank: resize_pool / resize_records). The CUDA backend waits for
  /// its stream for each, inside the call that needed the room (a step's begin_step), so a
  /// runtime whose steps must never wait reserves its storage (CudaKvBackend::reserve_storage)
  /// and sees 0 after that. The CPU backend adds and frees chunks that never move: 0.
  std::int64_t storage_reallocations = 0;
};

/// A KV backend. `stage`/`read_*` pointers are in the backend's memory space; the CPU backend's
/// is host memory.
template <class B>
concept kv_backend = requires(B& b, const B& cb, const StorageConfig& config, Precision p, std::uint32_t n, int stream,
                              int row, const float* k, const float* v, float* k_out, float* v_out,
                              const CommitPlan& plan, const TokenRef& token, const AttendView& view,
                              const DecodeAttentionArgs& args) {
  { cb.name() } -> std::convertible_to<std::string_view>;
  /// Sets up for the storage geometry `config` (already validated; it holds no policy setting):
  /// staging and second-level scales of every stream, no page or record yet.
  { b.init(config) } -> std::same_as<Status>;
  /// Gives pool p storage for pages 0 .. blocks - 1, keeping the bytes of those it had (grow), or
  /// releases the pages from `blocks` on (shrink: the cache holds none of them). New pages may
  /// hold any bytes. On an error (out of memory) nothing changes.
  { b.resize_pool(p, n) } -> std::same_as<Status>;
  /// The same for key-scale records 0 .. n - 1 (the cache only grows them).
  { b.resize_records(n) } -> std::same_as<Status>;
  /// Writes one token (head_dim floats each, already checked finite) into staging row `row`.
  { b.stage(stream, row, k, v) } -> std::same_as<Status>;
  /// Quantizes the stream's full staging group at plan.precision into plan.slots.
  { b.commit(plan) } -> std::same_as<Status>;
  /// Forgets a stream's staging and second-level scales (end of sequence).
  { b.reset_stream(stream) } -> std::same_as<Status>;
  /// Dequantizes one stored token (its slot, owning stream and key-scale record).
  { cb.read_token(token, k_out, v_out) } -> std::same_as<Status>;
  /// Decodes one staged token.
  { cb.read_staged(stream, row, k_out, v_out) } -> std::same_as<Status>;
  /// Decode attention over the live slots and staged tokens of args.kv_streams, whose blocks
  /// view.streams[h] lists (view.streams[h].stream == args.kv_streams[h]).
  { cb.attend(view, args) } -> std::same_as<Status>;
  { cb.stats() } -> std::same_as<BackendStats>;
};

/// A backend whose stored bytes can be read and written raw, so that a sequence's state is saved
/// and restored bit for bit (BasicThinKvCache::save_sequence / load_sequence). Page `page` of pool
/// p is the pool's page index (block id - PoolMap::base[p]) and holds CacheLayout::page_bytes(p)
/// bytes; a key-scale record holds head_dim bytes (its E4M3 key scales); a stream's scales are its
/// 2 x kNumPrecisions second-level scales (K then V, each by Precision). Reads and writes name
/// storage that exists (kOutOfRange or kInvalidArgument otherwise) and take spans of exactly those
/// sizes (kShapeMismatch). Writes are not commits: they do not count in page_bytes_written. Not a
/// hot path: a device backend may synchronise.
template <class B>
concept state_io_backend = kv_backend<B> &&
    requires(B& b, const B& cb, Precision p, std::uint32_t i, int stream, std::span<std::uint8_t> out,
             std::span<const std::uint8_t> in, std::span<float> fout, std::span<const float> fin) {
  { cb.read_page(p, i, out) } -> std::same_as<Status>;
  { b.write_page(p, i, in) } -> std::same_as<Status>;
  { cb.read_record(i, out) } -> std::same_as<Status>;
  { b.write_record(i, in) } -> std::same_as<Status>;
  { cb.read_stream_scales(stream, fout) } -> std::same_as<Status>;
  { b.write_stream_scales(stream, fin) } -> std::same_as<Status>;
};

/// A state_io_backend that reads every block through the table's views (its owner's
/// second-level scales, its page by id), so a block may sit in several streams' lists
/// (BlockTable's shared blocks): copy_sequence then shares a pinned prompt's blocks instead of
/// copying them. A backend declares it with `static constexpr bool kSharesPages = true;`.
template <class B>
concept page_sharing_backend = state_io_backend<B> && requires {
  requires B::kSharesPages;
};

/// The sizes state_io_backend's calls check, for backends to share the message.
inline Status check_state_io_size(std::size_t got, std::size_t want, const char* what) {
  if (got == want) return Status::ok();
  return {StatusCode::kShapeMismatch, std::string(what) + ": " + std::to_string(got) + " bytes or values given, " +
                                          std::to_string(want) + " expected"};
}

/// The checks every backend makes of an attention's view before reading it: one StreamView per KV
/// head naming args.kv_streams[h], at least one token in each, every listed block in a pool's
/// pages with storage. (The CPU backend also checks each stream's live count against the masks.)
inline Status check_attend_view(const AttendView& view, const DecodeAttentionArgs& args) {
  if (view.streams.size() != static_cast<std::size_t>(args.num_kv_heads)) {
    return {StatusCode::kShapeMismatch, "attend: the view has " + std::to_string(view.streams.size()) +
                                            " streams for " + std::to_string(args.num_kv_heads) + " KV heads"};
  }
  for (int h = 0; h < args.num_kv_heads; ++h) {
    const StreamView& sv = view.streams[static_cast<std::size_t>(h)];
    if (sv.stream != args.kv_streams[h]) {
      return {StatusCode::kInvalidArgument, "attend: view stream " + std::to_string(h) + " is stream " +
                                                std::to_string(sv.stream) + ", args name stream " +
                                                std::to_string(args.kv_streams[h])};
    }
    if (sv.live + sv.staged == 0) {
      return {StatusCode::kInvalidArgument, "stream " + std::to_string(sv.stream) + " holds no token to attend to"};
    }
    for (std::uint32_t b : sv.blocks) {
      if (view.pool_of(b) < 0) {
        return {StatusCode::kInvalidArgument,
                "attend: block " + std::to_string(b) + " of stream " + std::to_string(sv.stream) + " has no storage"};
      }
    }
  }
  return Status::ok();
}

/// The same interface with virtual dispatch, for runtimes that pick a backend at run time.
class KvBackend {
 public:
  virtual ~KvBackend() = default;
  [[nodiscard]] virtual std::string_view name() const = 0;
  [[nodiscard]] virtual Status init(const StorageConfig& config) = 0;
  [[nodiscard]] virtual Status resize_pool(Precision p, std::uint32_t blocks) = 0;
  [[nodiscard]] virtual Status resize_records(std::uint32_t records) = 0;
  [[nodiscard]] virtual Status stage(int stream, int row, const float* k, const float* v) = 0;
  [[nodiscard]] virtual Status commit(const CommitPlan& plan) = 0;
  [[nodiscard]] virtual Status reset_stream(int stream) = 0;
  [[nodiscard]] virtual Status read_token(const TokenRef& token, float* k, float* v) const = 0;
  [[nodiscard]] virtual Status read_staged(int stream, int row, float* k, float* v) const = 0;
  [[nodiscard]] virtual Status attend(const AttendView& view, const DecodeAttentionArgs& args) const = 0;
  [[nodiscard]] virtual BackendStats stats() const = 0;
  /// state_io_backend's calls; a backend without raw access answers kUnsupported.
  [[nodiscard]] virtual Status read_page(Precision, std::uint32_t, std::span<std::uint8_t>) const {
    return unsupported("read_page");
  }
  [[nodiscard]] virtual Status write_page(Precision, std::uint32_t, std::span<const std::uint8_t>) {
    return unsupported("write_page");
  }
  [[nodiscard]] virtual Status read_record(std::uint32_t, std::span<std::uint8_t>) const {
    return unsupported("read_record");
  }
  [[nodiscard]] virtual Status write_record(std::uint32_t, std::span<const std::uint8_t>) {
    return unsupported("write_record");
  }
  [[nodiscard]] virtual Status read_stream_scales(int, std::span<float>) const {
    return unsupported("read_stream_scales");
  }
  [[nodiscard]] virtual Status write_stream_scales(int, std::span<const float>) {
    return unsupported("write_stream_scales");
  }

 protected:
  [[nodiscard]] Status unsupported(const char* call) const {
    return {StatusCode::kUnsupported, "backend '" + std::string(name()) + "' has no raw storage access (" + call +
                                          "): saving and loading sequence state needs a state_io_backend"};
  }
};

/// Wraps a concept model B as a KvBackend.
template <kv_backend B>
class BackendModel final : public KvBackend {
 public:
  explicit BackendModel(B backend = B{}) : b_(std::move(backend)) {}
  std::string_view name() const override { return b_.name(); }
  Status init(const StorageConfig& c) override { return b_.init(c); }
  Status resize_pool(Precision p, std::uint32_t n) override { return b_.resize_pool(p, n); }
  Status resize_records(std::uint32_t n) override { return b_.resize_records(n); }
  Status stage(int s, int r, const float* k, const float* v) override { return b_.stage(s, r, k, v); }
  Status commit(const CommitPlan& p) override { return b_.commit(p); }
  Status reset_stream(int s) override { return b_.reset_stream(s); }
  Status read_token(const TokenRef& t, float* k, float* v) const override { return b_.read_token(t, k, v); }
  Status read_staged(int s, int r, float* k, float* v) const override { return b_.read_staged(s, r, k, v); }
  Status attend(const AttendView& w, const DecodeAttentionArgs& a) const override { return b_.attend(w, a); }
  BackendStats stats() const override { return b_.stats(); }
  Status read_page(Precision p, std::uint32_t i, std::span<std::uint8_t> out) const override {
    if constexpr (state_io_backend<B>) return b_.read_page(p, i, out);
    return unsupported("read_page");
  }
  Status write_page(Precision p, std::uint32_t i, std::span<const std::uint8_t> in) override {
    if constexpr (state_io_backend<B>) return b_.write_page(p, i, in);
    return unsupported("write_page");
  }
  Status read_record(std::uint32_t r, std::span<std::uint8_t> out) const override {
    if constexpr (state_io_backend<B>) return b_.read_record(r, out);
    return unsupported("read_record");
  }
  Status write_record(std::uint32_t r, std::span<const std::uint8_t> in) override {
    if constexpr (state_io_backend<B>) return b_.write_record(r, in);
    return unsupported("write_record");
  }
  Status read_stream_scales(int s, std::span<float> out) const override {
    if constexpr (state_io_backend<B>) return b_.read_stream_scales(s, out);
    return unsupported("read_stream_scales");
  }
  Status write_stream_scales(int s, std::span<const float> in) override {
    if constexpr (state_io_backend<B>) return b_.write_stream_scales(s, in);
    return unsupported("write_stream_scales");
  }
  [[nodiscard]] B& get() noexcept { return b_; }
  [[nodiscard]] const B& get() const noexcept { return b_; }

 private:
  B b_;
};

/// A concept model that forwards to a KvBackend chosen at run time (owns it).
class DynamicBackend {
 public:
  DynamicBackend() = default;
  explicit DynamicBackend(std::unique_ptr<KvBackend> impl) : impl_(std::move(impl)) {}
  std::string_view name() const { return impl_ ? impl_->name() : "none"; }
  Status init(const StorageConfig& c) {
    if (!impl_) return {StatusCode::kInvalidArgument, "DynamicBackend holds no backend"};
    return impl_->init(c);
  }
  Status resize_pool(Precision p, std::uint32_t n) { return impl_->resize_pool(p, n); }
  Status resize_records(std::uint32_t n) { return impl_->resize_records(n); }
  Status stage(int s, int r, const float* k, const float* v) { return impl_->stage(s, r, k, v); }
  Status commit(const CommitPlan& p) { return impl_->commit(p); }
  Status reset_stream(int s) { return impl_->reset_stream(s); }
  Status read_token(const TokenRef& t, float* k, float* v) const { return impl_->read_token(t, k, v); }
  Status read_staged(int s, int r, float* k, float* v) const { return impl_->read_staged(s, r, k, v); }
  Status attend(const AttendView& w, const DecodeAttentionArgs& a) const { return impl_->attend(w, a); }
  BackendStats stats() const { return impl_->stats(); }
  Status read_page(Precision p, std::uint32_t i, std::span<std::uint8_t> out) const {
    return impl_->read_page(p, i, out);
  }
  Status write_page(Precision p, std::uint32_t i, std::span<const std::uint8_t> in) {
    return impl_->write_page(p, i, in);
  }
  Status read_record(std::uint32_t r, std::span<std::uint8_t> out) const { return impl_->read_record(r, out); }
  Status write_record(std::uint32_t r, std::span<const std::uint8_t> in) { return impl_->write_record(r, in); }
  Status read_stream_scales(int s, std::span<float> out) const { return impl_->read_stream_scales(s, out); }
  Status write_stream_scales(int s, std::span<const float> in) { return impl_->write_stream_scales(s, in); }
  [[nodiscard]] KvBackend* get() const noexcept { return impl_.get(); }

 private:
  std::unique_ptr<KvBackend> impl_;
};
static_assert(kv_backend<DynamicBackend> && state_io_backend<DynamicBackend>);

}  // namespace thinkv
