# Installs a built flare into a scratch prefix, then configures, builds and runs tests/cmake_consumer
# against it (find_package(flare), flare::flare and flare::flare_static).
#   cmake -DFLARE_BUILD_DIR=<build> -DCONSUMER_SOURCE=<tests/cmake_consumer> -DWORK_DIR=<scratch>
#         [-DGENERATOR=<generator>] [-DCXX_COMPILER=<c++>] [-DCXX_FLAGS=<flags>] -P run_consumer.cmake
# CXX_FLAGS: the flare build's CMAKE_CXX_FLAGS, so that a consumer of a sanitizer build (the debug preset)
# compiles and links with the same -fsanitize runtime as the static library it links.
foreach(var FLARE_BUILD_DIR CONSUMER_SOURCE WORK_DIR)
  if(NOT ${var})
    message(FATAL_ERROR "run_consumer.cmake needs -D${var}=...")
  endif()
endforeach()

function(run_step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (${rc}):\n${out}\n${err}")
  endif()
  message(STATUS "${what}: ok")
  set(step_output "${out}" PARENT_SCOPE)
endfunction()

file(REMOVE_RECURSE "${WORK_DIR}")
set(prefix "${WORK_DIR}/prefix")
run_step("install flare" ${CMAKE_COMMAND} --install "${FLARE_BUILD_DIR}" --prefix "${prefix}")

set(configure_args -S "${CONSUMER_SOURCE}" -B "${WORK_DIR}/build" "-DCMAKE_PREFIX_PATH=${prefix}"
    -DCMAKE_BUILD_TYPE=Release)
if(GENERATOR)
  list(APPEND configure_args -G "${GENERATOR}")
endif()
if(CXX_COMPILER)
  list(APPEND configure_args "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}")
endif()
if(CXX_FLAGS)
  list(APPEND configure_args "-DCMAKE_CXX_FLAGS=${CXX_FLAGS}")
endif()
run_step("configure the consumer" ${CMAKE_COMMAND} ${configure_args})
run_step("build the consumer" ${CMAKE_COMMAND} --build "${WORK_DIR}/build")
foreach(exe consumer_shared consumer_static)
  run_step("run ${exe}" "${WORK_DIR}/build/${exe}")
  message(STATUS "${step_output}")
endforeach()
