// Expert-parallel dispatch and combine over peer memory (DeepSeek-V3 §3.2.2; DeepEP's intranode
// normal mode is the public form): the ranks of one node share symmetric buffers, and the kernels
// write rows straight into their peers' buffers through NVLink, on a budget of SMs, in the exact
// layouts and with the exact results of the Comm path (src/parallel/runtime/ep_exchange.cpp):
//   notify    each rank's routing -> per (channel, rank) row and slot counts and per-expert slot
//             counts, exchanged; the host reads them (counts()) to size what follows.
//   dispatch  FP8 rows [T, D] with their 1x128 scales, f32 routing weights and i32 expert ids [T, k]
//             -> on every rank, the rows that reach it, source-major, tokens ascending: e4m3 values
//             [n, D], scales [G, scale_ld(n)] group-major with padding 1 (the quantized layout the
//             grouped GEMM path reads), weights and ids [n, k]. The source gets slot_row [T, k]:
//             the row of each (token, expert) slot among the rows the combine brings back.
//   combine   each rank's BF16 rows, one per slot it computed (source-major, slot order: the
//             Comm path's send layout) -> on the source, out [T, D] f32 (+)= sum_j w[t, j] *
//             row(t, j) in slot order, moe_combine's roundings: deterministic and bit-exact.
// Low-latency mode (EpConfig::low_latency; decode, DeepEP's low-latency mode), ep_low_latency.cu:
//   dispatch  FP8 rows [T, D] (T <= N = max_tokens) with their 1x128 scales and the expert ids
//             [T, k] -> on every rank, one row per (token, expert) slot in the masked layout of
//             its local experts: expert e's rows at e * M + [0, count[e]) of [E_l * M, D], M = P * N,
//             source-major, slots ascending; scales group-major [G, scale_ld(E_l * M)]; the counts
//             [E_l] in device memory, and each row's source and slot.
//   combine   each rank's BF16 rows in that layout (the masked grouped GEMM's output) -> on the
//             source, out [T, D] f32 (+)= sum_j w[t, j] * row(t, j) in slot order, as above.
//   No notify, no host read of counts, the step number kept on the device: both steps can be
//   captured in a CUDA graph and replayed. The buffer is sized for N tokens per rank per (local
//   expert, source): E_l * P * N rows staged and as many packed.
// Ranks are either several buffers on one GPU in one process, one stream each (EpGroup::local:
// tests and benchmarks), or one process per GPU of a node with CUDA IPC handles exchanged over a
// Comm (EpGroup::ipc). Every rank runs the same steps in the same order; each waits for its peers
// through system-scope flags and gives up after the configured timeout with an fp8moe::Error
// naming the step and the peer, instead of hanging.
#pragma once
#include <cuda_runtime.h>

#include <memory>
#include <string>
#include <vector>

#include "cuda/ep/ep_args.hpp"
#include "fp8moe/quantize.hpp"
#include "fp8moe/tensor.hpp"

namespace fp8moe {
class Comm;
}

namespace fp8moe::cuda::ep {

struct EpConfig {
  int ranks = 0;            // P, at most kMaxRanks (one node)
  int64_t max_tokens = 0;   // T per rank and step, at most
  int64_t hidden = 0;       // D, a multiple of 128 (1x128 tiles)
  int64_t topk = 0;         // k, at most kMaxTopk
  int64_t experts = 0;      // routed experts, a multiple of P (rank d holds [d * E / P, (d + 1) * E / P))
  int num_sms = 20;         // blocks of each kernel, even: channels = num_sms / 2
  double timeout_s = 10.0;  // a wait for a peer longer than this fails the step
  size_t buffer_bytes = 0;  // 0: the worst case; else the size to use, refused when below it
  // The combine's rows travel by the sources' reads from a region of each expert rank's buffer
  // (combine_input()) instead of the expert ranks' writes into the sources' buffers: one pass over
  // the rows instead of two (written, then read for the sum), for a region of the worst case,
  // P * T_max * k rows.
  bool pull_combine = false;
  // Ranks per node, R (0: all of them, one node). Below `ranks`, ranks [m R, (m + 1) R) are node m
  // and the dispatch goes in two hops (ep_dispatch_two_hop.cu): a row crosses to another node once
  // per node that holds its experts, to the rank of its source's in-node index there, which
  // forwards it inside that node; the rows land as in one hop, bit for bit. The combine goes
  // straight back. Normal mode only.
  int ranks_per_node = 0;
  // The low-latency mode: the group serves only low_latency_dispatch and low_latency_combine,
  // for at most max_tokens (N) tokens per rank, num_sms blocks per kernel.
  bool low_latency = false;
};

// The regions of a rank's buffer for the worst case of cfg (checks cfg; throws fp8moe::Error).
BufferLayout buffer_layout(const EpConfig& cfg);

// What notify gathered on a rank: every source's counts (ep_args.hpp's CountsLayout).
class EpCounts {
 public:
  EpCounts() = default;
  EpCounts(CountsLayout layout, std::vector<int32_t> raw) : l_(layout), raw_(std::move(raw)) {}
  int32_t tokens(int p, int c, int d) const { return raw_[size_t(p * l_.length() + l_.tokens(c, d))]; }
  int32_t slots(int p, int c, int d) const { return raw_[size_t(p * l_.length() + l_.slots(c, d))]; }
  int32_t expert(int p, int e) const { return raw_[size_t(p * l_.length() + l_.expert(e))]; }
  int64_t tokens_to(int p, int d) const;  // rows source p sends to rank d
  int64_t slots_to(int p, int d) const;   // slots of source p's tokens on rank d
  int64_t received(int d) const;          // rows that reach rank d
  std::vector<int64_t> recv_counts(int d) const;  // per source
  int64_t returned(int d) const;          // rows rank d sends back in the combine
  // Slots of each of rank d's experts over every source (the grouped GEMM's loads).
  std::vector<int64_t> expert_counts(int d) const;

