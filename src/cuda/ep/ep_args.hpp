// What the expert-parallel kernels are given (plain C++, shared by the host code and the kernels):
// the byte layout of one rank's symmetric buffer, identical on every rank so that an offset names
// the same region in a peer's buffer, and the arguments of one collective step.
#pragma once
#include <cstddef>
#include <cstdint>

namespace fp8moe::cuda::ep {

constexpr int kMaxRanks = 8;       // one node: NVLink peers
constexpr int kMaxChannels = 128;  // num_sms / 2 on any device of up to 256 SMs
constexpr int kMaxTopk = 16;

// (constexpr: callable from the kernels under --expt-relaxed-constexpr.)
// Counts one source sends in the notify step, ints in this order: tokens[c][d] (rows of channel c
// for rank d), slots[c][d] ((token, expert) slots of channel c on rank d), experts[e].
struct CountsLayout {
  int ranks = 0, channels = 0, experts = 0;
  constexpr int tokens(int c, int d) const { return c * ranks + d; }
  constexpr int slots(int c, int d) const { return channels * ranks + c * ranks + d; }
  constexpr int expert(int e) const { return 2 * channels * ranks + e; }
  constexpr int length() const { return 2 * channels * ranks + experts; }
};

// Regions of a rank's buffer, in bytes from its base. Flags are u64 step numbers; rows are placed
// by their senders at their final position (the layout of the Comm path), so every region is
// sized for the worst case: every token of every rank sent to one rank.
struct BufferLayout {
  size_t ready = 0;          // [P] u64: rank q has started step s (q's earlier reads are over)
  size_t notify_flag = 0;    // [P] u64: rank q's counts are in `notify`
  size_t dispatch_flag = 0;  // [P][kMaxChannels] u64: channel c of rank q has written its rows here
  size_t combine_flag = 0;   // [P][kMaxChannels] u64: likewise for the combine's rows
  size_t stage_flag = 0;     // [P][kMaxChannels] u64: channel c of rank p has staged its rows here (two-hop)
  size_t error = 0;          // 8 x u32: set, step, Failure, peer (token), channel (slot) of the first
  // Low-latency mode (EpConfig::low_latency; the normal mode's regions are then empty, and these
  // are empty in the normal mode). N = T_max, M = P * N, E_l = experts per rank, G = D / 128.
  size_t ll_step = 0;          // u64 the last low-latency step this rank ran, u32 blocks done
  size_t ll_count_flag = 0;    // [E_l][P] u64 (step << 32 | rows): source q's rows for expert e are in
  size_t ll_combine_flag = 0;  // [E] u64 step: expert x's rows for this source are in ll_back
  size_t notify = 0;         // [P][counts] i32, written by the peers
  size_t counts = 0;         // [P][counts] i32, this rank's copy for dispatch and combine
  size_t x = 0;              // [P * T_max, D] e4m3 received rows
  size_t scales = 0;         // [G, scale_ld(P * T_max)] f32, group-major at ld = scale_ld(rows)
  size_t weights = 0;        // [P * T_max, k] f32
  size_t ids = 0;            // [P * T_max, k] i32 global expert ids
  size_t combine = 0;        // [T_max * k, D] bf16 the experts' rows back, rank-major (push)
  size_t combine_in = 0;     // [P * T_max * k, D] bf16 this rank's rows for the sources (pull)
  size_t ll_stage_x = 0;       // [E_l][P][N, D] e4m3: each source's rows per local expert, as sent
  size_t ll_stage_scales = 0;  // [E_l][P][N, G] f32, token-major
  size_t ll_stage_slot = 0;    // [E_l][P][N] i32: the row's (token, expert) slot t * k + j on its source
  size_t ll_x = 0;             // [E_l * M, D] e4m3: expert e's rows at e * M + [0, count[e]), source-major
  size_t ll_scales = 0;        // [G, scale_ld(E_l * M)] f32, group-major (the masked grouped GEMM's A)
  size_t ll_count = 0;         // [E_l] i32 rows of each local expert (the masked GEMM's counts)
  size_t ll_src_count = 0;     // [E_l][P] i32 rows of each local expert from each source
  size_t ll_src_slot = 0;      // [E_l * M] i32 the source slot of each packed row
  size_t ll_back = 0;          // [N * k, D] bf16: the experts' rows back, at their slot t * k + j
  // Two-hop dispatch (EpConfig::ranks_per_node below ranks; else empty): what the rank of this
  // in-node index on node m stages here, at its tokens' indices. R = ranks_per_node.
  size_t stage_range = 0;    // [P][kMaxChannels] i32 x 2: the token range [begin, end) of that channel
  size_t stage_x = 0;        // [nodes][T_max, D] e4m3
  size_t stage_scales = 0;   // [nodes][T_max, G] f32, token-major
  size_t stage_weights = 0;  // [nodes][T_max, k] f32
  size_t stage_ids = 0;      // [nodes][T_max, k] i32
  size_t stage_dest = 0;     // [nodes][T_max, R] i32: the row on each rank of this node, or -1
  size_t total = 0;
  int64_t max_recv = 0;      // P * T_max
};

enum class Step : uint32_t { notify = 1, dispatch = 2, combine = 3, ll_dispatch = 4, ll_combine = 5 };
// What failed, in the error word: a wait for a peer's flag, an expert id out of range, or more
// rows for one (local expert, source) than the low-latency buffer holds (a token that lists an
// expert twice).
enum class Failure : uint32_t { ready = 1, counts = 2, rows = 3, expert_id = 4, overflow = 5 };

// One rank's step. peer[q] is rank q's buffer in this process's address space (peer[me] its own).
struct StepArgs {
  char* peer[kMaxRanks] = {};
  BufferLayout layout;
  CountsLayout counts;
  int me = 0, ranks = 0, channels = 0;
  int64_t hidden = 0, topk = 0, experts_per_rank = 0;
  int64_t tokens = 0;  // this rank's T for this step
  uint64_t step = 0;   // this step's number, the same on every rank
  uint64_t timeout_ns = 0;
  int blocks_per_sm = 1;  // the kernels' variant: 2 where the ranks share one GPU's SMs
  bool pull = false;      // combine: the sources read the rows from the experts' buffers
  int ranks_per_node = 0;  // R: the dispatch goes in two hops where R < ranks
  int64_t max_tokens = 0;  // T_max (the staging regions' rows per node)
};

// One rank's low-latency step. The step number is not here: it lives in the rank's buffer
// (ll_step), read and advanced by the kernels, so that a captured graph replays correctly.
struct LlArgs {
  char* peer[kMaxRanks] = {};
  BufferLayout layout;
  int me = 0, ranks = 0;
  int64_t hidden = 0, topk = 0, experts = 0, experts_per_rank = 0;
  int64_t max_tokens = 0;  // N
  int64_t tokens = 0;      // this rank's T <= N
  uint64_t timeout_ns = 0;
  int blocks = 0;  // of each kernel: EpConfig::num_sms
};

}  // namespace fp8moe::cuda::ep
