# KDA pre-processing tests and the CUDA KDA kernel test. Included from tests/kda/CMakeLists.txt
# (include(${CMAKE_CURRENT_SOURCE_DIR}/preprocess.cmake)).
k3_add_test(test_preprocess ${CMAKE_CURRENT_LIST_DIR}/test_preprocess.cpp)
k3_add_test(test_preprocess_conv ${CMAKE_CURRENT_LIST_DIR}/test_preprocess_conv.cpp)

# The CUDA kernels: on the SIMT host runtime everywhere, on a GPU where nvcc is.
k3_add_gpu_test(test_kda_cuda ${CMAKE_CURRENT_LIST_DIR}/test_kda_cuda.cu)
k3_add_gpu_test(test_kda_preprocess_cuda ${CMAKE_CURRENT_LIST_DIR}/test_kda_preprocess_cuda.cu)
k3_add_gpu_test(test_kda_cuda_backend ${CMAKE_CURRENT_LIST_DIR}/test_kda_cuda_backend.cu)
k3_add_gpu_test(test_kda_preprocess_cuda_backend ${CMAKE_CURRENT_LIST_DIR}/test_kda_preprocess_cuda_backend.cu)
# kda_case and the args are built with designated initializers that leave members out (as in
# the other KDA tests, tests/kda/CMakeLists.txt).
target_compile_options(test_kda_cuda_backend_emulated PRIVATE $<$<CXX_COMPILER_ID:GNU,Clang>:-Wno-missing-field-initializers>)
target_compile_options(test_kda_preprocess_cuda_backend_emulated PRIVATE $<$<CXX_COMPILER_ID:GNU,Clang>:-Wno-missing-field-initializers>)
if(TARGET test_kda_preprocess_cuda_backend)
  target_compile_options(test_kda_preprocess_cuda_backend PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wno-missing-field-initializers>)
endif()
if(TARGET test_kda_cuda_backend)
  target_compile_options(test_kda_cuda_backend PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wno-missing-field-initializers>)
  # Its CPU reference includes Eigen 3.4, which nvcc 13 warns about unless given
  # --expt-relaxed-constexpr (#20012 on defaulted DenseStorage members, #20015 on constexpr host
  # calls from its device functions); the warnings are Eigen's, and warnings are errors here.
  target_compile_options(test_kda_cuda_backend PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-diag-suppress=20012,20015>)
endif()
