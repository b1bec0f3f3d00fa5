// Uses an installed thinkv through find_package (tests/packaging/).
#if __has_include(<thinkv/thinkv.hpp>)
#include <thinkv/thinkv.hpp>
#endif
#include <thinkv/calibration.hpp>  // the calibration component
#include <thinkv/status.hpp>
#include <thinkv/types.hpp>

#include <iostream>

#if defined(THINKV_CONSUMER_WITH_KERNELS)
#include <cuda_runtime_api.h>  // reachable through thinkv::kernels -> CUDA::cudart
#endif

int main() {
  const thinkv::Status status(thinkv::StatusCode::kUnsupported, "consumer check");
  std::cout << "thinkv " << THINKV_FOUND_VERSION << ": " << thinkv::ThoughtType::kReasoning << " has importance "
            << thinkv::importance(thinkv::ThoughtType::kReasoning) << ", NVFP4 stores "
            << thinkv::bits_of(thinkv::Precision::kNvfp4) << " bits per element, status prints as '" << status << "'\n";
#if defined(THINKV_CONSUMER_WITH_KERNELS)
  int runtime_version = 0;  // needs libcudart, not a GPU
  if (cudaRuntimeGetVersion(&runtime_version) != cudaSuccess) return 1;
  std::cout << "linked thinkv::kernels, CUDA runtime " << runtime_version << "\n";
#endif
  const thinkv::CalibrationFile calib;  // from thinkv::calibration
  std::cout << "calibration component: " << calib.thresholds.size() << " thresholds by default\n";
  std::cout << "thinkv consumer: ok\n";
  return 0;
}
