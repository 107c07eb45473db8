# cmake -DBUILD_DIR= -DWORK_DIR= -DPROJECT_DIR= -DGENERATOR= -DCXX= -P run.cmake: install, build the
# consumer against the installed package, run it. Any step failing fails the test.
function(step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (${rc}):\n${out}\n${err}")
  endif()
  message(STATUS "${what}: ok")
  set(step_out "${out}" PARENT_SCOPE)
endfunction()
file(REMOVE_RECURSE ${WORK_DIR})
# README.md's C++ example: its one ```cpp block, a whole program.
file(READ ${README} readme)
string(REGEX MATCH "```cpp\n([^`]*)```" block "${readme}")
if(NOT CMAKE_MATCH_1)
  message(FATAL_ERROR "no ```cpp block in ${README}")
endif()
file(WRITE ${WORK_DIR}/readme_example.cpp "${CMAKE_MATCH_1}")
step("install" ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${WORK_DIR}/prefix)
step("configure the consumer" ${CMAKE_COMMAND} -S ${PROJECT_DIR} -B ${WORK_DIR}/build -G ${GENERATOR}
     -DCMAKE_CXX_COMPILER=${CXX} -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix
     -DREADME_EXAMPLE=${WORK_DIR}/readme_example.cpp)
step("build the consumer" ${CMAKE_COMMAND} --build ${WORK_DIR}/build)
step("run the consumer" ${WORK_DIR}/build/consumer)
if(NOT step_out MATCHES "consumer: ok")
  message(FATAL_ERROR "the consumer did not report success:\n${step_out}")
endif()
step("run README.md's C++ example" ${WORK_DIR}/build/readme_example)
