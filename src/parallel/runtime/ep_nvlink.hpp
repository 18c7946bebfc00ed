// The NVLink transport of the expert-parallel layer: its dispatch and combine through the
// peer-memory kernels of src/cuda/ep/ (EpGroup::ipc over the expert-parallel communicator, one
// process per rank, every rank on one host) instead of the communicator's all_to_all_v
// (ep_exchange.hpp). It delivers what the Comm path delivers, bit for bit: the rows that reach
// this rank source-major and tokens ascending (dispatch_fp8's dequantized FP8 rows, the sources'
// weights and expert ids), and on the source the weighted sum of the rows that come back in
// slot order (moe_combine's roundings). expert_parallel.cpp picks it (--ep-transport).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "fp8moe/backend.hpp"
#include "fp8moe/comm.hpp"
#include "fp8moe/parallel.hpp"

namespace fp8moe::ep {

// Whether the layer of `layout` over `ep` runs on the NVLink transport: "comm" no; "nvlink" yes,
// or an fp8moe::Error naming why not (the same on every rank); "auto" where every rank can: the
// CUDA backend on sm_90, every rank on one host (--ranks-per-node: the group's nodes are runs of
// its ranks, and the dispatch takes two hops), at most 8 ranks, f32 activations. Collective over
// ep (the ranks exchange what they are) unless "comm".
bool use_nvlink(Backend& be, Comm& ep, const ParallelLayout& layout, DType act);

class NvlinkTransport {
 public:
  virtual ~NvlinkTransport() = default;
  struct Dispatched {
    Tensor x;                          // [n, D] f32: the rows that reached this rank, dequantized
    Tensor weights, ids;               // [n, k] f32, i32 global expert ids: their sources' routing
    std::vector<int64_t> recv_counts;  // rows from each source rank
    // Rows this rank sent to another rank of its node (two hops: its own tokens and those it
    // forwards; one node: every row to another rank). The first hop's rows across nodes, one per
    // (token, other node holding one of its experts), the caller counts from the routing.
    int64_t in_node_rows = 0;
  };
  // x [T, D] f32 quantized to 1x128 E4M3 tiles with `mode` scales (one quantization per token),
  // sent once to each rank holding one of the token's experts idx [T, k] with w [T, k] f32.
  // Collective over the expert-parallel group.
  virtual Dispatched dispatch(Backend& be, const Tensor& x, const Tensor& w, const Tensor& idx, ScaleMode mode) = 0;
  // rows [returned, D]: this rank's rows for the sources of its last dispatch, source-major and in
  // slot order (the Comm path's send layout), rounded to bf16 -> on each source, out [T, D] f32 +=
  // sum_j w[t, j] * row(t, j) in slot order (w undefined: 1). Collective; waits for the result.
  virtual void combine(Backend& be, const Tensor& rows, const Tensor& w, const Tensor& out) = 0;
};

// The transport of `layout` over ep for rows of `hidden` and top-`topk` routing (collective: the
// buffers are shared when the first dispatch sizes them). Throws where use_nvlink would refuse.
std::unique_ptr<NvlinkTransport> make_nvlink_transport(Comm& ep, const ParallelLayout& layout, int64_t hidden,
                                                       int64_t topk);

}  // namespace fp8moe::ep
