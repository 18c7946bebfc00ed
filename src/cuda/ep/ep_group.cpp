// The host side of the expert-parallel kernels (ep_api.hpp): the buffer layout for the worst case,
// the groups of ranks (several buffers on one GPU, or one process per GPU with CUDA IPC), the
// argument checks of each step and the errors the kernels leave in a rank's error word.
#include <cuda.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>

#include "cuda/ep/ep_api.hpp"
#include "cuda/ep/ep_launch.hpp"
#include "cuda/runtime/cuda_check.hpp"
#include "fp8moe/comm.hpp"
#include "fp8moe/error.hpp"

namespace fp8moe::cuda::ep {

namespace {

size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

const char* step_name(uint32_t s) {
  switch (Step(s)) {
    case Step::notify: return "notify";
    case Step::dispatch: return "dispatch";
    case Step::combine: return "combine";
    case Step::ll_dispatch: return "low-latency dispatch";
    case Step::ll_combine: return "low-latency combine";
  }
  return "?";
}

void check_config(const EpConfig& c) {
  FP8MOE_CHECK(c.ranks >= 1 && c.ranks <= kMaxRanks,
               "ep: " << c.ranks << " ranks; the single-hop kernels serve 1 to " << kMaxRanks << " ranks of one node");
  FP8MOE_CHECK(c.max_tokens >= 1, "ep: max_tokens " << c.max_tokens << " must be positive");
  FP8MOE_CHECK(c.hidden >= 128 && c.hidden % 128 == 0, "ep: hidden " << c.hidden << " must be a positive multiple of 128 (1x128 tiles)");
  FP8MOE_CHECK(c.topk >= 1 && c.topk <= kMaxTopk, "ep: topk " << c.topk << " outside [1, " << kMaxTopk << "]");
  FP8MOE_CHECK(c.experts >= c.ranks && c.experts % c.ranks == 0,
               "ep: " << c.experts << " experts do not split evenly over " << c.ranks << " ranks");
  FP8MOE_CHECK(c.num_sms >= 2 && c.num_sms % 2 == 0,
               "ep: num_sms " << c.num_sms << " must be even and at least 2 (each channel is a pair of SMs)");
  FP8MOE_CHECK(c.num_sms / 2 <= kMaxChannels, "ep: num_sms " << c.num_sms << " above " << 2 * kMaxChannels);
  FP8MOE_CHECK(c.timeout_s > 0, "ep: timeout " << c.timeout_s << " s must be positive");
  FP8MOE_CHECK(!(c.low_latency && c.pull_combine), "ep: pull_combine is an option of the normal mode, not the low-latency one");
  FP8MOE_CHECK(c.ranks_per_node >= 0 && c.ranks_per_node <= c.ranks &&
                   (c.ranks_per_node == 0 || c.ranks % c.ranks_per_node == 0),
               "ep: ranks_per_node " << c.ranks_per_node << " must divide the " << c.ranks << " ranks (0: one node)");
  FP8MOE_CHECK(!(c.low_latency && c.ranks_per_node > 0 && c.ranks_per_node < c.ranks),
               "ep: the two-hop dispatch (ranks_per_node " << c.ranks_per_node << " of " << c.ranks
                                                            << ") is the normal mode's, not the low-latency one's");
}

}  // namespace

BufferLayout buffer_layout(const EpConfig& c) {
  check_config(c);
  const int P = c.ranks, C = c.num_sms / 2;
  const CountsLayout cl{P, C, int(c.experts)};
  const int64_t n = int64_t(P) * c.max_tokens, G = c.hidden / 128, k = c.topk;
  BufferLayout l;
  size_t o = 0;
  auto take = [&](size_t bytes) {
    const size_t at = o;
    o = align_up(o + bytes, 256);
    return at;
  };
  // Normal-mode regions are empty in the low-latency mode and low-latency regions in the normal
  // mode. The flags, the error word and the step counter come first: new_buffer zeroes [0, notify).
  const bool ll = c.low_latency;
  const size_t nm = ll ? 0 : 1, lm = ll ? 1 : 0;
  const int64_t epr = c.experts / P, N = c.max_tokens, M = P * N, R = epr * M;
  l.ready = take(kMaxRanks * 8);
  l.notify_flag = take(nm * kMaxRanks * 8);
  l.dispatch_flag = take(nm * kMaxRanks * kMaxChannels * 8);
  l.combine_flag = take(nm * kMaxRanks * kMaxChannels * 8);
  const int Rn = c.ranks_per_node > 0 ? c.ranks_per_node : P, nodes = P / Rn;
  const size_t th = !ll && nodes > 1 ? 1 : 0;  // the two-hop regions
  l.stage_flag = take(th * kMaxRanks * kMaxChannels * 8);
  l.error = take(32);
  l.ll_step = take(lm * 16);
  l.ll_count_flag = take(lm * size_t(epr * P) * 8);
  l.ll_combine_flag = take(lm * size_t(c.experts) * 8);
  l.notify = take(nm * size_t(P) * cl.length() * 4);
  l.counts = take(nm * size_t(P) * cl.length() * 4);
  l.x = take(nm * size_t(n * c.hidden));
  l.scales = take(nm * size_t(G * scale_ld(n)) * 4);
  l.weights = take(nm * size_t(n * k) * 4);
  l.ids = take(nm * size_t(n * k) * 4);
  l.combine = take(ll || c.pull_combine ? 0 : size_t(c.max_tokens * k * c.hidden) * 2);
  l.combine_in = take(!ll && c.pull_combine ? size_t(n * k * c.hidden) * 2 : 0);
  l.ll_stage_x = take(lm * size_t(R * c.hidden));
  l.ll_stage_scales = take(lm * size_t(R * G) * 4);
  l.ll_stage_slot = take(lm * size_t(R) * 4);
  l.ll_x = take(lm * size_t(R * c.hidden));
  l.ll_scales = take(lm * size_t(G * scale_ld(R)) * 4);
  l.ll_count = take(lm * size_t(epr) * 4);
  l.ll_src_count = take(lm * size_t(epr * P) * 4);
  l.ll_src_slot = take(lm * size_t(R) * 4);
  l.ll_back = take(lm * size_t(N * k * c.hidden) * 2);
  l.stage_range = take(th * kMaxRanks * kMaxChannels * 8);
  l.stage_x = take(th * size_t(nodes * N * c.hidden));
  l.stage_scales = take(th * size_t(nodes * N * G) * 4);
  l.stage_weights = take(th * size_t(nodes * N * k) * 4);
  l.stage_ids = take(th * size_t(nodes * N * k) * 4);
  l.stage_dest = take(th * size_t(nodes * N * Rn) * 4);
  l.total = o;
  l.max_recv = ll ? R : n;
  if (ll)
    FP8MOE_CHECK(c.buffer_bytes == 0 || c.buffer_bytes >= l.total,
                 "ep: low-latency buffer of " << c.buffer_bytes << " bytes is below the " << l.total
                                              << " bytes it needs (" << epr << " local experts x " << P << " sources x "
                                              << N << " tokens of hidden " << c.hidden << ", staged and packed, and "
                                              << N << " x " << k << " rows back)");
  else
    FP8MOE_CHECK(c.buffer_bytes == 0 || c.buffer_bytes >= l.total,
                 "ep: buffer of " << c.buffer_bytes << " bytes is below the " << l.total << " bytes of the worst case ("
                                  << P << " ranks x " << c.max_tokens << " tokens of hidden " << c.hidden
                                  << " all to one rank, and " << c.max_tokens << " x " << k << " rows back)");
  FP8MOE_CHECK(n * k < (int64_t(1) << 31) && c.max_tokens * k < (int64_t(1) << 31) && R < (int64_t(1) << 31),
               "ep: " << n << " rows x top-" << k << " overflow the i32 slot indices");
  return l;
}

// ---- counts ----

int64_t EpCounts::tokens_to(int p, int d) const {
  int64_t n = 0;
  for (int c = 0; c < l_.channels; ++c) n += tokens(p, c, d);
  return n;
}
int64_t EpCounts::slots_to(int p, int d) const {
  int64_t n = 0;
  for (int c = 0; c < l_.channels; ++c) n += slots(p, c, d);
  return n;
}
int64_t EpCounts::received(int d) const {
  int64_t n = 0;
  for (int p = 0; p < l_.ranks; ++p) n += tokens_to(p, d);
  return n;
}
std::vector<int64_t> EpCounts::recv_counts(int d) const {
  std::vector<int64_t> v(size_t(l_.ranks));
  for (int p = 0; p < l_.ranks; ++p) v[size_t(p)] = tokens_to(p, d);
  return v;
}
int64_t EpCounts::returned(int d) const {
  int64_t n = 0;
  for (int p = 0; p < l_.ranks; ++p) n += slots_to(p, d);
  return n;
}
std::vector<int64_t> EpCounts::expert_counts(int d) const {
  const int epr = l_.experts / l_.ranks;
  std::vector<int64_t> v(size_t(epr), 0);
  for (int p = 0; p < l_.ranks; ++p)
    for (int e = 0; e < epr; ++e) v[size_t(e)] += expert(p, d * epr + e);
  return v;
}

// ---- groups ----

EpGroup::EpGroup(const EpConfig& cfg) : cfg_(cfg), layout_(buffer_layout(cfg)) {
  counts_layout_ = CountsLayout{cfg.ranks, cfg.num_sms / 2, int(cfg.experts)};
  int dev = 0, sms = 0;
  FP8MOE_CUDA_CHECK(cudaGetDevice(&dev));
  FP8MOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  FP8MOE_CHECK(cfg.num_sms <= sms, "ep: num_sms " << cfg.num_sms << " above this device's " << sms << " SMs");
}

EpGroup::~EpGroup() {
  // NOTES: no throwing in a destructor; a failing free only leaks.
  for (auto& r : ranks_)
    if (r->counts_host_) cudaFreeHost(r->counts_host_);
  for (void* p : opened_) cudaIpcCloseMemHandle(p);
  for (void* p : owned_) cudaFree(p);
  for (cudaStream_t s : streams_) cudaStreamDestroy(s);
}

namespace {

char* new_buffer(const BufferLayout& l) {
  void* p = nullptr;
  FP8MOE_CUDA_CHECK(cudaMalloc(&p, l.total));
  // The flags and the error word start at 0 (step numbers start at 1).
  FP8MOE_CUDA_CHECK(cudaMemset(p, 0, l.notify));
  return static_cast<char*>(p);
}

// The driver's module loading mode, fetched through the runtime (tensor_map.hpp says why).
bool eager_loading() {
  using GetModeFn = CUresult (*)(CUmoduleLoadingMode*);
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q{};
  FP8MOE_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuModuleGetLoadingMode", &p, 12000, cudaEnableDefault, &q));
  FP8MOE_CHECK(q == cudaDriverEntryPointSuccess && p != nullptr,
               "cudaGetDriverEntryPointByVersion(cuModuleGetLoadingMode): symbol not found");
  CUmoduleLoadingMode mode{};
  FP8MOE_CHECK(reinterpret_cast<GetModeFn>(p)(&mode) == CUDA_SUCCESS, "cuModuleGetLoadingMode failed");
  return mode == CU_MODULE_EAGER_LOADING;
}

}  // namespace

void prepare_local_ranks() {
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  setenv("CUDA_MODULE_LOADING", "EAGER", 0);
}

std::unique_ptr<EpGroup> EpGroup::local(const EpConfig& cfg) {
  std::unique_ptr<EpGroup> g(new EpGroup(cfg));
  const int P = cfg.ranks;
  // Every rank's blocks spin until their peers' blocks have written: all of them must be resident
  // at once, or the step waits for blocks that cannot start.
  int dev = 0, sms = 0;
  FP8MOE_CUDA_CHECK(cudaGetDevice(&dev));
  FP8MOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  g->blocks_per_sm_ = P * cfg.num_sms <= sms ? 1 : 2;
  // NOTES: streams beyond the device's hardware queues share them in creation order, so a rank's
  // kernel could queue behind a peer's kernel that spins waiting for it.
  const char* conn = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  const int queues = conn ? std::atoi(conn) : 8;
  FP8MOE_CHECK(P <= queues, "ep: " << P << " ranks in one process need as many hardware queues; "
                                   << "CUDA_DEVICE_MAX_CONNECTIONS is " << queues
                                   << " (prepare_local_ranks() or the variable set to 32 before the first CUDA call)");
  FP8MOE_CHECK(P == 1 || eager_loading(), "ep: " << P << " ranks in one process need every kernel loaded before "
                                                    "the first step, and this process loads them lazily "
                                                    "(prepare_local_ranks() or CUDA_MODULE_LOADING=EAGER before "
                                                    "the first CUDA call)");
  int per_sm_d = 0, per_sm_c = 0;
  if (cfg.low_latency) {
    FP8MOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm_d, ll_dispatch_kernel_ptr(), ll_threads(), 0));
    FP8MOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm_c, ll_combine_kernel_ptr(), ll_threads(), 0));
  } else {
    const bool two_hop = cfg.ranks_per_node > 0 && cfg.ranks_per_node < P;
    FP8MOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &per_sm_d, two_hop ? two_hop_dispatch_kernel_ptr(g->blocks_per_sm_) : dispatch_kernel_ptr(g->blocks_per_sm_),
        dispatch_threads(), 0));
    FP8MOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &per_sm_c, combine_kernel_ptr(g->blocks_per_sm_), combine_threads(), 0));
  }
  const int fit = std::min({per_sm_d, per_sm_c, cfg.low_latency ? per_sm_d : g->blocks_per_sm_}) * sms;
  FP8MOE_CHECK(P * cfg.num_sms <= fit, "ep: " << P << " ranks x " << cfg.num_sms << " SMs on one device need "
                                              << P * cfg.num_sms << " resident blocks; it holds " << fit
                                              << " (lower num_sms)");
  for (int r = 0; r < P; ++r) g->owned_.push_back(new_buffer(g->layout_));
  for (int r = 0; r < P; ++r) {
    auto rank = std::make_unique<EpRank>();
    rank->group_ = g.get();
    rank->me_ = r;
    for (int q = 0; q < P; ++q) rank->peer_[q] = static_cast<char*>(g->owned_[size_t(q)]);
    FP8MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&rank->stream_, cudaStreamNonBlocking));
    g->streams_.push_back(rank->stream_);
    if (!cfg.low_latency)
      FP8MOE_CUDA_CHECK(cudaMallocHost(&rank->counts_host_, g->layout_.counts - g->layout_.notify));
    g->ranks_.push_back(std::move(rank));
  }
  FP8MOE_CUDA_CHECK(cudaDeviceSynchronize());
  return g;
}