 private:
  CountsLayout l_;
  std::vector<int32_t> raw_;  // [P][length]
};

// Ranks driven from one process (EpGroup::local) spin on one GPU until their peers have written,
// so nothing a rank queues may wait behind a peer's spinning kernel: one hardware queue per stream
// (CUDA_DEVICE_MAX_CONNECTIONS=32), and every kernel loaded before the first step
// (CUDA_MODULE_LOADING=EAGER): under lazy loading a kernel's first launch may wait for the device
// to go idle, which it never does while a peer spins waiting for that kernel's rank. Sets each
// where unset; effective only before the process's first CUDA call. EpGroup::local checks both.
void prepare_local_ranks();

class EpGroup;

// One rank: its buffer, its peers' buffers, its stream and its step counter.
class EpRank {
 public:
  int rank() const { return me_; }
  cudaStream_t stream() const { return stream_; }

  // idx [T, k] i32 on the device, T <= max_tokens, ids in [0, experts). Queued on stream().
  void notify(const TensorView& idx);
  // The counts of the last notify: waits for this rank's stream; throws on a timed-out wait or an
  // expert id out of range.
  const EpCounts& counts();
  // x: values [T, D] e4m3, scales [G, ld >= T] f32 (tile_1x128); weights [T, k] f32; idx the
  // notify's [T, k]; slot_row [T, k] i32 written. Needs counts() of the same routing first.
  void dispatch(const QuantizedView& x, const TensorView& weights, const TensorView& idx, const TensorView& slot_row);
  // Views of this rank's buffer after its dispatch (valid until its next dispatch).
  struct Received {
    QuantizedView x;            // [n, D] e4m3, scales [G, scale_ld(n)]
    TensorView weights, ids;    // [n, k] f32, i32
    int64_t rows = 0;
  };
  Received received() const;
  // pull_combine: where this rank's combine rows go ([counts().returned(me), D] bf16 in its
  // buffer), so that the experts can write them there directly. The peers read it during the
  // combine step: write it only after a later step (dispatch or notify) has begun on this rank's
  // stream, as the layer's order of steps does.
  TensorView combine_input() const;
  // rows [counts().returned(me), D] bf16; slot_row and weights (f32, or undefined: 1) [T, k] of
  // this rank's last dispatch; out [T, D] f32 (+)= the weighted sums. With pull_combine, rows
  // other than combine_input() are first copied there on stream().
  void combine(const TensorView& rows, const TensorView& slot_row, const TensorView& weights, const TensorView& out,
               bool accumulate);
  // Waits for this rank's stream; throws fp8moe::Error if one of its waits timed out.
  void check();

