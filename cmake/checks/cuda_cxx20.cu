// Configure-time check (cmake/ThinkvCuda.cmake): nvcc compiles C++20 for host and device code.
#include <array>
#include <concepts>

#if __cplusplus < 202002L
#error "nvcc is not compiling C++20 (__cplusplus < 202002L): pass -std=c++20"
#endif

template <class T>
concept small_integral = std::integral<T> && sizeof(T) <= 4;

template <small_integral T>
__host__ __device__ constexpr T twice(T x) {
  return x + x;
}

// std::array::operator[] in device code needs --expt-relaxed-constexpr.
__global__ void check_kernel(int* out) {
  constexpr std::array<int, 2> a{1, 2};
  out[0] = twice(a[1]);
}

int main() { return twice(2) == 4 ? 0 : 1; }