std::unique_ptr<EpGroup> EpGroup::ipc(const EpConfig& cfg, Comm& comm, cudaStream_t stream) {
  FP8MOE_CHECK(comm.size() == cfg.ranks, "ep ipc: communicator of " << comm.size() << " ranks for " << cfg.ranks);
  std::unique_ptr<EpGroup> g(new EpGroup(cfg));
  const int P = cfg.ranks, me = comm.rank();
  char* mine = new_buffer(g->layout_);
  g->owned_.push_back(mine);
  FP8MOE_CUDA_CHECK(cudaDeviceSynchronize());
  // What a peer needs: the handle, and the host, since the single-hop path reaches only peers of
  // its own node.
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  cudaIpcMemHandle_t h;
  FP8MOE_CUDA_CHECK(cudaIpcGetMemHandle(&h, mine));
  std::string msg(reinterpret_cast<const char*>(&h), sizeof(h));
  msg += host;
  const std::vector<std::string> all = comm.exchange(msg);
  auto rank = std::make_unique<EpRank>();
  rank->group_ = g.get();
  rank->me_ = me;
  for (int q = 0; q < P; ++q) {
    const std::string& m = all[size_t(q)];
    FP8MOE_CHECK(m.size() >= sizeof(h), "ep ipc: rank " << q << " sent " << m.size() << " bytes for its handle");
    const std::string their_host = m.substr(sizeof(h));
    FP8MOE_CHECK(their_host == host, "ep ipc: rank " << q << " is on host '" << their_host << "', rank " << me
                                                     << " on '" << host
                                                     << "': the single-hop kernels need every rank on one node");
    if (q == me) {
      rank->peer_[q] = mine;
      continue;
    }
    cudaIpcMemHandle_t theirs;
    std::memcpy(&theirs, m.data(), sizeof(theirs));
    void* p = nullptr;
    const cudaError_t e = cudaIpcOpenMemHandle(&p, theirs, cudaIpcMemLazyEnablePeerAccess);
    FP8MOE_CHECK(e == cudaSuccess, "ep ipc: rank " << me << " cannot map rank " << q << "'s buffer ("
                                                   << cudaGetErrorString(e) << "): no peer access between their GPUs?");
    g->opened_.push_back(p);
    rank->peer_[q] = static_cast<char*>(p);
  }
  rank->stream_ = stream;
  if (!cfg.low_latency)
    FP8MOE_CUDA_CHECK(cudaMallocHost(&rank->counts_host_, g->layout_.counts - g->layout_.notify));
  g->ranks_.push_back(std::move(rank));
  comm.exchange("");  // every peer has mapped every buffer before any step writes into one
  return g;
}

