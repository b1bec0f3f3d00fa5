// GPU test: the thought classifier lowered to its POD (ThoughtClassifierDesc, thinkv/thought/
// classifier.hpp) classifies on the device exactly as on the host. A kernel takes the descriptor by
// value and calls thinkv::classify / thinkv::thought_band on a fresh random array of sparsities;
// every result is compared with the host's classify(desc, s) and ThoughtClassifier::classify(s),
// bit for bit (they are integer outcomes of FP32 comparisons: no tolerance). Classifiers: 1, 2 and
// 3 bands, random ascending thresholds, every band -> type permutation, L* masks over up to 256
// layers. Sparsities: uniform in [0,1], exactly the thresholds and one FP32 step either side, 0, 1,
// values outside [0,1], +-0, +-inf and NaN (every comparison false: band 0). Fresh seed per run
// (printed; THINKV_TEST_SEED pins it). Without a GPU it prints the skip message and exits 77.

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda_check.hpp"
#include "thinkv/thought/classifier.hpp"

static_assert(std::is_trivially_copyable_v<thinkv::ThoughtClassifierDesc>,
              "ThoughtClassifierDesc is passed to kernels by value");

namespace {

/// out_type[i] = classify(d, s[i]), out_band[i] = thought_band(d, s[i]); d is a kernel parameter.
__global__ void classify_kernel(thinkv::ThoughtClassifierDesc d,
                                const float* s,          // [n] sparsity signals
                                std::uint8_t* out_type,  // [n] ThoughtType of each signal
                                std::int32_t* out_band,  // [n] band of each signal
                                int n) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i >= n) return;
  out_type[i] = static_cast<std::uint8_t>(thinkv::classify(d, s[i]));
  out_band[i] = thinkv::thought_band(d, s[i]);
}

/// A random valid classifier of `bands` bands over `num_layers` layers.
thinkv::ThoughtClassifier random_classifier(std::mt19937& rng, int bands, int num_layers) {
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<float> th;
  while (static_cast<int>(th.size()) < bands - 1) {
    const float t = u(rng);
    if (t > 0.0f && t < 1.0f && std::find(th.begin(), th.end(), t) == th.end()) th.push_back(t);
  }
  std::sort(th.begin(), th.end());
  std::vector<thinkv::ThoughtType> types = {thinkv::ThoughtType::kReasoning, thinkv::ThoughtType::kExecution,
                                            thinkv::ThoughtType::kTransition};
  std::shuffle(types.begin(), types.end(), rng);
  types.resize(static_cast<std::size_t>(bands));
  std::vector<int> layers;
  for (int l = 0; l < num_layers; ++l) {
    if (rng() % 5 == 0) layers.push_back(l);
  }
  if (layers.empty()) layers.push_back(static_cast<int>(rng() % static_cast<unsigned>(num_layers)));
  const int tau = 16 * (1 + static_cast<int>(rng() % 16));
  return thinkv::ThoughtClassifier(th, layers, tau, types, num_layers);
}

/// The signals of one case: random shares plus every edge the band rule has.
std::vector<float> signals(std::mt19937& rng, const thinkv::ThoughtClassifier& c, int n_random) {
  std::uniform_real_distribution<float> u(0.0f, 1.0f), wide(-0.5f, 1.5f);
  std::vector<float> s;
  for (int i = 0; i < n_random; ++i) s.push_back(i % 8 == 7 ? wide(rng) : u(rng));
  for (float t : c.thresholds()) {
    s.push_back(t);
    s.push_back(std::nextafter(t, -INFINITY));
    s.push_back(std::nextafter(t, INFINITY));
  }
  const float inf = std::numeric_limits<float>::infinity();
  for (float x : {0.0f, -0.0f, 1.0f, -1.0f, 2.0f, inf, -inf, std::numeric_limits<float>::quiet_NaN(),
                  std::numeric_limits<float>::denorm_min(), std::nextafter(1.0f, 0.0f)}) {
    s.push_back(x);
  }
  std::shuffle(s.begin(), s.end(), rng);
  return s;
}

