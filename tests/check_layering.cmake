# The layering rules grep can check (run by ctest as layering.*; ROOT is the source tree):
#   kernels/ includes nothing of the host library above core/ (the codec's header-only format
#   constants aside): no format/, engine/, store/ or sync/ header;
#   the CLI reaches the GPU only through the engines: no CUDA runtime call or header of its own.
set(problems "")
file(GLOB_RECURSE kernel_files "${ROOT}/kernels/*.hpp" "${ROOT}/kernels/*.cuh" "${ROOT}/kernels/*.cu")
foreach(f IN LISTS kernel_files)
  file(STRINGS "${f}" hits REGEX "#include \"(format|engine|store|sync)/")
  foreach(h IN LISTS hits)
    string(APPEND problems "${f}: ${h}\n")
  endforeach()
endforeach()
file(GLOB cli_files "${ROOT}/host/cli/*.cpp" "${ROOT}/host/cli/*.hpp")
foreach(f IN LISTS cli_files)
  file(STRINGS "${f}" hits REGEX "cudaMalloc|cudaStream|cuda_runtime|deltasync/cuda/")
  foreach(h IN LISTS hits)
    string(APPEND problems "${f}: ${h}\n")
  endforeach()
endforeach()
if(problems)
  message(FATAL_ERROR "layering broken:\n${problems}")
endif()
message(STATUS "layering: kernels/ on core only, the CLI through the engines")
