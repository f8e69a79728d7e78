# Helpers for k3's own tests. One executable per test file (parallel builds on 2 cores,
# isolated failures), a shared doctest main, ctest labels cpu / gpu / compile / mpi, and cuda on everything
# that exists only in a CUDA build.
include(doctest)

# k3_add_test(<name> <source> [LABELS l...] [LINK libs...] [TIMEOUT s])
function(k3_add_test name source)
  cmake_parse_arguments(arg "" "TIMEOUT" "LABELS;LINK" ${ARGN})
  if(NOT arg_LABELS)
    set(arg_LABELS cpu)
  endif()
  if(NOT arg_TIMEOUT)
    set(arg_TIMEOUT 600)
  endif()
  add_executable(${name} ${source})
  target_link_libraries(${name} PRIVATE k3::k3 k3_test_main k3_test_options ${arg_LINK})
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR}/tests)
  k3_discover_labelled_tests(${name} "${arg_LABELS}" ${arg_TIMEOUT})
endfunction()

# doctest_discover_tests flattens list-valued PROPERTIES ("cpu;compile" would become LABELS
# cpu plus a bogus property), so labels are set by a script run after discovery.
function(k3_discover_labelled_tests name labels timeout)
  set(env "${ARGN}")  # optional: one VAR=value for every test
  if(env)
    doctest_discover_tests(${name} TEST_LIST ${name}_TESTS PROPERTIES TIMEOUT ${timeout} ENVIRONMENT "${env}")
  else()
    doctest_discover_tests(${name} TEST_LIST ${name}_TESTS PROPERTIES TIMEOUT ${timeout})
  endif()
  # A test whose name selects no test case (ctest splits names at ';', doctest's filter at
  # unescaped ',') would otherwise pass having run nothing: doctest's summary line fails it.
  set(labels_script ${CMAKE_CURRENT_BINARY_DIR}/${name}_labels.cmake)
  file(WRITE ${labels_script}
       "if(${name}_TESTS)\n  set_tests_properties(\${${name}_TESTS} PROPERTIES LABELS \"${labels}\" FAIL_REGULAR_EXPRESSION \"test cases: +0 [|]\")\nendif()\n")
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES ${labels_script})
endfunction()

# k3_add_gpu_test(<name> <source.cu> [SOURCES extra...] [LINK libs...]): one CUDA test source,
# compiled two ways. Everywhere: by the host compiler against k3's SIMT host runtime, as
# <name>_emulated (ctest label cuda-emulated; each TEST_CASE its own ctest test). Where nvcc is
# (K3_ENABLE_CUDA): by nvcc as <name> (labels gpu and cuda), which exits 77 (skipped) without a GPU.
# GPU_ONLY: no host-runtime build (NCCL tests: they need the real CUDA runtime and NCCL).
function(k3_add_gpu_test name source)
  cmake_parse_arguments(arg "GPU_ONLY" "" "LINK;SOURCES" ${ARGN})
  if(arg_GPU_ONLY)
    k3_add_nvcc_gpu_test(${name} ${source} SOURCES ${arg_SOURCES} LINK ${arg_LINK})
    return()
  endif()
  get_filename_component(abs_source ${source} ABSOLUTE)
  set(wrapper ${CMAKE_CURRENT_BINARY_DIR}/${name}_emulated.cpp)
  file(GENERATE OUTPUT ${wrapper} CONTENT "#include \"${abs_source}\"\n")
  add_executable(${name}_emulated ${wrapper} ${arg_SOURCES})
  target_link_libraries(${name}_emulated PRIVATE k3::simt k3_emulated_test_main k3_test_options ${arg_LINK})
  target_include_directories(${name}_emulated PRIVATE ${PROJECT_SOURCE_DIR}/tests ${CMAKE_CURRENT_SOURCE_DIR})
  k3_discover_labelled_tests(${name}_emulated "cuda-emulated" 900 K3_SIMT_LAUNCH_LOG=${PROJECT_BINARY_DIR}/simt_launches.txt)
  if(NOT TARGET k3_emulated_tests)
    add_custom_target(k3_emulated_tests)  # every *_emulated test: `cmake --build B --target k3_emulated_tests`
  endif()
  add_dependencies(k3_emulated_tests ${name}_emulated)
  if(K3_ENABLE_CUDA)
    k3_add_nvcc_gpu_test(${name} ${source} SOURCES ${arg_SOURCES} LINK ${arg_LINK})
  endif()
endfunction()

function(k3_add_nvcc_gpu_test name source)
  cmake_parse_arguments(arg "" "" "LINK;SOURCES" ${ARGN})
  add_executable(${name} ${source} ${arg_SOURCES})
  target_link_libraries(${name} PRIVATE k3::cuda k3_gpu_test_main ${arg_LINK})
  if(K3_WARNINGS_AS_ERRORS)
    target_compile_options(${name} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:--Werror=all-warnings>)
  endif()
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR}/tests)
  add_test(NAME ${name} COMMAND ${name})
  set_tests_properties(${name} PROPERTIES LABELS "gpu;cuda" SKIP_RETURN_CODE 77 TIMEOUT 600)
  if(NOT TARGET k3_gpu_tests)
    add_custom_target(k3_gpu_tests)  # every nvcc-built GPU test (tests/gpu/run.sh builds these)
  endif()
  add_dependencies(k3_gpu_tests ${name})
endfunction()

# k3_add_mpi_test(<name> <source> NP <n>...): runs under mpirun with each listed rank count.
function(k3_add_mpi_test name source)
  cmake_parse_arguments(arg "" "" "NP;LINK" ${ARGN})
  if(NOT TARGET MPI::MPI_CXX)
    return()
  endif()
  add_executable(${name} ${source})
  target_link_libraries(${name} PRIVATE k3::k3 k3_test_options MPI::MPI_CXX ${arg_LINK})
  target_compile_definitions(${name} PRIVATE K3_HAS_MPI=1)
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR}/tests)
  set(mpi_env "OMPI_MCA_btl=self,vader;OMPI_MCA_btl_vader_single_copy_mechanism=none;OMPI_MCA_rmaps_base_oversubscribe=1")
  if(K3_SANITIZE MATCHES "address")
    # Open MPI itself leaks (~120 KB per rank, partly in dlclose'd plugins that suppression
    # files cannot name); the same k3 code is leak-checked through single_process tests.
    list(APPEND mpi_env "ASAN_OPTIONS=detect_leaks=0")
  endif()
  foreach(np IN LISTS arg_NP)
    add_test(NAME ${name}_np${np}
             COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${np} --oversubscribe --allow-run-as-root
                     ${MPIEXEC_PREFLAGS} $<TARGET_FILE:${name}> ${MPIEXEC_POSTFLAGS})
    set_tests_properties(${name}_np${np} PROPERTIES LABELS "cpu;mpi" TIMEOUT 300
                         ENVIRONMENT "${mpi_env}")
  endforeach()
endfunction()

# k3_add_cuda_host_test(<name> <source.cu>): CUDA-compiled doctest that needs no GPU (argument
# checks, error types); runs on every machine that has nvcc, labels cpu and cuda.
function(k3_add_cuda_host_test name source)
  add_executable(${name} ${source})
  target_link_libraries(${name} PRIVATE k3::cuda k3_test_main)
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR}/tests)
  if(K3_WARNINGS_AS_ERRORS)
    target_compile_options(${name} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:--Werror=all-warnings>)
  endif()
  k3_discover_labelled_tests(${name} "cpu;cuda" 120)
endfunction()
