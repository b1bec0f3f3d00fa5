# CUDA detection and flags for thinkv.
#
#   thinkv_detect_cuda_compiler(<out>)  <out> = ON if check_language(CUDA) finds a CUDA compiler
#   thinkv_enable_cuda()                enable_language(CUDA), find_package(CUDAToolkit), and a
#                                       configure-time check that nvcc really compiles C++20
#   thinkv_cuda_target(<target>)        thinkv's CUDA settings on one target (architectures,
#                                       shared cudart, C++20 flags)
include_guard(GLOBAL)

set(_THINKV_CUDA_MODULE_DIR "${CMAKE_CURRENT_LIST_DIR}")

function(thinkv_detect_cuda_compiler out)
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(${out} ON PARENT_SCOPE)
  else()
    message(STATUS "thinkv: no CUDA compiler found: CPU-only build "
                   "(pass -DCMAKE_CUDA_COMPILER=/path/to/nvcc to enable CUDA)")
    set(${out} OFF PARENT_SCOPE)
  endif()
endfunction()

macro(thinkv_enable_cuda)
  # Set the architectures before enable_language so the compiler checks and any target created
  # without thinkv_cuda_target() use them too; a parent project's setting wins.
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES "${THINKV_CUDA_ARCHITECTURES}")
  endif()
  # One CUDA runtime per process: every thinkv CUDA target uses the shared libcudart (see
  # kernels/CMakeLists.txt for why), so nvcc-linked executables must not add cudart_static.
  if(NOT DEFINED CMAKE_CUDA_RUNTIME_LIBRARY)
    set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
  endif()
  enable_language(CUDA)
  find_package(CUDAToolkit REQUIRED)
  _thinkv_check_cuda_cxx20()
endmacro()

# CMake 3.25 with nvcc 13 reports no CUDA C++20 feature: CUDA_STANDARD 20 silently compiles .cu as
# C++17 and `concept` fails. We pass -std=c++20 ourselves (thinkv_core's INTERFACE options) and
# prove here, once per build tree, that nvcc accepts it for a concept in host and device code.
function(_thinkv_check_cuda_cxx20)
  if(DEFINED CACHE{THINKV_CUDA_CXX20_WORKS} AND THINKV_CUDA_CXX20_WORKS)
    return()
  endif()
  set(_dir "${CMAKE_BINARY_DIR}/CMakeFiles/thinkv_cuda_cxx20_check")
  # try_compile passes the project's CMAKE_CUDA_ARCHITECTURES on; the flags are the ones thinkv
  # targets get (COMPILE_DEFINITIONS takes arbitrary compiler flags).
  try_compile(_ok "${_dir}" "${_THINKV_CUDA_MODULE_DIR}/checks/cuda_cxx20.cu"
    COMPILE_DEFINITIONS -std=c++20 --expt-relaxed-constexpr
    OUTPUT_VARIABLE _out)
  if(NOT _ok)
    message(FATAL_ERROR
      "thinkv: the CUDA compiler ${CMAKE_CUDA_COMPILER} (${CMAKE_CUDA_COMPILER_VERSION}) did not "
      "compile a C++20 concept with '-std=c++20 --expt-relaxed-constexpr' for "
      "CUDA architectures '${CMAKE_CUDA_ARCHITECTURES}'.\n"
      "thinkv needs nvcc >= 12 with a C++20 host compiler (g++ >= 10). "
      "Configure with -DTHINKV_ENABLE_CUDA=OFF for a CPU-only build.\nCompiler output:\n${_out}")
  endif()
  set(THINKV_CUDA_CXX20_WORKS ON CACHE INTERNAL "nvcc compiles C++20 with -std=c++20")
  message(STATUS "thinkv: nvcc compiles C++20 (-std=c++20) - ok")
endfunction()

function(thinkv_cuda_target target)
  set_target_properties(${target} PROPERTIES
    CUDA_ARCHITECTURES "${THINKV_CUDA_ARCHITECTURES}"
    CUDA_RUNTIME_LIBRARY Shared
    CUDA_SEPARABLE_COMPILATION OFF)
  # -std=c++20 and --expt-relaxed-constexpr reach CUDA sources through thinkv::core; add them here
  # too for targets that compile .cu files without linking thinkv::core.
  target_compile_options(${target} PRIVATE
    "$<$<COMPILE_LANGUAGE:CUDA>:-std=c++20>"
    "$<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr>")
endfunction()