// ---- steps ----

void EpRank::require_usable(const char* step) const {
  FP8MOE_CHECK(!broken_, "ep " << step << " on rank " << me_
                               << ": an earlier step of this group timed out; its buffers cannot be used again");
}

void EpRank::require_mode(bool low_latency, const char* step) const {
  FP8MOE_CHECK(group_->config().low_latency == low_latency,
               "ep " << step << " on rank " << me_ << ": the group was made "
                     << (low_latency ? "for the normal mode (EpConfig::low_latency is false)"
                                     : "for the low-latency mode (EpConfig::low_latency)"));
}

StepArgs EpRank::next_step(int64_t tokens) {
  const EpConfig& c = group_->config();
  StepArgs a;
  for (int q = 0; q < c.ranks; ++q) a.peer[q] = peer_[q];
  a.layout = group_->layout();
  a.counts = group_->counts_layout();
  a.me = me_;
  a.ranks = c.ranks;
  a.channels = c.num_sms / 2;
  a.hidden = c.hidden;
  a.topk = c.topk;
  a.experts_per_rank = c.experts / c.ranks;
  a.tokens = tokens;
  a.step = ++step_;
  a.timeout_ns = uint64_t(c.timeout_s * 1e9);
  a.blocks_per_sm = group_->blocks_per_sm();
  a.pull = c.pull_combine;
  a.ranks_per_node = c.ranks_per_node > 0 ? c.ranks_per_node : c.ranks;
  a.max_tokens = c.max_tokens;
  return a;
}

