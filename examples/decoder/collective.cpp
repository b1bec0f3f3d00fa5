/// \file collective.cpp
/// LocalGroup (collective.hpp): ranks as threads of one process, sums on the host.

#include "collective.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <vector>

namespace thinkv::decoder {

struct LocalGroup::State {
  int size = 0;
  std::chrono::milliseconds timeout{0};
  std::mutex m;
  std::condition_variable cv;
  std::vector<std::vector<double>> slots;  // each rank's values of the current round
  std::vector<double> sums;                // the last completed round's sums
  std::vector<char> in_round;              // which ranks arrived in the current round
  int arrived = 0;
  std::uint64_t round = 0;  // completed rounds
  bool broken = false;
  std::string why;  // what broke the group
  std::vector<std::unique_ptr<Rank>> ranks;

  /// One round: rank r's values in, every rank's sum out (in rank order, double).
  Status exchange(int r, std::span<double> x) {
    std::unique_lock lk(m);
    if (broken) return failed(r);
    if (in_round[static_cast<std::size_t>(r)] != 0) {  // a second call before the others' first
      broken = true;
      why = "rank " + std::to_string(r) + " made a call the other ranks did not";
      cv.notify_all();
      return failed(r);
    }
    in_round[static_cast<std::size_t>(r)] = 1;
    slots[static_cast<std::size_t>(r)].assign(x.begin(), x.end());
    const std::uint64_t mine = round;
    if (++arrived == size) {
      for (const auto& s : slots) {
        if (s.size() != x.size()) {
          broken = true;
          why = "the ranks passed different counts to one all-reduce";
          cv.notify_all();
          return failed(r);
        }
      }
      sums.assign(x.size(), 0.0);
      for (const auto& s : slots) {
        for (std::size_t i = 0; i < x.size(); ++i) sums[i] += s[i];
      }
      for (auto& s : slots) s.clear();
      std::fill(in_round.begin(), in_round.end(), char{0});
      arrived = 0;
      ++round;
      cv.notify_all();
    } else if (!cv.wait_for(lk, timeout, [&] { return round != mine || broken; })) {
      broken = true;
      why = "rank " + std::to_string(r) + " waited " + std::to_string(timeout.count()) +
            " ms for the other ranks (a rank failed or stopped)";
      cv.notify_all();
      return failed(r);
    }
    if (round == mine) return failed(r);  // broken while waiting
    std::copy(sums.begin(), sums.end(), x.begin());
    return Status::ok();
  }
  Status failed(int r) const {
    return {StatusCode::kCudaError, "tensor parallelism, rank " + std::to_string(r) + ": all-reduce failed: " + why};
  }
};

class LocalGroup::Rank final : public Collective {
 public:
  Rank(State& s, int r) : s_(s), r_(r) {}
  int rank() const noexcept override { return r_; }
  int size() const noexcept override { return s_.size; }
  Status all_reduce(float* buf, std::size_t count, CUstream_st* stream) override {
    std::vector<float> h(count);
    THINKV_RETURN_IF_ERROR(
        cuda(cudaMemcpyAsync(h.data(), buf, count * sizeof(float), cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync"));
    THINKV_RETURN_IF_ERROR(cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize"));
    std::vector<double> d(h.begin(), h.end());
    THINKV_RETURN_IF_ERROR(s_.exchange(r_, d));
    for (std::size_t i = 0; i < count; ++i) h[i] = static_cast<float>(d[i]);
    THINKV_RETURN_IF_ERROR(
        cuda(cudaMemcpyAsync(buf, h.data(), count * sizeof(float), cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync"));
    return cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");  // h goes out of scope
  }
  Status all_reduce_host(std::span<double> values, CUstream_st* stream) override {
    THINKV_RETURN_IF_ERROR(cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize"));
    return s_.exchange(r_, values);
  }
  Status wait(CUevent_st* event) override { return cuda(cudaEventSynchronize(event), "cudaEventSynchronize"); }
  void abort(const std::string& why) override {
    const std::lock_guard lk(s_.m);
    if (!s_.broken) {
      s_.broken = true;
      s_.why = "rank " + std::to_string(r_) + " aborted: " + why;
    }
    s_.cv.notify_all();
  }
  bool broken() const override {
    const std::lock_guard lk(s_.m);
    return s_.broken;
  }

 private:
  Status cuda(cudaError_t e, const char* what) const {
    if (e == cudaSuccess) return Status::ok();
    (void)cudaGetLastError();
    return {StatusCode::kCudaError,
            "tensor parallelism, rank " + std::to_string(r_) + ": " + what + ": " + cudaGetErrorString(e)};
  }
  State& s_;
  int r_;
};

LocalGroup::LocalGroup(int size, std::chrono::milliseconds timeout) : state_(std::make_unique<State>()) {
  if (size < 1) throw std::invalid_argument("LocalGroup: size " + std::to_string(size) + " (at least 1)");
  state_->size = size;
  state_->timeout = timeout;
  state_->slots.resize(static_cast<std::size_t>(size));
  state_->in_round.assign(static_cast<std::size_t>(size), 0);
  for (int r = 0; r < size; ++r) state_->ranks.push_back(std::make_unique<Rank>(*state_, r));
}
LocalGroup::~LocalGroup() = default;
int LocalGroup::size() const noexcept { return state_->size; }
Collective& LocalGroup::rank(int r) {
  if (r < 0 || r >= state_->size) {
    throw std::out_of_range("LocalGroup: rank " + std::to_string(r) + " of " + std::to_string(state_->size));
  }
  return *state_->ranks[static_cast<std::size_t>(r)];
}

}  // namespace thinkv::decoder