  // ---- low-latency mode (EpConfig::low_latency) ----
  // x: values [T, D] e4m3, T <= max_tokens, scales [G, ld >= T] f32 (tile_1x128); idx [T, k] i32,
  // ids in [0, experts), distinct within a token. Queued on stream() with no host synchronization
  // (capturable); errors found on the device (an id out of range, a wait timed out) are thrown by
  // check().
  // With hook (DeepEP's receive hook), only the send part is queued: the rows travel while the
  // stream runs other work, and low_latency_receive() queues the rest.
  void low_latency_dispatch(const QuantizedView& x, const TensorView& idx, bool hook = false);
  // Views of this rank's buffer after its low-latency dispatch (valid until its next one).
  struct LowLatencyReceived {
    QuantizedView x;        // [E_l * M, D] e4m3, scales [G, scale_ld(E_l * M)]; rows past a count: garbage
    TensorView counts;      // [E_l] i32: rows of each local expert (the masked grouped GEMM's counts)
    TensorView src_counts;  // [E_l, P] i32: of those, from each source (source-major)
    TensorView src_slot;    // [E_l * M] i32: each row's slot t * k + j on its source
    int64_t rows_per_expert = 0;  // M = P * N
  };
  LowLatencyReceived low_latency_received() const;
  // rows [E_l * M, D] bf16 in the received layout (only rows below the counts are read); weights
  // [T, k] f32 of this rank's last low-latency dispatch (or undefined: 1); out [T, D] f32 (+)= the
  // weighted sums. Capturable, as the dispatch.
  void low_latency_combine(const TensorView& rows, const TensorView& weights, const TensorView& out, bool accumulate,
                           bool hook = false);
  // The receive part of the last step queued with hook (the dispatch's packing, the combine's sums),
  // on stream(); the step's results are valid after it. Capturable. Every other low-latency call
  // is refused while a receive is pending.
  void low_latency_receive();
  bool receive_pending() const { return pending_.phase != 0; }

 private:
  friend class EpGroup;
  StepArgs next_step(int64_t tokens);
  LlArgs ll_args(int64_t tokens) const;
  void require_usable(const char* step) const;
  void require_mode(bool low_latency, const char* step) const;

  const EpGroup* group_ = nullptr;
  int me_ = 0;
  char* peer_[kMaxRanks] = {};
  cudaStream_t stream_ = nullptr;
  uint64_t step_ = 0;
  int64_t tokens_ = -1;      // T of the last notify
  bool counted_ = false;     // counts() read since the last notify
  bool broken_ = false;      // a wait timed out: the peers' step counters no longer agree
  int32_t* counts_host_ = nullptr;  // pinned [P][length]
  int64_t ll_tokens_ = -1;   // T of the last low-latency dispatch
  struct PendingReceive {     // the arguments of a hooked step's receive launch
    int phase = 0;            // 0: none; 1: dispatch; 2: combine
    LlArgs args;
    const uint8_t* x = nullptr;
    const float* x_scales = nullptr;
    int64_t x_ld = 0;
    const int32_t* idx = nullptr;
    const void* rows = nullptr;
    const float* weights = nullptr;
    float* out = nullptr;
    bool accumulate = false;
  } pending_;
  void require_no_receive(const char* step) const;
  EpCounts counts_;
};

class EpGroup {
 public:
  // P ranks as P buffers on the current device, one stream each. Checks that the kernels' blocks
  // of all ranks fit on the device at once (they wait for each other).
  static std::unique_ptr<EpGroup> local(const EpConfig& cfg);
  // This process's rank of comm (one process per GPU of one node): its buffer shared with the
  // others' through CUDA IPC handles exchanged over comm (collective). Work goes on `stream`.
  static std::unique_ptr<EpGroup> ipc(const EpConfig& cfg, Comm& comm, cudaStream_t stream);
  ~EpGroup();
  EpGroup(const EpGroup&) = delete;
  EpGroup& operator=(const EpGroup&) = delete;

  int size() const { return int(ranks_.size()); }  // ranks held by this process
  EpRank& rank(int i) { return *ranks_[size_t(i)]; }
  const EpConfig& config() const { return cfg_; }
  const BufferLayout& layout() const { return layout_; }
  const CountsLayout& counts_layout() const { return counts_layout_; }
  int blocks_per_sm() const { return blocks_per_sm_; }  // the kernels' variant (StepArgs::blocks_per_sm)

 private:
  EpGroup(const EpConfig& cfg);
  EpConfig cfg_;
  BufferLayout layout_;
  CountsLayout counts_layout_;
  std::vector<std::unique_ptr<EpRank>> ranks_;
  std::vector<void*> owned_;       // buffers allocated here
  std::vector<void*> opened_;      // peers' buffers opened from IPC handles
  std::vector<cudaStream_t> streams_;  // streams created here
  int blocks_per_sm_ = 1;
};

}  // namespace fp8moe::cuda::ep
