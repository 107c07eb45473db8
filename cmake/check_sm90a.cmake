# cmake -DCUOBJDUMP=<cuobjdump> -DFILE=<binary> -P check_sm90a.cmake: fails unless FILE holds sm_90a
# device code (the wheel's Python extension, which links the CUTLASS/CuTe kernels statically).
execute_process(COMMAND "${CUOBJDUMP}" --list-elf "${FILE}" OUTPUT_VARIABLE elfs ERROR_VARIABLE err RESULT_VARIABLE rc)
string(REGEX MATCHALL "sm_90a" found "${elfs}")
list(LENGTH found n)
if(NOT rc EQUAL 0 OR n EQUAL 0)
  message(FATAL_ERROR "${FILE} holds no sm_90a code (cuobjdump exit ${rc}):\n${elfs}${err}")
endif()
message(STATUS "${FILE}: ${n} sm_90a cubins")