void EpRank::notify(const TensorView& idx) {
  require_usable("notify");
  require_mode(false, "notify");
  const EpConfig& c = group_->config();
  check_tensor(idx, "ep notify idx", DType::i32, 2);
  FP8MOE_CHECK(idx.device == Device::cuda && idx.is_contiguous(), "ep notify: idx " << idx.str() << " must be a contiguous device tensor");
  FP8MOE_CHECK(idx.size(1) == c.topk, "ep notify: idx " << idx.str() << " for top-" << c.topk);
  FP8MOE_CHECK(idx.size(0) <= c.max_tokens,
               "ep notify: " << idx.size(0) << " tokens above the buffer's worst case of " << c.max_tokens);
  const StepArgs a = next_step(idx.size(0));
  launch_notify(a, idx.ptr<const int32_t>(), stream_);
  const size_t bytes = group_->layout().counts - group_->layout().notify;
  FP8MOE_CUDA_CHECK(cudaMemcpyAsync(counts_host_, peer_[me_] + group_->layout().counts, bytes, cudaMemcpyDeviceToHost, stream_));
  tokens_ = idx.size(0);
  counted_ = false;
}

const EpCounts& EpRank::counts() {
  FP8MOE_CHECK(tokens_ >= 0, "ep counts on rank " << me_ << ": no notify yet");
  if (!counted_) {
    check();
    const CountsLayout& l = group_->counts_layout();
    counts_ = EpCounts(l, std::vector<int32_t>(counts_host_, counts_host_ + size_t(l.ranks) * l.length()));
    counted_ = true;
  }
  return counts_;
}

