# Runs test_comm_peer_exit under mpirun and passes when every rank but the one that exits
# reported the error naming it (mpirun's own exit status is not 0, since one rank exited with 3).
# -DMPIEXEC= -DNP_FLAG= -DNP= -DPREFLAGS= -DEXE= -DMODE=
execute_process(COMMAND ${MPIEXEC} ${NP_FLAG} ${NP} --oversubscribe ${PREFLAGS} ${EXE} ${MODE}
                OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc TIMEOUT 50)
message("${out}")
string(REGEX MATCHALL "PEER_EXIT_OK rank [0-9]+" ok "${out}")
list(LENGTH ok n_ok)
math(EXPR want "${NP} - 1")
if(NOT n_ok EQUAL want)
  message(FATAL_ERROR "${n_ok} of ${want} surviving ranks reported the lost peer (mpirun: ${rc})\n${err}")
endif()
