/// \file nccl_collective.cpp
/// NcclCollective (nccl_collective.hpp): NCCL's non-blocking communicator, every wait bounded.

#include "nccl_collective.hpp"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstring>
#include <thread>
#include <vector>

namespace thinkv::decoder {

struct NcclCollective::Impl {
  ncclComm_t comm = nullptr;
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds timeout{0};
  bool broken = false;
  std::string why;
  double* d_values = nullptr;  // all_reduce_host's device buffer
  double* h_values = nullptr;  // and its pinned host buffer (a pageable copy could block unbounded)
  std::size_t d_capacity = 0;
  cudaEvent_t host_done = nullptr;

  ~Impl() {
    if (comm != nullptr) {
      if (broken) {
        (void)ncclCommAbort(comm);
      } else {
        (void)ncclCommFinalize(comm);
        // Finalize is non-blocking here: wait for it within the timeout, else abort.
        ncclResult_t st = ncclInProgress;
        const auto until = std::chrono::steady_clock::now() + timeout;
        while (ncclCommGetAsyncError(comm, &st) == ncclSuccess && st == ncclInProgress &&
               std::chrono::steady_clock::now() < until) {
          std::this_thread::yield();
        }
        if (st == ncclSuccess) {
          (void)ncclCommDestroy(comm);
        } else {
          (void)ncclCommAbort(comm);
        }
      }
    }
    if (d_values != nullptr) cudaFree(d_values);
    if (h_values != nullptr) cudaFreeHost(h_values);
    if (host_done != nullptr) cudaEventDestroy(host_done);
  }

