# The C++ torch library sparsetrain._torch_ops: attention (python/src/torch_ops.cpp) and the MoE
# router and combine (python/src/torch_moe.cpp) as C++ torch operators, BlockMask.build's torch
# route (python/src/torch_block_mask.cpp), and the grouped layers' C++
# layers over torch tensors (python/src/torch_grouped.cpp, pybind11 with torch's tensor caster),
# what the torch front sparsetrain.torch runs through (without it, importing sparsetrain.torch
# raises an ImportError). Built next to the extension where the build's Python has torch with its
# C++ headers and libraries: scripts/setup's build, and a wheel built by `pip install
# --no-build-isolation .` in an environment with torch (pip's default isolated build environment has
# no torch: that wheel has no torch front). SPARSETRAIN_TORCH_OPS: AUTO (the default: where torch
# is), ON (an error where it is not), OFF (not built).
set(SPARSETRAIN_TORCH_OPS "AUTO" CACHE STRING "Build the C++ torch library: AUTO, ON or OFF")
if(SPARSETRAIN_TORCH_OPS STREQUAL "OFF")
  message(STATUS "sparsetrain: SPARSETRAIN_TORCH_OPS=OFF: the C++ torch library is not built (no sparsetrain.torch)")
  return()
endif()
# Why the library is not built: an error with ON, a status line with AUTO.
function(st_no_torch_ops why)
  if(SKBUILD)
    string(APPEND why " (a pip build sees torch only without its isolated build environment: "
           "`pip install --no-build-isolation .` in an environment with torch)")
  endif()
  if(SPARSETRAIN_TORCH_OPS STREQUAL "ON")
    message(FATAL_ERROR "sparsetrain: SPARSETRAIN_TORCH_OPS=ON but ${why}")
  endif()
  message(STATUS "sparsetrain: ${why}; the C++ torch library is not built (no sparsetrain.torch)")
endfunction()
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c [=[
import os, torch
base = os.path.dirname(torch.__file__)
print("|".join([os.path.join(base, "include"), os.path.join(base, "include", "torch", "csrc", "api", "include")]))
print(os.path.join(base, "lib"))
print(int(torch._C._GLIBCXX_USE_CXX11_ABI))
print(int(torch.version.cuda is not None))
]=]
  OUTPUT_VARIABLE st_torch RESULT_VARIABLE st_torch_rc ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT st_torch_rc EQUAL 0)
  st_no_torch_ops("no torch for ${Python_EXECUTABLE}")
  return()
endif()
string(REPLACE "\n" ";" st_torch "${st_torch}")
list(GET st_torch 0 st_torch_includes)
list(GET st_torch 1 st_torch_lib)
list(GET st_torch 2 st_torch_abi)
list(GET st_torch 3 st_torch_cuda)
string(REPLACE "|" ";" st_torch_includes "${st_torch_includes}")
set(st_torch_libs torch_cpu c10 torch_python)
if(st_torch_cuda AND SPARSETRAIN_WITH_CUDA)
  list(APPEND st_torch_libs c10_cuda)
endif()
foreach(lib IN LISTS st_torch_libs)
  if(NOT EXISTS "${st_torch_lib}/lib${lib}.so")
    st_no_torch_ops("${st_torch_lib}/lib${lib}.so not found")
    return()
  endif()
endforeach()
add_library(sparsetrain_torch_ops MODULE python/src/torch_ops.cpp python/src/torch_grouped.cpp
            python/src/torch_moe.cpp python/src/torch_block_mask.cpp)
target_include_directories(sparsetrain_torch_ops SYSTEM PRIVATE ${st_torch_includes})
target_compile_definitions(sparsetrain_torch_ops PRIVATE _GLIBCXX_USE_CXX11_ABI=${st_torch_abi})
if(st_torch_cuda AND SPARSETRAIN_WITH_CUDA)
  target_compile_definitions(sparsetrain_torch_ops PRIVATE SPARSETRAIN_TORCH_CUDA=1)
  target_include_directories(sparsetrain_torch_ops SYSTEM PRIVATE ${CUDAToolkit_INCLUDE_DIRS})
endif()
target_compile_options(sparsetrain_torch_ops PRIVATE -Wall -Wextra)
target_link_directories(sparsetrain_torch_ops PRIVATE "${st_torch_lib}")
# Python headers for the pybind11 module (torch's pybind11 and tensor caster; no libpython).
target_link_libraries(sparsetrain_torch_ops PRIVATE sparsetrain ${st_torch_libs} Python::Module)
# Imported by sparsetrain.torch as sparsetrain._torch_ops after torch (whose libraries are
# loaded by then: no rpath to them); pybind11 wants its symbols hidden.
set_target_properties(sparsetrain_torch_ops PROPERTIES PREFIX "" OUTPUT_NAME _torch_ops CXX_VISIBILITY_PRESET hidden)
if(SKBUILD)  # into the wheel, next to _C; for the torch it was built against alone
  install(TARGETS sparsetrain_torch_ops LIBRARY DESTINATION sparsetrain)
else()  # next to the package's .py files, as _C
  set_target_properties(sparsetrain_torch_ops PROPERTIES LIBRARY_OUTPUT_DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR}/python/sparsetrain)
endif()
message(STATUS "sparsetrain: C++ torch library for torch in ${st_torch_lib}")
