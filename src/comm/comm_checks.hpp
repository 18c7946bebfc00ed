// What every rank says about a collective before any data moves, and the verdict that every rank
// reaches from all of them. Both engines exchange these descriptions first (a few hundred bytes),
// so mismatched counts, dtypes, row shapes, a size out of range or a rank that is in another
// collective stop every rank with the same message, instead of a hang or a corrupted buffer.
// Tested by tests/comm/test_comm.cpp (the Mismatch* and OutOfRange tests).
#pragma once
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "fp8moe/tensor.hpp"

namespace fp8moe::comm_detail {

enum class Op : int32_t { barrier, split, all_to_all_v, all_gather, reduce_scatter, all_reduce, broadcast };
const char* op_name(Op op);

// What one rank passes to a collective.
struct OpDesc {
  Op op = Op::barrier;
  int32_t dtype = -1;                            // DType of the tensors, -1 without tensors
  std::vector<int64_t> row_shape;                // shape[1..] of the tensors
  int64_t rows = 0;                              // shape[0] of the first tensor (send, or t)
  int64_t root = -1;                             // broadcast
  std::vector<int64_t> send_counts, recv_counts;  // all_to_all_v, [size] rows each
  std::string problem;                           // this rank's own argument error, "" when none

  std::string encode() const;
  static OpDesc decode(std::string_view bytes);
};

// The descriptions of the collectives (size = ranks of the communicator); local argument errors
// go to `problem` so that every rank hears of them.
OpDesc describe_all_to_all_v(const TensorView& send, std::span<const int64_t> send_counts, const TensorView& recv,
                             std::span<const int64_t> recv_counts, int size);
OpDesc describe_all_gather(const TensorView& send, const TensorView& recv, int size);
OpDesc describe_reduce_scatter(const TensorView& send, const TensorView& recv, int size);
OpDesc describe_all_reduce(const TensorView& t);
OpDesc describe_broadcast(const TensorView& t, int root, int size);

// Exchanges `mine` with every rank (through `exchange`, rank order) and throws the same
// fp8moe::Error on every rank when the descriptions disagree or one has a problem. Messages
// start "<engine> <op>: ".
using ExchangeFn = std::function<std::vector<std::string>(std::string_view)>;
void agree(const OpDesc& mine, const ExchangeFn& exchange, std::string_view engine);

// Rows of a tensor (shape[0]; 1 for a 0-d tensor) and the bytes of one row.
int64_t rows_of(const TensorView& t);
int64_t row_bytes(const TensorView& t);
// DTypes a reduction sums.
bool summable(DType t);

// Seconds a blocking wait lasts before it names the silent peers: FP8MOE_COMM_TIMEOUT_S, 300 by default.
double timeout_s();

}  // namespace fp8moe::comm_detail
