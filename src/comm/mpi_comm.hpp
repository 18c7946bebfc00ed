// The MPI engine of Comm (mpi_comm.cpp), declared here for the NCCL engine, which keeps an
// MpiComm over the same ranks for its bootstrap, its argument checks and its barrier.
#pragma once
#include <mpi.h>

#include <memory>
#include <string>
#include <vector>

#include "comm_checks.hpp"
#include "fp8moe/comm.hpp"
#include "staging.hpp"

namespace fp8moe::comm_detail {

class Pending;  // non-blocking transfers of one operation (mpi_comm.cpp)

class MpiComm final : public Comm {
 public:
  // Takes ownership of `comm` (freed with MPI_Comm_free).
  explicit MpiComm(MPI_Comm comm);
  ~MpiComm() override;

  std::string name() const override { return "mpi"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::unique_ptr<Comm> split(int color, int key) override;
  std::unique_ptr<MpiComm> split_mpi(int color, int key);

  void send(const TensorView& t, int peer, const Stream& s) override;
  void recv(const TensorView& t, int peer, const Stream& s) override;
  CommRequest isend(const TensorView& t, int peer, const Stream& s) override;
  CommRequest irecv(const TensorView& t, int peer, const Stream& s) override;

  void all_to_all_v(const TensorView& send, std::span<const int64_t> send_counts, const TensorView& recv,
                    std::span<const int64_t> recv_counts, const Stream& s) override;
  void all_gather(const TensorView& send, const TensorView& recv, const Stream& s) override;
  void reduce_scatter(const TensorView& send, const TensorView& recv, const Stream& s) override;
  CommRequest ireduce_scatter(const TensorView& send, const TensorView& recv, const Stream& s) override;
  CommRequest iall_gather(const TensorView& send, const TensorView& recv, const Stream& s) override;
  void all_reduce(const TensorView& t, const Stream& s) override;
  void broadcast(const TensorView& t, int root, const Stream& s) override;
  void barrier() override;
  std::vector<std::string> exchange(std::string_view mine) override { return exchange_for(mine, "exchange", "mpi"); }

  // exchange(), naming `op` of `engine` if a peer is silent past the timeout.
  std::vector<std::string> exchange_for(std::string_view mine, const char* op, std::string_view engine);
  // Every rank's description of a collective agrees (comm_checks.hpp), else the same error everywhere.
  void agree(const OpDesc& mine, std::string_view engine = "mpi");
  // "rank 2" or, in a sub-communicator, "rank 2 (world rank 5)".
  std::string rank_name(int r) const;

 private:
  // One round in which this rank sends to(j) to every rank j and receives from(j) from it; its
  // own block is copied (unless to and from are the same bytes).
  struct Block {
    uint8_t* data;
    size_t bytes;
  };
  using BlockFn = std::function<Block(int)>;
  void swap_blocks(const BlockFn& to, const BlockFn& from, const std::string& what);
  // The same round posted into `p`, to be waited for later.
  void post_blocks(const BlockFn& to, const BlockFn& from, const std::string& what, Pending& p);
  // ireduce_scatter (d.op reduce_scatter) or iall_gather, described by d.
  CommRequest start_collective(const OpDesc& d, const TensorView& send, const TensorView& recv, const Stream& s);

  MPI_Comm user_ = MPI_COMM_NULL;  // send/recv of the caller
  MPI_Comm coll_ = MPI_COMM_NULL;  // the collectives' own traffic, never matched with a caller's message
  int rank_ = 0, size_ = 1, world_size_ = 1;
  std::vector<int> world_ranks_;  // of this communicator's ranks, for messages
  PinnedPool pinned_;
  std::vector<uint8_t> parts_;  // reductions: [size, chunk] of every rank's contributions, reused
};

// The world, MPI initialized on first use (MPI_THREAD_MULTIPLE; finalized at exit unless a peer
// was lost, since MPI_Finalize would wait for it).
std::unique_ptr<MpiComm> make_mpi_world();

}  // namespace fp8moe::comm_detail
