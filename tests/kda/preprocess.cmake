# KDA pre-processing tests and the CUDA KDA kernel test. Included from tests/kda/CMakeLists.txt
# (include(${CMAKE_CURRENT_SOURCE_DIR}/preprocess.cmake)).
k3_add_test(test_preprocess ${CMAKE_CURRENT_LIST_DIR}/test_preprocess.cpp)
k3_add_test(test_preprocess_conv ${CMAKE_CURRENT_LIST_DIR}/test_preprocess_conv.cpp)

# The float64 oracle of the CUDA test, checked against finite differences on every build
# (the .cu compiled as C++ with K3_KDA_REF_SELFTEST: no CUDA code, no GPU needed).
file(GENERATE OUTPUT ${CMAKE_CURRENT_BINARY_DIR}/test_kda_cuda_reference.cpp
     CONTENT "#define K3_KDA_REF_SELFTEST 1\n#include \"${CMAKE_CURRENT_LIST_DIR}/test_kda_cuda.cu\"\n")
k3_add_test(test_kda_cuda_reference ${CMAKE_CURRENT_BINARY_DIR}/test_kda_cuda_reference.cpp)

if(K3_ENABLE_CUDA)
  k3_add_gpu_test(test_kda_cuda ${CMAKE_CURRENT_LIST_DIR}/test_kda_cuda.cu)
  k3_add_gpu_test(test_kda_preprocess_cuda ${CMAKE_CURRENT_LIST_DIR}/test_kda_preprocess_cuda.cu)
endif()
