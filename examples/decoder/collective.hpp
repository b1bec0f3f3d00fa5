#pragma once
/// \file collective.hpp
/// Tensor parallelism's collectives, as the GPU decoder (gpu_transformer.hpp) uses them: a group
/// of `size` ranks, each holding a slice of the model's heads and FFN columns on its own GPU (or
/// its own stream), summing partial results in place. Two implementations:
///  - NcclCollective (nccl_collective.hpp): NCCL's all-reduce, one rank per GPU, one process (or
///    thread) per rank; what a deployment uses.
///  - LocalGroup (below): ranks as threads of one process that may share one GPU, the sums taken
///    on the host in rank order. For tests and for checking a sharding on a single GPU: it is
///    slow (every call drains the stream) and never what a deployment should run.
///
/// The contract every rank keeps (a collective's): all ranks make the same calls, in the same
/// order, with the same counts. A rank that fails calls abort(), so that the others fail rather
/// than wait; a rank that stops without it is found by the timeout: every call that waits for the
/// other ranks fails with kCudaError naming the timeout after it. After any failure the group is
/// broken: every later call fails at once, and the ranks' decoders should be destroyed.
///
/// Declared without CUDA headers: streams and events are CUstream_st* / CUevent_st*
/// (cudaStream_t / cudaEvent_t).

#include <chrono>
#include <cstddef>
#include <memory>
#include <span>
#include <string>

#include "thinkv/status.hpp"

struct CUstream_st;
struct CUevent_st;

namespace thinkv::decoder {

class Collective {
 public:
  virtual ~Collective() = default;
  [[nodiscard]] virtual int rank() const noexcept = 0;
  [[nodiscard]] virtual int size() const noexcept = 0;
  /// Replaces `count` FP32 values at the device pointer `buf` by their sum over all ranks, in
  /// stream order on `stream` (enqueued: it may return before the device has done it). Every rank
  /// ends with the same bits.
  [[nodiscard]] virtual Status all_reduce(float* buf, std::size_t count, CUstream_st* stream) = 0;
  /// Replaces host `values` by their sums over all ranks (in double), ordered after the work
  /// enqueued on `stream` so far; returns when the sums are in `values` (it waits for `stream`).
  [[nodiscard]] virtual Status all_reduce_host(std::span<double> values, CUstream_st* stream) = 0;
  /// Waits for `event` (recorded on a stream after collectives), within the timeout.
  [[nodiscard]] virtual Status wait(CUevent_st* event) = 0;
  /// This rank failed (`why`) and leaves: the other ranks' waiting and later calls fail.
  virtual void abort(const std::string& why) = 0;
  /// Whether the group is broken (a rank aborted, a call failed or timed out).
  [[nodiscard]] virtual bool broken() const = 0;
};

/// `size` ranks as threads of one process; rank(r) is the r-th rank's Collective (valid while
/// the group lives). Sums are taken on the host in double, in rank order, the same on every
/// rank; device buffers go through the host (each call drains the caller's stream).
class LocalGroup {
 public:
  LocalGroup(int size, std::chrono::milliseconds timeout);
  ~LocalGroup();
  LocalGroup(const LocalGroup&) = delete;
  LocalGroup& operator=(const LocalGroup&) = delete;
  [[nodiscard]] int size() const noexcept;
  [[nodiscard]] Collective& rank(int r);

 private:
  struct State;
  class Rank;
  std::unique_ptr<State> state_;
};

}  // namespace thinkv::decoder
