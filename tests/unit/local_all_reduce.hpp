#pragma once
// An in-process all-reduce for the tensor-parallel tests (tests/unit/test_tensor_parallel.cpp,
// tests/kernels/test_cuda_tensor_parallel.cpp): ThinKvCache::set_signal_reduction's collective
// for ranks that are threads of one process (NCCL's across GPUs).

#include <barrier>
#include <span>
#include <vector>

#include "thinkv/status.hpp"

namespace tt {

/// An in-process all-reduce over `ranks` threads: each rank's buffer summed element-wise in rank
/// order, the same result on every rank. Rank r's call blocks until every rank called.
class LocalAllReduce {
 public:
  explicit LocalAllReduce(int ranks) : ranks_(ranks), slots_(static_cast<std::size_t>(ranks)), sync_(ranks) {}
  thinkv::Status operator()(int rank, std::span<double> x) {
    slots_[static_cast<std::size_t>(rank)].assign(x.begin(), x.end());
    sync_.arrive_and_wait();
    for (std::size_t i = 0; i < x.size(); ++i) {
      double sum = 0.0;
      for (int r = 0; r < ranks_; ++r) sum += slots_[static_cast<std::size_t>(r)].at(i);
      x[i] = sum;
    }
    ++calls_[static_cast<std::size_t>(rank)];
    sync_.arrive_and_wait();  // every rank read the slots before any writes them again
    return thinkv::Status::ok();
  }
  [[nodiscard]] int calls(int rank) const { return calls_[static_cast<std::size_t>(rank)]; }

 private:
  int ranks_;
  std::vector<std::vector<double>> slots_;
  std::barrier<> sync_;
  int calls_[8] = {};
};

}  // namespace tt
