# Installs the built library into a scratch prefix, then configures, builds and runs a consumer
# project that uses find_package(mha) and links mha::mha (and, with WITH_DIST, mha::dist).
file(REMOVE_RECURSE ${WORK_DIR})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${BINARY_DIR} --prefix ${WORK_DIR}/prefix
  RESULT_VARIABLE rc OUTPUT_QUIET)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "install failed: ${rc}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/find_package/consumer -B ${WORK_DIR}/build -G Ninja
  -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DWITH_DIST=${WITH_DIST} RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "consumer configure failed: ${rc}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK_DIR}/build RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "consumer build failed: ${rc}")
endif()
execute_process(COMMAND ${WORK_DIR}/build/consumer RESULT_VARIABLE rc OUTPUT_VARIABLE out)
message(STATUS "${out}")
if(NOT rc EQUAL 0 OR NOT out MATCHES "consumer ok")
  message(FATAL_ERROR "consumer run failed: ${rc}")
endif()
# A consumer of mha::mha alone on a machine without MPI: the package must still load (mha::dist is
# the one component that needs MPI).
execute_process(COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/find_package/consumer -B ${WORK_DIR}/build-no-mpi
  -G Ninja -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DWITH_DIST=OFF -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "consumer configure without MPI failed: ${rc}")
endif()
if(WITH_DIST)
  execute_process(COMMAND ${WORK_DIR}/build/consumer_dist RESULT_VARIABLE rc OUTPUT_VARIABLE out)
  message(STATUS "${out}")
  if(NOT rc EQUAL 0 OR NOT out MATCHES "dist consumer ok")
    message(FATAL_ERROR "mha::dist consumer run failed: ${rc}")
  endif()
endif()
