#pragma once
/// \file config.hpp
/// Compiler portability macros shared by host-only and CUDA translation units.

#if defined(__CUDACC__)
/// Marks a function usable from host and device code (expands to nothing for plain C++ compilers).
#define THINKV_HD __host__ __device__
#else
#define THINKV_HD
#endif

#if defined(__CUDACC__)
#define THINKV_FORCEINLINE __forceinline__
#else
#define THINKV_FORCEINLINE inline __attribute__((always_inline))
#endif
