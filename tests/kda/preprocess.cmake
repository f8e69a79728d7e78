# KDA pre-processing tests and the CUDA KDA kernel test. Included from tests/kda/CMakeLists.txt
# (include(${CMAKE_CURRENT_SOURCE_DIR}/preprocess.cmake)).
k3_add_test(test_preprocess ${CMAKE_CURRENT_LIST_DIR}/test_preprocess.cpp)
k3_add_test(test_preprocess_conv ${CMAKE_CURRENT_LIST_DIR}/test_preprocess_conv.cpp)

# The CUDA kernels: on the SIMT host runtime everywhere, on a GPU where nvcc is.
k3_add_gpu_test(test_kda_cuda ${CMAKE_CURRENT_LIST_DIR}/test_kda_cuda.cu)
k3_add_gpu_test(test_kda_preprocess_cuda ${CMAKE_CURRENT_LIST_DIR}/test_kda_preprocess_cuda.cu)
