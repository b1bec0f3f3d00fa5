# thinkv_target_warnings(<target>): warnings for thinkv's own compiled targets (never put on
# thinkv::core's INTERFACE, which would impose them on consumers). THINKV_WERROR turns them into
# errors through COMPILE_WARNING_AS_ERROR (-Werror for g++, "-Werror all-warnings" for nvcc), which
# a user can still override with `cmake --compile-no-warning-as-error`.
include_guard(GLOBAL)

function(thinkv_target_warnings target)
  set(_gcc12 "$<AND:$<COMPILE_LANG_AND_ID:CXX,GNU>,$<VERSION_LESS:$<CXX_COMPILER_VERSION>,13>>")
  target_compile_options(${target} PRIVATE
    "$<$<COMPILE_LANGUAGE:CXX>:-Wall;-Wextra;-Wpedantic>"
    # GCC 12 (Debian 12's g++ 12.2) warns falsely with -Wrestrict on `"literal" + std::string`
    # once inlined at -O2/-O3 (GCC bug 105329); with -Werror that breaks any TU
    # that builds a message string.
    "$<${_gcc12}:-Wno-restrict>"
    # nvcc forwards these to the host compiler; -Wpedantic is left out because nvcc's generated
    # host code (line markers, stub registration) is not pedantic-clean.
    "$<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>"
    # The same GCC 12 false positive in .cu host code (nvcc's host compiler is the system g++,
    # assumed to be the C++ compiler's version).
    "$<$<AND:$<COMPILE_LANGUAGE:CUDA>,$<CXX_COMPILER_ID:GNU>,$<VERSION_LESS:$<CXX_COMPILER_VERSION>,13>>:-Xcompiler=-Wno-restrict>")
  if(THINKV_WERROR)
    # COMPILE_WARNING_AS_ERROR gives nvcc "-Werror all-warnings", which covers nvcc's own
    # diagnostics only; the host compiler's warnings on .cu files need -Werror passed through.
    target_compile_options(${target} PRIVATE "$<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Werror>")
  endif()
  set_target_properties(${target} PROPERTIES COMPILE_WARNING_AS_ERROR ${THINKV_WERROR})
endfunction()
