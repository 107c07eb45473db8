# The C++ torch library sparsetrain._torch_ops: attention as C++ torch operators
# (python/src/torch_ops.cpp) and the grouped layers' C++ layers over torch tensors
# (python/src/torch_grouped.cpp, pybind11 with torch's tensor caster), the torch front's eager path
# with no Python per allocation or result. Built next to the extension where the Python build's
# torch has its C++ headers and libraries (SPARSETRAIN_TORCH_OPS=AUTO, the default; OFF skips it);
# sparsetrain.torch uses the Python path where the library is absent.
set(SPARSETRAIN_TORCH_OPS "AUTO" CACHE STRING "Build the C++ torch library: AUTO or OFF")
if(SPARSETRAIN_TORCH_OPS STREQUAL "OFF" OR SKBUILD)
  return()
endif()
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
  message(STATUS "sparsetrain: no torch for ${Python_EXECUTABLE}; the C++ torch library is not built")
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
    message(STATUS "sparsetrain: ${st_torch_lib}/lib${lib}.so not found; the C++ torch library is not built")
    return()
  endif()
endforeach()
add_library(sparsetrain_torch_ops MODULE python/src/torch_ops.cpp python/src/torch_grouped.cpp)
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
# loaded by then); pybind11 wants its symbols hidden.
set_target_properties(sparsetrain_torch_ops PROPERTIES PREFIX "" OUTPUT_NAME _torch_ops CXX_VISIBILITY_PRESET hidden
                      LIBRARY_OUTPUT_DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR}/python/sparsetrain)
message(STATUS "sparsetrain: C++ torch library for torch in ${st_torch_lib}")
