# Driver of the packaging tests (tests/packaging/CMakeLists.txt), run with cmake -P.
#   STEP=install   cmake --install THINKV_BUILD_DIR --prefix THINKV_PREFIX (fresh prefix)
#   STEP=consumer  configure + build + run CONSUMER_SOURCE_DIR against THINKV_PREFIX in WORK_DIR;
#                  with EXPECT_FAILURE, the configure step must fail with thinkv's message instead.
#   STEP=subdirectory  configure + build CONSUMER_SOURCE_DIR, which add_subdirectory()s
#                  THINKV_SOURCE_DIR, in WORK_DIR; thinkv's part of it must hold no install rule.
cmake_minimum_required(VERSION 3.25)

function(run_step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  message(STATUS "${what}:\n${out}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "packaging test: ${what} failed (exit ${rc})")
  endif()
endfunction()

if(STEP STREQUAL "install")
  file(REMOVE_RECURSE "${THINKV_PREFIX}")
  set(_config)
  if(CONFIG)
    set(_config --config "${CONFIG}")
  endif()
  run_step("install" "${CMAKE_COMMAND}" --install "${THINKV_BUILD_DIR}" --prefix "${THINKV_PREFIX}"
           ${_config})
  return()
endif()

if(STEP STREQUAL "subdirectory")
  file(REMOVE_RECURSE "${WORK_DIR}")
  set(_configure "${CMAKE_COMMAND}" -S "${CONSUMER_SOURCE_DIR}" -B "${WORK_DIR}" -G "${GENERATOR}"
      "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" "-DTHINKV_SOURCE_DIR=${THINKV_SOURCE_DIR}")
  if(CONFIG)
    list(APPEND _configure "-DCMAKE_BUILD_TYPE=${CONFIG}")
  endif()
  run_step("subdirectory consumer configure" ${_configure})
  file(READ "${WORK_DIR}/thinkv/cmake_install.cmake" _install)
  if(_install MATCHES "file\\(INSTALL")
    message(FATAL_ERROR "packaging test: thinkv under add_subdirectory() generated install rules")
  endif()
  run_step("subdirectory consumer build (the README quick start)" "${CMAKE_COMMAND}" --build "${WORK_DIR}")
  # ... and runs as it stands (no calib.json here: every token R).
  execute_process(COMMAND "${WORK_DIR}/quickstart" WORKING_DIRECTORY "${WORK_DIR}" RESULT_VARIABLE _rc
                  OUTPUT_VARIABLE _out ERROR_VARIABLE _err)
  message(STATUS "quickstart: ${_out}${_err}")
  if(NOT _rc EQUAL 0 OR NOT _out MATCHES "sequences fit in [0-9]+ bytes; sequence 0 holds [0-9]+ bytes; allocated [0-9]+")
    message(FATAL_ERROR "packaging test: the README quick start failed (exit ${_rc}): ${_out}${_err}")
  endif()
  return()
endif()

if(NOT STEP STREQUAL "consumer")
  message(FATAL_ERROR "packaging test: unknown STEP '${STEP}'")
endif()

file(REMOVE_RECURSE "${WORK_DIR}")
set(_configure "${CMAKE_COMMAND}" -S "${CONSUMER_SOURCE_DIR}" -B "${WORK_DIR}" -G "${GENERATOR}"
    "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}"
    "-DCMAKE_PREFIX_PATH=${THINKV_PREFIX}"
    "-DTHINKV_EXPECTED_PREFIX=${THINKV_PREFIX}"
    "-DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF"
    "-DTHINKV_CONSUMER_WITH_KERNELS=${WITH_KERNELS}")
if(CONFIG)
  list(APPEND _configure "-DCMAKE_BUILD_TYPE=${CONFIG}")
endif()
if(CUDA_ROOT)
  list(APPEND _configure "-DCUDAToolkit_ROOT=${CUDA_ROOT}")
endif()

if(EXPECT_FAILURE)
  execute_process(COMMAND ${_configure} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  message(STATUS "consumer configure (expected to fail):\n${out}")
  if(rc EQUAL 0)
    message(FATAL_ERROR "packaging test: find_package(thinkv COMPONENTS kernels) succeeded "
                        "against an install without kernels")
  endif()
  string(REGEX REPLACE "[ \t\r\n]+" " " out "${out}")  # CMake wraps the message
  set(_expected "component 'kernels' was requested, but the thinkv install at .* was built without CUDA")
  if(NOT out MATCHES "${_expected}")
    message(FATAL_ERROR "packaging test: find_package failed without thinkv's message")
  endif()
  return()
endif()

run_step("consumer configure" ${_configure})
run_step("consumer build" "${CMAKE_COMMAND}" --build "${WORK_DIR}")
execute_process(COMMAND "${WORK_DIR}/thinkv_consumer"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
message(STATUS "consumer run:\n${out}")
if(NOT rc EQUAL 0 OR NOT out MATCHES "thinkv consumer: ok")
  message(FATAL_ERROR "packaging test: the consumer failed (exit ${rc})")
endif()
