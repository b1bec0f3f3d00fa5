# headers.runtime_umbrella (cmake -P): <thinkv/thinkv.hpp> is the runtime only. The preprocessor's
# dependency list of a TU that includes it (-M) must not name the offline tooling (traces, KDE
# calibration, the calibration file, the JSON parser, plots: <thinkv/calibration.hpp>) nor any CUDA
# or kernel header.
#   -DCXX=<compiler> -DINCLUDE_DIR=<repo>/include -DWORK_DIR=<scratch>
cmake_minimum_required(VERSION 3.25)
file(MAKE_DIRECTORY "${WORK_DIR}")
file(WRITE "${WORK_DIR}/umbrella.cpp" "#include <thinkv/thinkv.hpp>\nint main() { return 0; }\n")
execute_process(COMMAND "${CXX}" -std=c++20 -I "${INCLUDE_DIR}" -M "${WORK_DIR}/umbrella.cpp"
                RESULT_VARIABLE rc OUTPUT_VARIABLE deps ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "headers.runtime_umbrella: the preprocessor failed (exit ${rc}):\n${err}")
endif()
set(_bad)
foreach(_h thought/calibration.hpp thought/calibration_file.hpp thought/trace.hpp
           thought/density_plot.hpp nlohmann/ kernels/ cuda_runtime cuda_backend.hpp)
  string(FIND "${deps}" "${_h}" _pos)
  if(NOT _pos EQUAL -1)
    list(APPEND _bad "${_h}")
  endif()
endforeach()
if(_bad)
  message(FATAL_ERROR "headers.runtime_umbrella: <thinkv/thinkv.hpp> pulls in ${_bad}; the tooling "
                      "belongs to <thinkv/calibration.hpp>, CUDA to thinkv::kernels.\n${deps}")
endif()
string(REGEX MATCHALL "include/thinkv/[^ \\\n]+" _ours "${deps}")
list(LENGTH _ours _n)
message(STATUS "headers.runtime_umbrella: <thinkv/thinkv.hpp> includes ${_n} thinkv headers, no tooling")
