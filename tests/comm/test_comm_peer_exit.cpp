// A rank that exits in the middle of a job: rank 1 leaves with _exit(3) after a barrier, and every
// other rank must stop with an fp8moe::Error naming rank 1 within FP8MOE_COMM_TIMEOUT_S (plus a
// margin) instead of hanging. Each survivor prints "PEER_EXIT_OK rank R" when it saw that error;
// run_peer_exit.cmake counts them. By hand:
//   FP8MOE_COMM_TIMEOUT_S=2 OMPI_MCA_orte_abort_on_non_zero_status=0 mpirun -np 3 build/bin/test_comm_peer_exit all_reduce
// Modes: all_reduce (the survivors in a collective), recv (rank 0 in a receive from rank 1),
// ireduce_scatter (rank 1 leaves once its started collective is posted: the survivors' wait()
// reports it from the request's thread, or, when rank 1's data was read before it left, the
// barrier after it).
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "fp8moe/comm.hpp"
#include "fp8moe/error.hpp"

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "all_reduce";
  auto world = fp8moe::make_comm("mpi");
  const int me = world->rank();
  float x[4] = {1, 2, 3, 4};
  fp8moe::TensorView t(x, fp8moe::DType::f32, {4});
  // Large enough that MPI moves it only once the receiver asks (not in the first message).
  std::vector<float> big_in(size_t(world->size()) << 20, 1.0f), big_out(size_t(1) << 20);
  fp8moe::TensorView send(big_in.data(), fp8moe::DType::f32, {int64_t(big_in.size())});
  fp8moe::TensorView recv(big_out.data(), fp8moe::DType::f32, {int64_t(big_out.size())});
  const auto t0 = std::chrono::steady_clock::now();
  std::string message;
  try {
    // Rank 1 may be gone before the others have its part of the barrier: then the barrier is
    // where they notice.
    world->barrier();
    if (mode == "ireduce_scatter") {
      fp8moe::CommRequest r = world->ireduce_scatter(send, recv, fp8moe::Stream{});
      if (me == 1) _exit(3);
      r.wait();
      world->barrier();  // rank 1's data may have been read before it left: then this notices
    }
    if (me == 1) _exit(3);
    if (mode == "recv") world->recv(t, 1, fp8moe::Stream{});
    else if (mode == "all_reduce") world->all_reduce(t, fp8moe::Stream{});
  } catch (const fp8moe::Error& e) {
    message = e.what();
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("rank %d after %.1f s: %s\n", me, s, message.empty() ? "no error" : message.c_str());
  // Rank 1 among the ranks the error names as silent ("... without hearing from rank 0, rank 1
  // (exited ..." or "... = 2 s for rank 1 to take its data (exited ..."; a survivor that stopped
  // first may be named too).
  std::string silent = message.substr(0, message.find(" (exited"));
  if (silent.ends_with(" to take its data")) silent.resize(silent.size() - std::strlen(" to take its data"));
  for (const char* lead : {" without hearing from ", " s for "})
    if (const size_t at = silent.find(lead); at != std::string::npos) silent = silent.substr(at + std::strlen(lead));
  const bool named = (", " + silent + ",").find(", rank 1,") != std::string::npos;
  if (named && s < 2.0 + 10.0) std::printf("PEER_EXIT_OK rank %d\n", me);
  std::fflush(stdout);
  return named ? 0 : 1;
}
