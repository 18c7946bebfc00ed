// Where a process sits in its launch and which communicator it gets: `mpirun -np N build/bin/fp8moe
// ...` sets OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}; a process started without mpirun
// is the one rank of its job. make_comm("auto") takes NCCL when it is built and every rank of a
// host has a GPU of its own, else MPI. Tested by tests/comm/test_comm.cpp (Launch* tests).
#include <cstdlib>
#include <string>

#include "fp8moe/comm.hpp"
#include "fp8moe/error.hpp"
#include "mpi_comm.hpp"

#if FP8MOE_COMM_CUDA
#include <cuda_runtime.h>

#include "nccl_comm.hpp"
#endif

namespace fp8moe {

namespace {

int env_int(const char* name, int fallback) {
  const char* s = std::getenv(name);
  if (s == nullptr || *s == '\0') return fallback;
  char* end = nullptr;
  const long v = std::strtol(s, &end, 10);
  FP8MOE_CHECK(end != s && *end == '\0' && v >= 0, name << " = '" << s << "': expected a rank or a count");
  return int(v);
}

// GPUs this process sees (0 without CUDA, a driver or a device).
int device_count() {
#if FP8MOE_COMM_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
#else
  return 0;
#endif
}

}  // namespace

LaunchInfo launch_info() {
  LaunchInfo li;
  li.under_mpirun = std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr;
  if (!li.under_mpirun) return li;
  li.rank = env_int("OMPI_COMM_WORLD_RANK", 0);
  li.size = env_int("OMPI_COMM_WORLD_SIZE", 1);
  li.local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK", 0);
  li.local_size = env_int("OMPI_COMM_WORLD_LOCAL_SIZE", 1);
  return li;
}

std::unique_ptr<Comm> make_comm(std::string_view kind) {
  FP8MOE_CHECK(kind == "mpi" || kind == "nccl" || kind == "auto",
               "make_comm: kind = '" << kind << "', expected mpi | nccl | auto");
#if FP8MOE_COMM_CUDA
  if (kind == "mpi") return comm_detail::make_mpi_world();
  auto world = comm_detail::make_mpi_world();
  if (kind == "nccl") return comm_detail::make_nccl_comm(std::move(world));
  // auto: NCCL only if every rank has a GPU of its own, decided together so that no rank differs.
  const LaunchInfo li = launch_info();
  const int gpus = device_count();
  const bool own_gpu = gpus > 0 && li.local_size <= gpus;
  for (const auto& v : world->exchange_for(own_gpu ? "1" : "0", "auto", "mpi")) {
    if (v != "1") return world;
  }
  return comm_detail::make_nccl_comm(std::move(world));
#else
  FP8MOE_CHECK(kind != "nccl", "make_comm: \"nccl\" needs fp8moe built with CUDA and NCCL; this build has no CUDA "
                               "(configured with FP8MOE_CUDA=OFF or without nvcc); use --comm mpi");
  return comm_detail::make_mpi_world();
#endif
}

void require_world(const LaunchInfo& launch, int expected, std::string_view mode) {
  FP8MOE_CHECK(launch.size == expected, mode << " runs on " << expected << " rank" << (expected == 1 ? "" : "s")
                                             << ", this launch has " << launch.size
                                             << (launch.under_mpirun ? " (mpirun -np " + std::to_string(launch.size) + ")" : "")
                                             << "; start it with mpirun -np " << expected
                                             << (expected == 1 ? " or without mpirun" : ""));
}

void require_world(const Comm& comm, int expected, std::string_view mode) {
  FP8MOE_CHECK(comm.size() == expected, mode << " runs on " << expected << " rank" << (expected == 1 ? "" : "s")
                                             << ", the " << comm.name() << " communicator has " << comm.size()
                                             << "; start it with mpirun -np " << expected);
}

int select_local_gpu(const LaunchInfo& launch) {
  const int n = device_count();
  if (n == 0) return -1;
#if FP8MOE_COMM_CUDA
  const int dev = launch.local_rank % n;
  const cudaError_t err = cudaSetDevice(dev);
  FP8MOE_CHECK(err == cudaSuccess, "select_local_gpu: cudaSetDevice(" << dev << ") for local rank " << launch.local_rank
                                                                       << " failed: " << cudaGetErrorString(err));
  return dev;
#else
  (void)launch;
  return -1;
#endif
}

}  // namespace fp8moe