void EpRank::check() {
  FP8MOE_CUDA_CHECK(cudaStreamSynchronize(stream_));
  uint32_t e[8] = {};
  FP8MOE_CUDA_CHECK(cudaMemcpy(e, peer_[me_] + group_->layout().error, sizeof(e), cudaMemcpyDeviceToHost));
  if (e[0] == 0) return;
  broken_ = true;
  const char* step = step_name(e[1]);
  if (Failure(e[2]) == Failure::expert_id)
    throw Error("ep " + std::string(step) + " on rank " + std::to_string(me_) + ": idx[" + std::to_string(e[3]) +
                ", " + std::to_string(e[4]) + "] outside [0, " + std::to_string(group_->config().experts) + ")");
  if (Failure(e[2]) == Failure::overflow)
    throw Error("ep " + std::string(step) + " on rank " + std::to_string(me_) + ": " + std::to_string(e[4]) +
                " slots for expert " + std::to_string(e[3]) + ", above the buffer's " +
                std::to_string(group_->config().max_tokens) +
                " rows per (expert, source): a token lists that expert more than once");
  const bool ll = Step(e[1]) == Step::ll_dispatch || Step(e[1]) == Step::ll_combine;
  const char* what = Failure(e[2]) == Failure::ready    ? "to start the step"
                     : Failure(e[2]) == Failure::counts ? "for its counts"
                                                        : "for its rows";
  std::ostringstream os;
  os << "ep " << step << " on rank " << me_ << ": timed out after " << group_->config().timeout_s
     << " s waiting for rank " << e[3] << " " << what;
  if (Failure(e[2]) == Failure::rows) os << (ll ? " (expert " : " (channel ") << e[4] << ")";
  os << ": a peer did not run the same steps, or died";
  throw Error(os.str());
}

