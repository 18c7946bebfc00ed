// The communicator: what expert parallelism, ZeRO-1 and the pipeline executor exchange between
// ranks, behind one interface with two engines (src/comm/):
//   "mpi"   Open MPI: host tensors directly; device tensors staged through pinned host buffers,
//           so several processes can share one GPU. What CI runs, as CPU ranks under mpirun.
//   "nccl"  NCCL on GPUs, bootstrapped over MPI: grouped ncclSend/ncclRecv for the all-to-all,
//           NCCL's collectives for the rest. Device tensors only; one GPU per rank, the current
//           one (select_local_gpu below); NCCL_NVLS_ENABLE=0.
// Every rank of a communicator calls a collective with the same arguments (counts may differ
// where the op says so); a mismatch is an error on every rank that names it, and a peer that has
// gone away makes the others fail with an error naming it after FP8MOE_COMM_TIMEOUT_S seconds
// (default 300) instead of hanging.
//
// Work is ordered on a Stream like any op: it starts after the work queued on `s` so far and
// work queued on `s` later sees its result. With NCCL it is enqueued on `s` and the host returns
// at once; with MPI the host waits for `s`, exchanges, and queues the copies back on `s`.
// Tensors are contiguous; counts and offsets are in rows (the first dimension; elements of a 1-D
// tensor), so that a [T, D] activation is exchanged by token.
//
// Sums: the MPI engine adds in rank order 0, 1, ..., P-1, bitwise equal to a serial loop (bf16
// in f32, rounded once). NCCL sums in its own order (ring or tree), the same bits on every rank
// and from run to run for the same ranks, GPUs, NCCL version and NCCL_ALGO/NCCL_PROTO, but not
// the rank-order bits, and bf16 is rounded at each step; compare NCCL with MPI by tolerance.
// A Comm is used by one thread at a time; different Comms (split) may run on different threads.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "fp8moe/stream.hpp"
#include "fp8moe/tensor.hpp"

namespace fp8moe {

// A transfer in flight (isend, irecv, ireduce_scatter, iall_gather): wait() returns once the
// tensor may be reused (send) or read (receive, on the stream it was posted on).
class CommRequest {
 public:
  class Impl {
   public:
    virtual ~Impl() = default;
    virtual void wait() = 0;
    virtual bool test() = 0;
  };
  CommRequest() = default;
  explicit CommRequest(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
  void wait() {
    if (impl_) impl_->wait();
  }
  bool test() { return impl_ ? impl_->test() : true; }

 private:
  std::unique_ptr<Impl> impl_;
};

class Comm {
 public:
  virtual ~Comm() = default;
  virtual std::string name() const = 0;  // "mpi" | "nccl"
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // The ranks with the same color, ordered by key then by rank (a PP, EP or DP group).
  // Collective over this communicator.
  virtual std::unique_ptr<Comm> split(int color, int key) = 0;

  // Whole tensors, the same dtype and byte count on both sides (MPI: the receiver checks). With
  // NCCL the transfers run in stream order, so a ring in which every rank sends before it
  // receives needs the send and the receive on different streams; NCCL does not send to self.
  virtual void send(const TensorView& t, int peer, const Stream& s) = 0;
  virtual void recv(const TensorView& t, int peer, const Stream& s) = 0;
  virtual CommRequest isend(const TensorView& t, int peer, const Stream& s) = 0;
  virtual CommRequest irecv(const TensorView& t, int peer, const Stream& s) = 0;

  // send [sum(send_counts), ...] holds the rows for rank 0, then rank 1, ...; recv [sum(recv_counts),
  // ...] receives rank 0's rows, then rank 1's. send_counts[j] on rank i equals recv_counts[i] on
  // rank j (checked); zero counts allowed; the row shape and dtype are the same everywhere.
  virtual void all_to_all_v(const TensorView& send, std::span<const int64_t> send_counts, const TensorView& recv,
                            std::span<const int64_t> recv_counts, const Stream& s) = 0;
  // recv [size * n, ...] = every rank's send [n, ...], in rank order.
  virtual void all_gather(const TensorView& send, const TensorView& recv, const Stream& s) = 0;
  // recv [n, ...] = the sum over ranks r = 0, 1, ... (in that order) of rows [rank * n, (rank + 1) * n)
  // of send [size * n, ...]. f32 | f64 | bf16 | i32 | i64 (bf16 summed in f32, rounded once).
  virtual void reduce_scatter(const TensorView& send, const TensorView& recv, const Stream& s) = 0;
  // The same two collectives started, returning at once: the data moves while the caller
  // computes, with the same bits as the blocking call (the MPI engine: a thread per request waits
  // for the transfers and adds the parts in rank order; NCCL: on a communication stream of its
  // own, after the work queued on `s` so far). After wait(), work queued on `s` sees recv. Until
  // then `send` must not be written nor `recv` read. Every rank posts its collectives in one
  // order, blocking or not; other operations on this Comm may be posted while one is in flight.
  virtual CommRequest ireduce_scatter(const TensorView& send, const TensorView& recv, const Stream& s) = 0;
  virtual CommRequest iall_gather(const TensorView& send, const TensorView& recv, const Stream& s) = 0;
  // t = the sum over ranks of t, in place, the same bits on every rank and in every run.
  virtual void all_reduce(const TensorView& t, const Stream& s) = 0;
  virtual void broadcast(const TensorView& t, int root, const Stream& s) = 0;
  virtual void barrier() = 0;
  // Every rank's bytes (any length each), in rank order, on the host: bootstrap data such as CUDA
  // IPC handles or an NCCL unique id.
  virtual std::vector<std::string> exchange(std::string_view mine) = 0;
};

// Where this process sits in its launch: mpirun's environment (OMPI_COMM_WORLD_*), or one rank.
struct LaunchInfo {
  int rank = 0, size = 1, local_rank = 0, local_size = 1;
  bool under_mpirun = false;
};
LaunchInfo launch_info();

// The world communicator: "mpi", "nccl" or "auto" (nccl when every rank has a GPU of its own and
// NCCL is built, else mpi). A single process without mpirun gets a one-rank communicator.
std::unique_ptr<Comm> make_comm(std::string_view kind);

// A mode that runs on exactly `expected` ranks (1 for a serial command, PP x EP x DP for a
// parallel one) stops with an error naming the launch otherwise, on every rank.
void require_world(const LaunchInfo& launch, int expected, std::string_view mode);
void require_world(const Comm& comm, int expected, std::string_view mode);

// CUDA build: makes GPU local_rank % device_count current for this process and returns it, so
// that ranks on one host spread over its GPUs; call it before the backend is made. -1 when the
// build has no CUDA or the host has no GPU.
int select_local_gpu(const LaunchInfo& launch);

}  // namespace fp8moe
