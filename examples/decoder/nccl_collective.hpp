#pragma once
/// \file nccl_collective.hpp
/// NcclCollective: collective.hpp's Collective over NCCL (one rank per GPU; ranks in one process
/// as threads or in one process each). Built when CMake finds NCCL (nccl.h and libnccl, looked
/// for beside the CUDA toolkit or under NCCL_ROOT): target thinkv_nccl, which defines
/// THINKV_HAVE_NCCL for its users.
///
/// Setting up a group: rank 0 calls unique_id() and hands the bytes to every rank (a file, a
/// pipe, the launcher's environment: NCCL does not care how); each rank then makes its GPU
/// current (cudaSetDevice) and calls create() with its rank. The communicator is NCCL's
/// non-blocking kind, so that nothing waits without a deadline: creation, every enqueue, wait()
/// and all_reduce_host() poll NCCL's asynchronous error and the clock, and a call that passes
/// `timeout` aborts the communicator (ncclCommAbort) and fails with kCudaError saying so. NVLink
/// multicast (NVLS) is left as the environment sets it (NCCL_NVLS_ENABLE).

#include <chrono>
#include <memory>
#include <string>

#include "collective.hpp"

namespace thinkv::decoder {

class NcclCollective final : public Collective {
 public:
  /// A fresh group id (NCCL_UNIQUE_ID_BYTES = 128 bytes) for create().
  [[nodiscard]] static Status unique_id(std::string& out);
  /// Rank `rank` of `size` on the current CUDA device, joining the group `id` names.
  [[nodiscard]] static Status create(const std::string& id, int rank, int size, std::chrono::milliseconds timeout,
                                     std::unique_ptr<NcclCollective>& out);
  ~NcclCollective() override;
  NcclCollective(const NcclCollective&) = delete;
  NcclCollective& operator=(const NcclCollective&) = delete;

  int rank() const noexcept override;
  int size() const noexcept override;
  Status all_reduce(float* buf, std::size_t count, CUstream_st* stream) override;
  Status all_reduce_host(std::span<double> values, CUstream_st* stream) override;
  Status wait(CUevent_st* event) override;
  void abort(const std::string& why) override;
  bool broken() const override;
  /// The NCCL version the library runs with (ncclGetVersion), e.g. 22809.
  [[nodiscard]] static int version();

 private:
  struct Impl;
  explicit NcclCollective(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace thinkv::decoder