void EpRank::dispatch(const QuantizedView& x, const TensorView& weights, const TensorView& idx,
                      const TensorView& slot_row) {
  require_usable("dispatch");
  require_mode(false, "dispatch");
  const EpConfig& c = group_->config();
  FP8MOE_CHECK(counted_, "ep dispatch on rank " << me_ << ": counts() of the last notify must be read first");
  const int64_t T = tokens_, D = c.hidden, G = D / 128, k = c.topk;
  FP8MOE_CHECK(x.kind == ScaleKind::tile_1x128 && x.values.dtype == DType::e4m3 && x.values.ndim == 2 &&
                   x.values.size(0) == T && x.values.size(1) == D && x.values.is_contiguous(),
               "ep dispatch: x " << x.values.str() << " must be [" << T << ", " << D << "] e4m3 with 1x128 scales");
  FP8MOE_CHECK(x.scales.dtype == DType::f32 && x.scales.ndim == 2 && x.scales.size(0) == G && x.scales.size(1) >= T &&
                   x.scales.is_contiguous(),
               "ep dispatch: scales " << x.scales.str() << " must be [" << G << ", >= " << T << "] f32");
  for (const auto& [t, name, dt] : {std::tuple{&weights, "weights", DType::f32}, std::tuple{&idx, "idx", DType::i32},
                                    std::tuple{&slot_row, "slot_row", DType::i32}}) {
    check_tensor(*t, name, dt, 2);
    FP8MOE_CHECK(t->size(0) == T && t->size(1) == k && t->is_contiguous() && t->device == Device::cuda,
                 "ep dispatch: " << name << " " << t->str() << " must be [" << T << ", " << k << "] on the device");
  }
  FP8MOE_CHECK(aligned16(x.values.data), "ep dispatch: x values must start on a 16-byte boundary");
  const StepArgs a = next_step(T);
  (a.ranks_per_node < a.ranks ? launch_two_hop_dispatch : launch_dispatch)(
      a, x.values.ptr<const uint8_t>(), x.scales.ptr<const float>(), x.scales.size(1), weights.ptr<const float>(),
      idx.ptr<const int32_t>(), slot_row.ptr<int32_t>(), stream_);
}

EpRank::Received EpRank::received() const {
  require_mode(false, "received");
  FP8MOE_CHECK(counted_, "ep received on rank " << me_ << ": no counts yet");
  const EpConfig& c = group_->config();
  const BufferLayout& l = group_->layout();
  Received r;
  r.rows = counts_.received(me_);
  char* b = peer_[me_];
  r.x.values = TensorView(b + l.x, DType::e4m3, {r.rows, c.hidden}, Device::cuda);
  r.x.scales = TensorView(b + l.scales, DType::f32, {c.hidden / 128, scale_ld(r.rows)}, Device::cuda);
  r.x.kind = ScaleKind::tile_1x128;
  r.weights = TensorView(b + l.weights, DType::f32, {r.rows, c.topk}, Device::cuda);
  r.ids = TensorView(b + l.ids, DType::i32, {r.rows, c.topk}, Device::cuda);
  return r;
}

TensorView EpRank::combine_input() const {
  const EpConfig& c = group_->config();
  FP8MOE_CHECK(c.pull_combine, "ep combine_input: the group was not made with pull_combine");
  FP8MOE_CHECK(counted_, "ep combine_input on rank " << me_ << ": no counts yet");
  return TensorView(peer_[me_] + group_->layout().combine_in, DType::bf16, {counts_.returned(me_), c.hidden},
                    Device::cuda);
}

