# Install and export rules: headers, thinkv::core, thinkv::calibration, thinkv::kernels (when
# built), and a CMake package supporting
# `find_package(thinkv CONFIG REQUIRED COMPONENTS core calibration kernels)`.
# Included from the top-level CMakeLists.txt after the library targets exist.
include_guard(GLOBAL)
include(CMakePackageConfigHelpers)

set(THINKV_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/thinkv" CACHE STRING
    "Where thinkvConfig.cmake is installed, relative to the prefix")

# Headers. The kernel API headers (include/thinkv/kernels/) declare functions defined only in
# libthinkv_kernels, so a CPU-only install leaves them out.
if(THINKV_HAS_KERNELS)
  install(DIRECTORY "${PROJECT_SOURCE_DIR}/include/thinkv"
          DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}" COMPONENT thinkv_development
          FILES_MATCHING PATTERN "*.hpp" PATTERN "*.h")
else()
  install(DIRECTORY "${PROJECT_SOURCE_DIR}/include/thinkv"
          DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}" COMPONENT thinkv_development
          FILES_MATCHING PATTERN "*.hpp" PATTERN "*.h" PATTERN "kernels" EXCLUDE)
endif()

# One export set per package component, so the config loads only what was asked for (and needs
# CUDAToolkit only when kernels is).
install(TARGETS thinkv_core EXPORT thinkvCoreTargets)
install(EXPORT thinkvCoreTargets NAMESPACE thinkv:: FILE thinkvCoreTargets.cmake
        DESTINATION "${THINKV_INSTALL_CMAKEDIR}" COMPONENT thinkv_development)
if(THINKV_HAS_CALIBRATION)
  install(TARGETS thinkv_calibration EXPORT thinkvCalibrationTargets)
  install(EXPORT thinkvCalibrationTargets NAMESPACE thinkv:: FILE thinkvCalibrationTargets.cmake
          DESTINATION "${THINKV_INSTALL_CMAKEDIR}" COMPONENT thinkv_development)
endif()
if(THINKV_HAS_KERNELS)
  install(TARGETS thinkv_kernels EXPORT thinkvKernelsTargets
          ARCHIVE DESTINATION "${CMAKE_INSTALL_LIBDIR}" COMPONENT thinkv_development)
  install(EXPORT thinkvKernelsTargets NAMESPACE thinkv:: FILE thinkvKernelsTargets.cmake
          DESTINATION "${THINKV_INSTALL_CMAKEDIR}" COMPONENT thinkv_development)
endif()

configure_package_config_file("${CMAKE_CURRENT_LIST_DIR}/thinkvConfig.cmake.in"
  "${PROJECT_BINARY_DIR}/thinkvConfig.cmake"
  INSTALL_DESTINATION "${THINKV_INSTALL_CMAKEDIR}")
# 0.x: a minor version bump may break the API, so only the same minor version is compatible.
write_basic_package_version_file("${PROJECT_BINARY_DIR}/thinkvConfigVersion.cmake"
  VERSION "${PROJECT_VERSION}" COMPATIBILITY SameMinorVersion)
install(FILES "${PROJECT_BINARY_DIR}/thinkvConfig.cmake"
              "${PROJECT_BINARY_DIR}/thinkvConfigVersion.cmake"
        DESTINATION "${THINKV_INSTALL_CMAKEDIR}" COMPONENT thinkv_development)
