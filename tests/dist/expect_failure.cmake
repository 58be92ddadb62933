# Runs COMMAND (one string, split at spaces) and passes only when it exits with a nonzero status and its output holds
# EXPECT at least COUNT times (once per rank): a collective error reached every rank, and the job ended.
separate_arguments(argv UNIX_COMMAND "${COMMAND}")
execute_process(COMMAND ${argv} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
set(all "${out}${err}")
if(rc EQUAL 0)
  message(FATAL_ERROR "expected a failure, got exit status 0:\n${all}")
endif()
string(REGEX MATCHALL "${EXPECT}" hits "${all}")
list(LENGTH hits n)
if(n LESS COUNT)
  message(FATAL_ERROR "expected '${EXPECT}' ${COUNT} times (once per rank), found ${n} (exit ${rc}):\n${all}")
endif()
message(STATUS "failed as expected (exit ${rc}), '${EXPECT}' ${n} times")
