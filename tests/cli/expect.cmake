# One command-line case: cmake -DCLI=<sparsetrain> -DARGS="a|b|c" -DRC=<exit status> -DREGEX=<text>
# -P expect.cmake. Fails unless the command exits with RC and its output (stdout + stderr) matches
# REGEX.
string(REPLACE "|" ";" args "${ARGS}")
execute_process(COMMAND "${CLI}" ${args} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc STREQUAL "${RC}")
  message(FATAL_ERROR "sparsetrain ${args}: exit status ${rc}, expected ${RC}\n${out}${err}")
endif()
if(NOT "${out}${err}" MATCHES "${REGEX}")
  message(FATAL_ERROR "sparsetrain ${args}: output does not match '${REGEX}':\n${out}${err}")
endif()