void EpRank::combine(const TensorView& rows, const TensorView& slot_row, const TensorView& weights,
                     const TensorView& out, bool accumulate) {
  require_usable("combine");
  require_mode(false, "combine");
  const EpConfig& c = group_->config();
  FP8MOE_CHECK(counted_, "ep combine on rank " << me_ << ": no counts of a notify");
  const int64_t T = tokens_, D = c.hidden, k = c.topk, n = counts_.returned(me_);
  check_tensor(rows, "ep combine rows", DType::bf16, 2);
  FP8MOE_CHECK(rows.size(0) == n && rows.size(1) == D && rows.is_contiguous() && aligned16(rows.data),
               "ep combine: rows " << rows.str() << " must be [" << n << ", " << D << "] bf16, 16-byte aligned");
  check_tensor(slot_row, "ep combine slot_row", DType::i32, 2);
  FP8MOE_CHECK(slot_row.size(0) == T && slot_row.size(1) == k, "ep combine: slot_row " << slot_row.str() << " for [" << T << ", " << k << "]");
  if (weights.defined()) {
    check_tensor(weights, "ep combine weights", DType::f32, 2);
    FP8MOE_CHECK(weights.size(0) == T && weights.size(1) == k, "ep combine: weights " << weights.str() << " for [" << T << ", " << k << "]");
  }
  check_tensor(out, "ep combine out", DType::f32, 2);
  FP8MOE_CHECK(out.size(0) == T && out.size(1) == D && out.is_contiguous() && aligned16(out.data),
               "ep combine: out " << out.str() << " must be [" << T << ", " << D << "] f32, 16-byte aligned");
  if (c.pull_combine && rows.data != peer_[me_] + group_->layout().combine_in && n > 0)
    FP8MOE_CUDA_CHECK(cudaMemcpyAsync(combine_input().data, rows.data, size_t(n * D) * 2, cudaMemcpyDeviceToDevice,
                                      stream_));
  const StepArgs a = next_step(T);
  launch_combine(a, rows.data, slot_row.ptr<const int32_t>(), weights.defined() ? weights.ptr<const float>() : nullptr,
                 out.ptr<float>(), accumulate, stream_);
}

// ---- low-latency mode ----

LlArgs EpRank::ll_args(int64_t tokens) const {
  const EpConfig& c = group_->config();
  LlArgs a;
  for (int q = 0; q < c.ranks; ++q) a.peer[q] = peer_[q];
  a.layout = group_->layout();
  a.me = me_;
  a.ranks = c.ranks;
  a.hidden = c.hidden;
  a.topk = c.topk;
  a.experts = c.experts;
  a.experts_per_rank = c.experts / c.ranks;
  a.max_tokens = c.max_tokens;
  a.tokens = tokens;
  a.timeout_ns = uint64_t(c.timeout_s * 1e9);
  a.blocks = c.num_sms;
  return a;
}

void EpRank::require_no_receive(const char* step) const {
  FP8MOE_CHECK(pending_.phase == 0, "ep " << step << " on rank " << me_ << ": the low-latency "
                                          << (pending_.phase == 1 ? "dispatch" : "combine")
                                          << " queued with a hook has not been received (low_latency_receive)");
}

void EpRank::low_latency_dispatch(const QuantizedView& x, const TensorView& idx, bool hook) {
  require_usable("low-latency dispatch");
  require_mode(true, "low-latency dispatch");
  require_no_receive("low-latency dispatch");
  const EpConfig& c = group_->config();
  const int64_t D = c.hidden, G = D / 128, k = c.topk;
  check_tensor(idx, "ep low-latency dispatch idx", DType::i32, 2);
  const int64_t T = idx.size(0);
  FP8MOE_CHECK(T <= c.max_tokens, "ep low-latency dispatch on rank " << me_ << ": " << T
                                      << " tokens above the buffer's " << c.max_tokens << " per rank (max_tokens)");
  FP8MOE_CHECK(idx.size(1) == k && idx.is_contiguous() && idx.device == Device::cuda,
               "ep low-latency dispatch: idx " << idx.str() << " must be [" << T << ", " << k << "] on the device");
  FP8MOE_CHECK(x.kind == ScaleKind::tile_1x128 && x.values.dtype == DType::e4m3 && x.values.ndim == 2 &&
                   x.values.size(0) == T && x.values.size(1) == D && x.values.is_contiguous() &&
                   x.values.device == Device::cuda,
               "ep low-latency dispatch: x " << x.values.str() << " must be [" << T << ", " << D
                                             << "] e4m3 on the device with 1x128 scales");
  FP8MOE_CHECK(x.scales.dtype == DType::f32 && x.scales.ndim == 2 && x.scales.size(0) == G && x.scales.size(1) >= T &&
                   x.scales.is_contiguous() && x.scales.device == Device::cuda,
               "ep low-latency dispatch: scales " << x.scales.str() << " must be [" << G << ", >= " << T << "] f32");
  FP8MOE_CHECK(aligned16(x.values.data), "ep low-latency dispatch: x values must start on a 16-byte boundary");
  const LlArgs a = ll_args(T);
  launch_ll_dispatch(a, x.values.ptr<const uint8_t>(), x.scales.ptr<const float>(), x.scales.size(1),
                     idx.ptr<const int32_t>(), hook ? kPhaseSend : kPhaseSend | kPhaseReceive, stream_);
  ll_tokens_ = T;
  if (hook) {
    pending_ = PendingReceive{};
    pending_.phase = 1;
    pending_.args = a;
    pending_.x = x.values.ptr<const uint8_t>();
    pending_.x_scales = x.scales.ptr<const float>();
    pending_.x_ld = x.scales.size(1);
    pending_.idx = idx.ptr<const int32_t>();
  }
}

