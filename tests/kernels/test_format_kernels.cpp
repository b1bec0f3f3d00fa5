// GPU test: the batched group quantizer (thinkv::kernels) against the CPU reference encoders.
// Fresh random inputs per run (seed printed; THINKV_TEST_SEED pins it), outputs poisoned before
// the launch, codes and scales compared bit for bit. Exits 77 (ctest: skipped) without a GPU.

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "cuda_check.hpp"
#include "thinkv/formats/group_quant.hpp"
#include "thinkv/kernels/format_kernels.hpp"

namespace {

int failures = 0;

void run_case(thinkv::Precision p, int g, int num_groups, float spread, std::mt19937& rng) {
  std::student_t_distribution<float> heavy(3.0f);
  std::vector<float> x(static_cast<std::size_t>(num_groups) * g);
  for (auto& v : x) v = heavy(rng) * spread;
  const float s2 = thinkv::choose_stream_scale(p, thinkv::group_amax(x.data(), 1, g));
  std::vector<std::uint8_t> want_codes(x.size()), want_scales(num_groups);
  for (int i = 0; i < num_groups; ++i) {
    want_scales[i] = thinkv::quantize_group(p, x.data() + i * g, 1, g, s2, want_codes.data() + i * g, 1);
  }
  float* dx = nullptr;
  std::uint8_t *dc = nullptr, *ds = nullptr;
  CHECK_CUDA(cudaMalloc(&dx, x.size() * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&dc, x.size()));
  CHECK_CUDA(cudaMalloc(&ds, num_groups));
  CHECK_CUDA(cudaMemcpy(dx, x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemset(dc, 0xA5, x.size()));  // poison
  CHECK_CUDA(cudaMemset(ds, 0xA5, num_groups));
  thinkv::kernels::QuantizeGroupsParams prm;
  prm.precision = p;
  prm.num_groups = num_groups;
  prm.group_size = g;
  prm.element_stride = 1;
  prm.group_stride = g;
  prm.s2 = s2;
  prm.x = dx;
  prm.codes = dc;
  prm.scales = ds;
  CHECK_CUDA(thinkv::kernels::launch_quantize_groups(prm, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<std::uint8_t> got_codes(x.size()), got_scales(num_groups);
  CHECK_CUDA(cudaMemcpy(got_codes.data(), dc, x.size(), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(got_scales.data(), ds, num_groups, cudaMemcpyDeviceToHost));
  int bad = 0;
  for (std::size_t i = 0; i < x.size(); ++i) bad += got_codes[i] != want_codes[i];
  for (int i = 0; i < num_groups; ++i) bad += got_scales[i] != want_scales[i];
  std::printf("%s quantize_groups %-9s g=%2d groups=%6d spread=%g: %d mismatches\n", bad ? "FAIL" : "ok  ",
              std::string(thinkv::to_string(p)).c_str(), g, num_groups, static_cast<double>(spread), bad);
  failures += bad != 0;
  CHECK_CUDA(cudaFree(dx));
  CHECK_CUDA(cudaFree(dc));
  CHECK_CUDA(cudaFree(ds));
}

}  // namespace

int main() {
  const unsigned seed = gpu_test_start();
  std::mt19937 rng(seed);
  for (thinkv::Precision p : {thinkv::Precision::kFp8E4M3, thinkv::Precision::kNvfp4, thinkv::Precision::kTernary}) {
    for (int g : {8, 16, 32}) {
      for (float spread : {1e-3f, 1.0f, 300.0f}) run_case(p, g, 20000, spread, rng);
    }
  }
  // Bad parameters are refused before launch.
  thinkv::kernels::QuantizeGroupsParams bad;
  bad.group_size = 65;
  if (thinkv::kernels::launch_quantize_groups(bad, nullptr) != cudaErrorInvalidValue) {
    std::printf("FAIL group_size 65 was not refused\n");
    ++failures;
  }
  std::printf("%d passed, %d failed\n", failures ? 0 : 1, failures ? 1 : 0);
  return failures ? 1 : 0;
}