int failures = 0;

void run_case(std::mt19937& rng, int bands, int num_layers, int n_random) {
  const thinkv::ThoughtClassifier c = random_classifier(rng, bands, num_layers);
  const thinkv::ThoughtClassifierDesc d = c.lower();
  const std::vector<float> s = signals(rng, c, n_random);
  const int n = static_cast<int>(s.size());

  float* ds = nullptr;
  std::uint8_t* dt = nullptr;
  std::int32_t* db = nullptr;
  CHECK_CUDA(cudaMalloc(&ds, s.size() * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&dt, s.size()));
  CHECK_CUDA(cudaMalloc(&db, s.size() * sizeof(std::int32_t)));
  CHECK_CUDA(cudaMemcpy(ds, s.data(), s.size() * sizeof(float), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemset(dt, 0xA5, s.size()));  // poison: 0xA5 is no thought type
  CHECK_CUDA(cudaMemset(db, 0xA5, s.size() * sizeof(std::int32_t)));
  const int block = 256;
  classify_kernel<<<(n + block - 1) / block, block>>>(d, ds, dt, db, n);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<std::uint8_t> got_type(s.size());
  std::vector<std::int32_t> got_band(s.size());
  CHECK_CUDA(cudaMemcpy(got_type.data(), dt, s.size(), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(got_band.data(), db, s.size() * sizeof(std::int32_t), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaFree(ds));
  CHECK_CUDA(cudaFree(dt));
  CHECK_CUDA(cudaFree(db));

  int bad = 0;
  for (int i = 0; i < n; ++i) {
    const float x = s[static_cast<std::size_t>(i)];
    const auto want_type = static_cast<std::uint8_t>(thinkv::classify(d, x));
    const int want_band = thinkv::thought_band(d, x);
    // The host descriptor agrees with the policy it was lowered from (the device must match both).
    const bool host_ok = want_type == static_cast<std::uint8_t>(c.classify(x));
    const bool dev_ok =
        got_type[static_cast<std::size_t>(i)] == want_type && got_band[static_cast<std::size_t>(i)] == want_band;
    if (!host_ok || !dev_ok) {
      if (bad < 5) {
        std::printf("  signal %a (%g): device type %d band %d, host desc type %d band %d, policy type %d\n",
                    static_cast<double>(x), static_cast<double>(x), got_type[static_cast<std::size_t>(i)],
                    got_band[static_cast<std::size_t>(i)], want_type, want_band, static_cast<int>(c.classify(x)));
      }
      ++bad;
    }
  }
  std::string text;
  for (int b = 0; b < c.num_bands(); ++b) {
    if (b > 0) text += "|" + std::to_string(c.thresholds()[static_cast<std::size_t>(b) - 1]) + "|";
    text += std::string(thinkv::to_string(c.band_types()[static_cast<std::size_t>(b)]));
  }
  std::printf("%s classify bands %s, |L*| = %zu of %d layers: %d signals, %d mismatches\n", bad ? "FAIL" : "ok  ",
              text.c_str(), c.layers().size(), num_layers, n, bad);
  failures += bad != 0;
}

}  // namespace

int main() {
  const unsigned seed = gpu_test_start();
  std::mt19937 rng(seed);
  int cases = 0;
  for (int bands = 1; bands <= thinkv::kMaxThoughtBands; ++bands) {
    for (int num_layers : {1, 5, 64, 65, thinkv::kMaxClassifierLayers}) {
      for (int rep = 0; rep < 4; ++rep) {
        run_case(rng, bands, num_layers, rep == 0 ? 100 : 100000);
        ++cases;
      }
    }
  }
  std::printf("%d passed, %d failed\n", cases - failures, failures);
  return failures ? 1 : 0;
}
