// The NCCL engine of Comm (nccl_comm.cpp), built with the CUDA backend only.
#pragma once
#include <memory>

#include "mpi_comm.hpp"

namespace fp8moe::comm_detail {

// NCCL over the ranks of `host` (collective over them), on the current GPU of each rank. `host`
// carries the bootstrap (the unique id), the argument checks and barrier/exchange.
std::unique_ptr<Comm> make_nccl_comm(std::unique_ptr<MpiComm> host);

}  // namespace fp8moe::comm_detail
