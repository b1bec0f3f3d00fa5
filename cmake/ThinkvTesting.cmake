# Helpers for thinkv's test executables.
#
#   thinkv_add_test_executable(<target> SOURCES <src>... LABEL <label> [GPU] [LIBRARIES <lib>...])
#
# One executable per test source, registered with ctest under label <label>:
#  - a Catch2 v2 source without main (the normal case) links thinkv_catch_main (and with GPU
#    thinkv_catch_cuda_gate: main exits 77 when there is no CUDA device), and every TEST_CASE
#    becomes its own ctest test "<target>.<test case name>" (catch_discover_tests, at build time);
#  - a Catch2 source with its own main (CATCH_CONFIG_MAIN/RUNNER) is discovered the same way;
#  - a source that does not use Catch2 is one ctest test "<target>" (exit 0 = pass).
# GPU tests get SKIP_RETURN_CODE 77, so "no CUDA device" reads as skipped, not passed or failed.
# Any test printing a line "SKIPPED: ..." is reported as skipped too.
include_guard(GLOBAL)

function(thinkv_add_test_executable target)
  cmake_parse_arguments(ARG "GPU" "LABEL" "SOURCES;LIBRARIES" ${ARGN})
  add_executable(${target} ${ARG_SOURCES})
  target_link_libraries(${target} PRIVATE thinkv::core thinkv::calibration ${ARG_LIBRARIES})
  thinkv_target_warnings(${target})

  set(_uses_catch FALSE)
  set(_has_main FALSE)
  foreach(_src IN LISTS ARG_SOURCES)
    file(STRINGS "${_src}" _catch_lines REGEX "#[ \t]*include[ \t]*[<\"]catch2/catch\\.hpp[>\"]")
    file(STRINGS "${_src}" _main_lines
         REGEX "CATCH_CONFIG_(MAIN|RUNNER)|(^|[ \t])int[ \t]+main[ \t]*\\(")
    if(_catch_lines)
      set(_uses_catch TRUE)
    endif()
    if(_main_lines)
      set(_has_main TRUE)
    endif()
  endforeach()

  # A test that cannot run here (e.g. the real model files are missing) prints a line starting
  # "SKIPPED: " with what to fetch; ctest then reports it as skipped, never as passed.
  set(_props LABELS ${ARG_LABEL} SKIP_REGULAR_EXPRESSION "SKIPPED: ")
  if(ARG_GPU)
    thinkv_cuda_target(${target})
    target_link_libraries(${target} PRIVATE CUDA::cudart)
    list(APPEND _props SKIP_RETURN_CODE 77)
  endif()

  if(NOT _uses_catch)
    add_test(NAME ${target} COMMAND ${target})
    set_tests_properties(${target} PROPERTIES ${_props})
    return()
  endif()
  target_link_libraries(${target} PRIVATE Catch2::Catch2)
  if(NOT _has_main)
    target_link_libraries(${target} PRIVATE thinkv_catch_main)
    if(ARG_GPU)
      target_link_libraries(${target} PRIVATE thinkv_catch_cuda_gate)
    endif()
  endif()
  # --warn NoTests: a test name ctest mangles (a ";" splits it) matches nothing and fails loudly
  # instead of passing without running.
  catch_discover_tests(${target} TEST_PREFIX "${target}." EXTRA_ARGS --warn NoTests PROPERTIES ${_props})
endfunction()