EpRank::LowLatencyReceived EpRank::low_latency_received() const {
  require_mode(true, "low-latency received");
  require_no_receive("low-latency received");
  const EpConfig& c = group_->config();
  const BufferLayout& l = group_->layout();
  const int64_t P = c.ranks, epr = c.experts / P, M = P * c.max_tokens, R = epr * M;
  char* b = peer_[me_];
  LowLatencyReceived r;
  r.x.values = TensorView(b + l.ll_x, DType::e4m3, {R, c.hidden}, Device::cuda);
  r.x.scales = TensorView(b + l.ll_scales, DType::f32, {c.hidden / 128, scale_ld(R)}, Device::cuda);
  r.x.kind = ScaleKind::tile_1x128;
  r.counts = TensorView(b + l.ll_count, DType::i32, {epr}, Device::cuda);
  r.src_counts = TensorView(b + l.ll_src_count, DType::i32, {epr, P}, Device::cuda);
  r.src_slot = TensorView(b + l.ll_src_slot, DType::i32, {R}, Device::cuda);
  r.rows_per_expert = M;
  return r;
}

void EpRank::low_latency_combine(const TensorView& rows, const TensorView& weights, const TensorView& out,
                                 bool accumulate, bool hook) {
  require_usable("low-latency combine");
  require_mode(true, "low-latency combine");
  require_no_receive("low-latency combine");
  const EpConfig& c = group_->config();
  FP8MOE_CHECK(ll_tokens_ >= 0, "ep low-latency combine on rank " << me_ << ": no low-latency dispatch before it");
  const int64_t T = ll_tokens_, D = c.hidden, k = c.topk, R = c.experts * c.max_tokens;
  check_tensor(rows, "ep low-latency combine rows", DType::bf16, 2);
  FP8MOE_CHECK(rows.size(0) == R && rows.size(1) == D && rows.is_contiguous() && aligned16(rows.data) &&
                   rows.device == Device::cuda,
               "ep low-latency combine: rows " << rows.str() << " must be [" << R << ", " << D
                                               << "] bf16 on the device, 16-byte aligned (the received layout)");
  if (weights.defined()) {
    check_tensor(weights, "ep low-latency combine weights", DType::f32, 2);
    FP8MOE_CHECK(weights.size(0) == T && weights.size(1) == k && weights.is_contiguous() &&
                     weights.device == Device::cuda,
                 "ep low-latency combine: weights " << weights.str() << " must be [" << T << ", " << k << "] on the device");
  }
  check_tensor(out, "ep low-latency combine out", DType::f32, 2);
  FP8MOE_CHECK(out.size(0) == T && out.size(1) == D && out.is_contiguous() && aligned16(out.data) &&
                   out.device == Device::cuda,
               "ep low-latency combine: out " << out.str() << " must be [" << T << ", " << D
                                              << "] f32 on the device, 16-byte aligned");
  const LlArgs a = ll_args(T);
  const float* w = weights.defined() ? weights.ptr<const float>() : nullptr;
  launch_ll_combine(a, rows.data, w, out.ptr<float>(), accumulate, hook ? kPhaseSend : kPhaseSend | kPhaseReceive,
                    stream_);
  if (hook) {
    pending_ = PendingReceive{};
    pending_.phase = 2;
    pending_.args = a;
    pending_.rows = rows.data;
    pending_.weights = w;
    pending_.out = out.ptr<float>();
    pending_.accumulate = accumulate;
  }
}

void EpRank::low_latency_receive() {
  require_usable("low-latency receive");
  require_mode(true, "low-latency receive");
  FP8MOE_CHECK(pending_.phase != 0,
               "ep low-latency receive on rank " << me_ << ": no dispatch or combine was queued with a hook");
  const PendingReceive p = pending_;
  pending_ = PendingReceive{};
  if (p.phase == 1)
    launch_ll_dispatch(p.args, p.x, p.x_scales, p.x_ld, p.idx, kPhaseReceive, stream_);
  else
    launch_ll_combine(p.args, p.rows, p.weights, p.out, p.accumulate, kPhaseReceive, stream_);
}

}  // namespace fp8moe::cuda::ep