  Status error(const std::string& what) {
    if (!broken) {
      broken = true;
      why = what;
    }
    return {StatusCode::kCudaError, "tensor parallelism (NCCL), rank " + std::to_string(rank) + ": " + what};
  }
  Status nccl(ncclResult_t r, const char* what) {
    if (r == ncclSuccess || r == ncclInProgress) return Status::ok();
    const char* last = comm != nullptr ? ncclGetLastError(comm) : nullptr;
    return error(std::string(what) + ": " + ncclGetErrorString(r) +
                 (last != nullptr && *last ? std::string(" (") + last + ")" : ""));
  }
  Status cuda(cudaError_t e, const char* what) {
    if (e == cudaSuccess) return Status::ok();
    (void)cudaGetLastError();
    return error(std::string(what) + ": " + cudaGetErrorString(e));
  }
  Status check_usable() {
    if (broken) {
      return {StatusCode::kCudaError, "tensor parallelism (NCCL), rank " + std::to_string(rank) +
                                          ": the communicator is broken (" + why + "); create a new group"};
    }
    return Status::ok();
  }
  /// Waits until NCCL's asynchronous state leaves ncclInProgress (a non-blocking call's enqueue)
  /// and, when `event` is given, until the event completes; aborts after the timeout.
  Status settle(const char* what, cudaEvent_t event) {
    const auto until = std::chrono::steady_clock::now() + timeout;
    for (int spins = 0;; ++spins) {
      ncclResult_t st = ncclSuccess;
      THINKV_RETURN_IF_ERROR(nccl(ncclCommGetAsyncError(comm, &st), "ncclCommGetAsyncError"));
      if (st != ncclSuccess && st != ncclInProgress) { THINKV_RETURN_IF_ERROR(nccl(st, what)); }
      bool done = st == ncclSuccess;
      if (done && event != nullptr) {
        const cudaError_t e = cudaEventQuery(event);
        if (e != cudaErrorNotReady) THINKV_RETURN_IF_ERROR(cuda(e, "cudaEventQuery"));
        done = e == cudaSuccess;
      }
      if (done) return Status::ok();
      if (std::chrono::steady_clock::now() >= until) {
        (void)ncclCommAbort(comm);
        comm = nullptr;
        return error(std::string(what) + " did not complete in " + std::to_string(timeout.count()) +
                     " ms (a rank failed or stopped); the communicator is aborted");
      }
      if (spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
};

Status NcclCollective::unique_id(std::string& out) {
  ncclUniqueId id;
  const ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) {
    return {StatusCode::kCudaError,
            std::string("tensor parallelism (NCCL): ncclGetUniqueId: ") + ncclGetErrorString(r)};
  }
  out.assign(id.internal, sizeof id.internal);
  return Status::ok();
}

Status NcclCollective::create(const std::string& id, int rank, int size, std::chrono::milliseconds timeout,
                              std::unique_ptr<NcclCollective>& out) {
  if (id.size() != NCCL_UNIQUE_ID_BYTES) {
    return {StatusCode::kInvalidArgument, "tensor parallelism (NCCL): a group id of " + std::to_string(id.size()) +
                                              " bytes; NcclCollective::unique_id makes " +
                                              std::to_string(NCCL_UNIQUE_ID_BYTES)};
  }
  if (size < 1 || rank < 0 || rank >= size) {
    return {StatusCode::kInvalidArgument, "tensor parallelism (NCCL): rank " + std::to_string(rank) + " of " +
                                              std::to_string(size) + " ranks (allowed: 0 <= rank < size)"};
  }
  if (timeout.count() <= 0) {
    return {StatusCode::kInvalidArgument,
            "tensor parallelism (NCCL): timeout " + std::to_string(timeout.count()) + " ms (must be positive)"};
  }
  auto impl = std::make_unique<Impl>();
  impl->rank = rank;
  impl->size = size;
  impl->timeout = timeout;
  THINKV_RETURN_IF_ERROR(
      impl->cuda(cudaEventCreateWithFlags(&impl->host_done, cudaEventDisableTiming), "cudaEventCreate"));
  ncclUniqueId uid;
  std::memcpy(uid.internal, id.data(), sizeof uid.internal);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  THINKV_RETURN_IF_ERROR(
      impl->nccl(ncclCommInitRankConfig(&impl->comm, size, uid, rank, &config), "ncclCommInitRankConfig"));
  THINKV_RETURN_IF_ERROR(impl->settle("joining the group (ncclCommInitRankConfig)", nullptr));
  out.reset(new NcclCollective(std::move(impl)));
  return Status::ok();
}

NcclCollective::NcclCollective(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
NcclCollective::~NcclCollective() = default;
int NcclCollective::rank() const noexcept { return impl_->rank; }
int NcclCollective::size() const noexcept { return impl_->size; }
bool NcclCollective::broken() const { return impl_->broken; }

Status NcclCollective::all_reduce(float* buf, std::size_t count, CUstream_st* stream) {
  Impl& m = *impl_;
  THINKV_RETURN_IF_ERROR(m.check_usable());
  THINKV_RETURN_IF_ERROR(m.nccl(ncclAllReduce(buf, buf, count, ncclFloat32, ncclSum, m.comm, stream), "ncclAllReduce"));
  return m.settle("ncclAllReduce (enqueue)", nullptr);
}

Status NcclCollective::all_reduce_host(std::span<double> values, CUstream_st* stream) {
  Impl& m = *impl_;
  THINKV_RETURN_IF_ERROR(m.check_usable());
  if (values.size() > m.d_capacity) {
    if (m.d_values != nullptr) (void)cudaFree(m.d_values);
    if (m.h_values != nullptr) (void)cudaFreeHost(m.h_values);
    m.d_values = m.h_values = nullptr;
    m.d_capacity = 0;
    THINKV_RETURN_IF_ERROR(m.cuda(cudaMalloc(&m.d_values, values.size() * sizeof(double)), "cudaMalloc"));
    THINKV_RETURN_IF_ERROR(m.cuda(cudaMallocHost(&m.h_values, values.size() * sizeof(double)), "cudaMallocHost"));
    m.d_capacity = values.size();
  }
  const std::size_t bytes = values.size() * sizeof(double);
  std::memcpy(m.h_values, values.data(), bytes);
  THINKV_RETURN_IF_ERROR(
      m.cuda(cudaMemcpyAsync(m.d_values, m.h_values, bytes, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync"));
  THINKV_RETURN_IF_ERROR(m.nccl(
      ncclAllReduce(m.d_values, m.d_values, values.size(), ncclFloat64, ncclSum, m.comm, stream), "ncclAllReduce"));
  THINKV_RETURN_IF_ERROR(m.settle("ncclAllReduce (enqueue)", nullptr));
  THINKV_RETURN_IF_ERROR(
      m.cuda(cudaMemcpyAsync(m.h_values, m.d_values, bytes, cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync"));
  THINKV_RETURN_IF_ERROR(m.cuda(cudaEventRecord(m.host_done, stream), "cudaEventRecord"));
  THINKV_RETURN_IF_ERROR(m.settle("the thought signal's all-reduce", m.host_done));
  std::memcpy(values.data(), m.h_values, bytes);
  return Status::ok();
}

Status NcclCollective::wait(CUevent_st* event) {
  Impl& m = *impl_;
  THINKV_RETURN_IF_ERROR(m.check_usable());
  return m.settle("waiting for the step (its all-reduces)", event);
}

void NcclCollective::abort(const std::string& why) {
  Impl& m = *impl_;
  if (m.comm != nullptr) (void)ncclCommAbort(m.comm);
  m.comm = nullptr;
  if (!m.broken) {
    m.broken = true;
    m.why = "this rank aborted: " + why;
  }
}

int NcclCollective::version() {
  int v = 0;
  (void)ncclGetVersion(&v);
  return v;
}

}  // namespace thinkv::decoder
