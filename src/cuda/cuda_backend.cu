// CudaBackend: the Backend interface on one NVIDIA GPU (see cuda_backend.hpp). Argument checks and
// kernels live in kernel_api.hpp's functions; this class owns memory and routes ops.
#include "cuda_backend.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "cuda/runtime/caching_allocator.hpp"
#include "cuda/runtime/cuda_check.hpp"
#include "cuda/runtime/cuda_graph.hpp"
#include "cuda/runtime/cuda_stream.hpp"
#include "kernel_api.hpp"
#include "cuda/runtime/device_checks.hpp"
#include "cuda/ops/model_ops.hpp"
#include "cuda/attention/mla_decode.hpp"
#include "cuda/moe/moe_api.hpp"

namespace fp8moe {

bool cuda_device_available() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device / no driver" error
    return false;
  }
  return n > 0;
}

namespace {

// FP8MOE_PROFILE_OPS=1: every op records a CUDA event before and after itself on its stream; the
// GPU time between the two is added to a per-op table, printed when the backend is destroyed
// (sorted by the time after each op's first call), with the sum against the wall time of the
// profiled span: the rest is the time the GPU waited for the host. 'host ms' is the time
// the host spent inside each op: an op far above its GPU time waits for the device or the driver.
// Nothing synchronizes per op, so the run keeps its speed; an op that calls another op counts
// both, and its events are read only after it has ended.
// The allocation ops (empty, empty_host) enqueue no device work: they count the host time they
// take, which is what they cost (two events around nothing would time the events).
// FP8MOE_PROFILE_OPS=shapes: the GEMMs count per problem (dtypes, M x N x K, transposes), the
// copies per direction and source shape.
class OpTimes {
 public:
  static OpTimes& get() {
    static OpTimes t;
    return t;
  }
  bool enabled() const { return enabled_; }
  bool by_shape() const { return by_shape_; }
  // A new op: its id, with its start event recorded on the op's stream. end(id) records its
  // stop event on the same stream.
  int64_t begin(std::string op, cudaStream_t stream, bool host_only = false) {
    if (pending_.size() >= kBatch) resolve();
    if (!started_) {
      started_ = true;
      t0_ = std::chrono::steady_clock::now();
    }
    if (host_only) {  // timed from after the table's own work
      pending_.push_back({std::move(op), {}, false, {}, 0.0, nullptr, true});
      pending_.back().host_start = std::chrono::steady_clock::now();
      return base_ + int64_t(pending_.size()) - 1;
    }
    if (free_.empty()) {
      cudaEvent_t a = nullptr, b = nullptr;
      FP8MOE_CUDA_CHECK(cudaEventCreate(&a));
      FP8MOE_CUDA_CHECK(cudaEventCreate(&b));
      free_.push_back({a, b});
    }
    pending_.push_back({std::move(op), free_.back(), false, std::chrono::steady_clock::now(), 0.0});
    free_.pop_back();
    pending_.back().stream = stream;
    FP8MOE_CUDA_CHECK(cudaEventRecord(pending_.back().ev.first, stream));
    return base_ + int64_t(pending_.size()) - 1;
  }
  void end(int64_t id) {
    Pending& p = pending_[size_t(id - base_)];
    if (!p.host_only) (void)cudaEventRecord(p.ev.second, p.stream);
    p.ended = true;
    p.host = std::chrono::duration<double>(std::chrono::steady_clock::now() - p.host_start).count();
  }
  void print() {
    if (!enabled_ || !started_) return;
    resolve();
    const double wall = std::chrono::duration<double>(t_last_ - t0_).count();
    std::vector<std::pair<std::string, Entry>> rows(table_.begin(), table_.end());
    // Sorted by the time after the first calls: the steady state.
    std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) {
      return a.second.total - a.second.first > b.second.total - b.second.first;
    });
    double total = 0;
    for (const auto& r : rows) total += r.second.total;
    std::fprintf(stderr,
                 "# cuda backend op times (FP8MOE_PROFILE_OPS, GPU time per op): ops %.3f s of %.3f s wall; "
                 "'first': the first call (plans, module loading), 'rest': the mean of the others\n"
                 "%-44s %8s %11s %7s %10s %10s %10s\n",
                 total, wall, "op", "calls", "ms", "share", "first ms", "rest ms", "host ms");
    for (const auto& [op, e] : rows)
      std::fprintf(stderr, "%-44s %8lld %11.2f %6.1f%% %10.3f %10.4f %10.2f\n", op.c_str(), (long long)e.calls,
                   e.total * 1e3, 100.0 * e.total / total, e.first * 1e3,
                   e.calls > 1 ? (e.total - e.first) * 1e3 / double(e.calls - 1) : 0.0, e.host * 1e3);
    double alloc = 0, alloc_rest = 0, rest = 0;
    for (const auto& [op, e] : rows) {
      rest += e.total - e.first;
      if (op == "empty" || op == "empty_host") {
        alloc += e.total;
        alloc_rest += e.total - e.first;
      }
    }
    std::fprintf(stderr,
                 "# allocation (empty, empty_host; host time): %.2f ms, %.1f%% of op time; after the first calls "
                 "(one-time pinned buffers and pool growth) %.2f ms, %.1f%% of the op time after the first calls\n",
                 alloc * 1e3, total > 0 ? 100.0 * alloc / total : 0.0, alloc_rest * 1e3,
                 rest > 0 ? 100.0 * alloc_rest / rest : 0.0);
    const cuda::AllocatorStats a = cuda::allocator_stats();
    std::fprintf(stderr,
                 "# caching allocator: %lld requests, %lld from the device pool (the rest from the cache); "
                 "tensors at peak %.1f MiB, reserved %.1f MiB (peak %.1f MiB)\n",
                 (long long)a.allocations, (long long)a.pool_allocations, double(a.peak_allocated) / 1048576.0,
                 double(a.reserved) / 1048576.0, double(a.peak_reserved) / 1048576.0);
  }

 private:
  static constexpr size_t kBatch = 4096;
  OpTimes()
      : enabled_(std::getenv("FP8MOE_PROFILE_OPS") != nullptr),
        by_shape_(enabled_ && std::string_view(std::getenv("FP8MOE_PROFILE_OPS")) == "shapes") {}
  // Adds the times of the ops that have ended, oldest first, up to the first one still running
  // (an op that encloses others ends after them), and recycles their events.
  void resolve() {
    while (!pending_.empty() && pending_.front().ended) {
      const Pending& p = pending_.front();
      double sec = p.host;
      if (!p.host_only) {
        float ms = 0;
        FP8MOE_CUDA_CHECK(cudaEventSynchronize(p.ev.second));
        FP8MOE_CUDA_CHECK(cudaEventElapsedTime(&ms, p.ev.first, p.ev.second));
        sec = ms * 1e-3;
        free_.push_back(p.ev);
      }
      t_last_ = std::chrono::steady_clock::now();
      auto& e = table_[p.op];
      if (e.calls++ == 0) e.first = sec;
      e.total += sec;
      e.host += p.host;
      pending_.pop_front();
      ++base_;
    }
  }
  bool enabled_, by_shape_;
  bool started_ = false;
  std::chrono::steady_clock::time_point t0_, t_last_;
  struct Pending {
    std::string op;
    std::pair<cudaEvent_t, cudaEvent_t> ev;  // start, stop
    bool ended;
    std::chrono::steady_clock::time_point host_start;
    double host;  // seconds the host spent inside the op
    cudaStream_t stream = nullptr;
    bool host_only = false;  // no events: its time is the host's
  };
  std::deque<Pending> pending_;  // in the order the ops began; pending_[i] has id base_ + i
  int64_t base_ = 0;
  std::vector<std::pair<cudaEvent_t, cudaEvent_t>> free_;
  struct Entry {
    int64_t calls = 0;
    double total = 0, first = 0, host = 0;  // seconds
  };
  std::map<std::string, Entry> table_;
};

class TimedOp {
 public:
  // `shape` (called only when profiling by shape) names the op's problem.
  struct HostOnly {};
  TimedOp(HostOnly, const char* op) {
    auto& t = OpTimes::get();
    if (t.enabled()) id_ = t.begin(op, nullptr, true);
  }
  template <class Shape = std::nullptr_t>
  TimedOp(cudaStream_t stream, const char* op, Shape shape = nullptr) {
    auto& t = OpTimes::get();
    if (!t.enabled()) return;
    if constexpr (std::is_same_v<Shape, std::nullptr_t>) {
      id_ = t.begin(op, stream);
    } else {
      id_ = t.begin(t.by_shape() ? std::string(op) + " " + shape() : std::string(op), stream);
    }
  }
  ~TimedOp() {
    if (id_ >= 0) OpTimes::get().end(id_);
  }
  TimedOp(const TimedOp&) = delete;
  TimedOp& operator=(const TimedOp&) = delete;

 private:
  int64_t id_ = -1;
};
#define FP8MOE_TIMED_OP(op) const TimedOp timed_op_(s_, op)
#define FP8MOE_TIMED_HOST_OP(op) const TimedOp timed_op_(TimedOp::HostOnly{}, op)
#define FP8MOE_TIMED_GEMM(op, a, b, ta, tb) const TimedOp timed_op_(s_, op, [&] { return gemm_shape(a, b, ta, tb); })

// "bf16xbf16 MxNxK NT" for D = op(a) op(b), op = transpose where the flag is set; "f32xf32
// GxMxNxK NT" for G matrices of 3-D views.
std::string gemm_shape(const TensorView& a, const TensorView& b, bool ta, bool tb) {
  if (a.ndim == 3)
    return std::string(dtype_name(a.dtype)) + "x" + std::string(dtype_name(b.dtype)) + " " + std::to_string(a.size(0)) +
           "x" + std::to_string(a.size(1)) + "x" + std::to_string(tb ? b.size(1) : b.size(2)) + "x" +
           std::to_string(a.size(2)) + " N" + (tb ? "T" : "N");
  const int64_t M = ta ? a.size(1) : a.size(0), K = ta ? a.size(0) : a.size(1), N = tb ? b.size(0) : b.size(1);
  return std::string(dtype_name(a.dtype)) + "x" + std::string(dtype_name(b.dtype)) + " " + std::to_string(M) + "x" +
         std::to_string(N) + "x" + std::to_string(K) + " " + (ta ? "T" : "N") + (tb ? "T" : "N");
}

class CudaBackend final : public Backend {
 public:
  ~CudaBackend() override { OpTimes::get().print(); }
  explicit CudaBackend(bool gemm_via_cublaslt) : cublaslt_(gemm_via_cublaslt) {
    FP8MOE_CUDA_CHECK(cudaFree(nullptr));  // create the context now, not inside the first timed call
    FP8MOE_CUDA_CHECK(cudaGetDevice(&device_));
    // The backend's own compute stream: ops never run on the legacy stream, so that a
    // communication or copy stream beside it overlaps with them.
    compute_ = cuda::make_stream();
    set_stream(compute_);
    hopper_ = cuda::sm90_available();
  }

  Stream stream() const override { return current_; }
  Stream new_stream() override { return cuda::make_stream(); }
  Event new_event() override { return cuda::make_event(); }
  void set_stream(const Stream& s) override {
    FP8MOE_CHECK(s.device() == Device::cuda, "set_stream: a stream of the cuda backend is needed, got one of the "
                                                 << (s.device() == Device::cpu ? "host" : "other device"));
    current_ = s;
    s_ = cuda::native(s);
  }

  // The op profile's events cannot be read back from a replayed graph: it times eager steps.
  bool can_capture() const override { return !OpTimes::get().enabled(); }
  void begin_capture() override { cuda::begin_capture(s_); }
  Graph end_capture() override { return cuda::end_capture(s_); }

  std::string name() const override { return cublaslt_ ? "cublaslt" : "cuda"; }
  Device device() const override { return Device::cuda; }
  // Every op has a kernel here; the grouped FP8 GEMMs have only the sm_90a ones (the dense FP8
  // GEMM falls back to cuBLASLt elsewhere), so on another GPU they are unsupported.
  bool supports(Op op) const override {
    switch (op) {
      case Op::grouped_gemm_fp8_contiguous:
      case Op::grouped_gemm_fp8_masked:
      case Op::grouped_wgrad_fp8: return hopper_;
      default: return true;
    }
  }

  Tensor zeros(DType dtype, std::initializer_list<int64_t> shape) override {
    FP8MOE_TIMED_OP("zeros");
    return allocate(dtype, shape, true);
  }
  Tensor empty(DType dtype, std::initializer_list<int64_t> shape) override {
    FP8MOE_TIMED_HOST_OP("empty");
    return allocate(dtype, shape, false);
  }

  void copy(const TensorView& dst, const TensorView& src) override {
    // By shape: the direction and the source's shape and dtype.
    const TimedOp timed_op_(s_, "copy", [&] {
      const char* dir[2][2] = {{"h2h", "h2d"}, {"d2h", "d2d"}};
      return std::string(dir[src.device == Device::cuda][dst.device == Device::cuda]) + " " + src.str();
    });
    FP8MOE_CHECK(dst.nbytes() == src.nbytes() && dst.dtype == src.dtype,
                 "copy: dst " << dst.str() << " and src " << src.str() << " differ in dtype or size");
    FP8MOE_CHECK(dst.is_contiguous() && src.is_contiguous(), "copy: dst and src must be contiguous");
    if (src.nbytes() == 0) return;
    FP8MOE_CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, src.nbytes(), cudaMemcpyDefault, s_));
    // A copy into host memory is a read-back: the host waits for this stream (only), so that the
    // caller can read it. From pageable host memory CUDA has staged the source before returning;
    // from page-locked memory the host waits too, so that the caller may overwrite its source.
    if (dst.device == Device::cpu || (src.device == Device::cpu && is_page_locked(src.data))) {
      FP8MOE_CUDA_CHECK(cudaStreamSynchronize(s_));
      ++host_waits_;
    }
  }

  void zero(const TensorView& dst) override {
    FP8MOE_TIMED_OP("zero");
    FP8MOE_CHECK(dst.device == Device::cuda && dst.is_contiguous(),
                 "zero: " << dst.str() << " must be a contiguous tensor on the GPU");
    if (dst.nbytes() > 0) FP8MOE_CUDA_CHECK(cudaMemsetAsync(dst.data, 0, dst.nbytes(), s_));
  }

  Tensor empty_host(DType dtype, std::initializer_list<int64_t> shape) override {
    FP8MOE_TIMED_HOST_OP("empty_host");
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    const size_t bytes = dtype_bytes(dtype, n);
    void* p = nullptr;
    if (bytes > 0) {
      FP8MOE_CUDA_CHECK(cudaMallocHost(&p, bytes));
      std::memset(p, 0, bytes);
    }
    std::shared_ptr<void> storage(p, [](void* q) {
      if (q) (void)cudaFreeHost(q);
    });
    return Tensor(std::move(storage), dtype, shape, Device::cpu);
  }
  void copy_to_host_async(const TensorView& dst, const TensorView& src) override {
    FP8MOE_TIMED_OP("copy_to_host_async");
    FP8MOE_CHECK(dst.device == Device::cpu && src.device == Device::cuda && dst.nbytes() == src.nbytes() &&
                     dst.dtype == src.dtype && dst.is_contiguous() && src.is_contiguous(),
                 "copy_to_host_async: dst " << dst.str() << " (host) and src " << src.str()
                                            << " (device) must be contiguous, same dtype and size");
    if (!copy_stream_) {
      FP8MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking));
      FP8MOE_CUDA_CHECK(cudaEventCreateWithFlags(&queued_, cudaEventDisableTiming));
      FP8MOE_CUDA_CHECK(cudaEventCreateWithFlags(&copied_, cudaEventDisableTiming));
    }
    // After the work queued so far on the current stream, on a stream that blocks nobody.
    FP8MOE_CUDA_CHECK(cudaEventRecord(queued_, s_));
    FP8MOE_CUDA_CHECK(cudaStreamWaitEvent(copy_stream_, queued_, 0));
    FP8MOE_CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, src.nbytes(), cudaMemcpyDeviceToHost, copy_stream_));
    FP8MOE_CUDA_CHECK(cudaEventRecord(copied_, copy_stream_));
  }
  bool folds_ema() const override { return true; }
  void ema_fold(const std::vector<TensorView>& averages, const std::vector<TensorView>& values, float decay) override {
    FP8MOE_TIMED_OP("ema_fold");
    cuda::cuda_ema_fold(averages, values, decay, ema_table_, s_);
  }
  void fence_copies() override {
    if (copy_stream_) FP8MOE_CUDA_CHECK(cudaStreamWaitEvent(s_, copied_, 0));
  }
  void wait_copies() override {
    if (copy_stream_) FP8MOE_CUDA_CHECK(cudaEventSynchronize(copied_));
  }

  void synchronize() override {
    FP8MOE_TIMED_OP("synchronize");
    FP8MOE_CUDA_CHECK(cudaDeviceSynchronize());
    ++host_waits_;
    cuda::raise_deferred_checks();
  }
  void set_checks(Checks c) override { cuda::set_checks_deferred(c == Checks::deferred); }
  Checks checks() const override { return cuda::checks_deferred() ? Checks::deferred : Checks::immediate; }
  // Memory the driver holds for this process (cuBLASLt's workspaces and the context included)
  // minus what the caching allocator and the pool keep free for reuse.
  int64_t device_memory_in_use() const override {
    size_t free = 0, total = 0;
    FP8MOE_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    const cuda::AllocatorStats a = cuda::allocator_stats();
    uint64_t pool_reserved = 0, pool_used = 0;
    cudaMemPool_t pool = nullptr;
    FP8MOE_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device_));
    FP8MOE_CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &pool_reserved));
    FP8MOE_CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &pool_used));
    return int64_t(total - free) - int64_t(pool_reserved - pool_used) - (a.reserved - a.allocated);
  }
  int64_t device_memory_free() const override {
    size_t free = 0, total = 0;
    FP8MOE_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    return int64_t(free);
  }
  int64_t device_memory_peak() const override { return cuda::allocator_stats().peak_allocated; }
  MemoryStats memory_stats() const override {
    const cuda::AllocatorStats a = cuda::allocator_stats();
    return {a.allocated, a.peak_allocated, a.reserved, a.allocations, a.pool_allocations};
  }

  // Hopper (sm_90): 4096 dense BF16 FLOPs per SM per clock at the 1830 MHz of NVIDIA's datasheets
  // (989.4 TFLOPS on the 132 SMs of an H100 SXM or H200); 0 for other architectures.
  double peak_bf16_tflops() const override {
    int dev = 0, major = 0, sms = 0;
    FP8MOE_CUDA_CHECK(cudaGetDevice(&dev));
    FP8MOE_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    FP8MOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    return major == 9 ? double(sms) * 4096.0 * 1.83e9 / 1e12 : 0.0;
  }

  void quantize_1x128(const TensorView& x, const QuantizedView& out, ScaleMode mode) override {
    FP8MOE_TIMED_OP("quantize_1x128");
    if (out.values.dtype == DType::e5m6) return cuda::quantize_1x128_e5m6_cuda(x, out, mode, s_);
    cuda::quantize_1x128_cuda(x, out, mode, s_, /*check_finite=*/true);
  }
  void quantize_128x128(const TensorView& w, const QuantizedView& out, ScaleMode mode) override {
    FP8MOE_TIMED_OP("quantize_128x128");
    cuda::quantize_128x128_cuda(w, out, mode, s_, true);
  }
  void quantize_128x1(const TensorView& x, const QuantizedView& out, ScaleMode mode) override {
    FP8MOE_TIMED_OP("quantize_128x1");
    cuda::quantize_128x1_cuda(x, out, mode, s_, true);
  }
  void quantize_1x128_and_128x1(const TensorView& x, const QuantizedView& rows, const QuantizedView& cols,
                                ScaleMode mode) override {
    // E5M6 rows (quantize_1x128 only): the two ops.
    if (rows.values.dtype == DType::e5m6) return Backend::quantize_1x128_and_128x1(x, rows, cols, mode);
    FP8MOE_TIMED_OP("quantize_1x128_and_128x1");
    cuda::quantize_1x128_and_128x1_cuda(x, rows, cols, mode, s_, true);
  }
  void requantize_128x1(const QuantizedView& in, const QuantizedView& out, ScaleMode mode) override {
    FP8MOE_TIMED_OP("requantize_128x1");
    cuda::requantize_128x1_cuda(in, out, mode, s_);
  }
  void transpose_128x128(const QuantizedView& in, const QuantizedView& out, int64_t groups) override {
    FP8MOE_TIMED_OP("transpose_128x128");
    cuda::transpose_128x128_cuda(in, out, groups, s_);
  }
  void dequantize(const QuantizedView& in, const TensorView& out) override {
    FP8MOE_TIMED_OP("dequantize");
    if (in.values.dtype == DType::e5m6) return cuda::dequantize_e5m6_cuda(in, out, s_);
    cuda::dequantize_cuda(in, out, s_);
  }

  void gemm_fp8(const QuantizedView& a, const QuantizedView& b, const TensorView& d, const GemmOptions& opt) override {
    FP8MOE_TIMED_GEMM("gemm_fp8", a.values, b.values, false, true);
    // The hardware accumulates each 128-wide K block in the Tensor Cores and promotes to FP32:
    // AccumMode::fp32 (ideal promotion) up to Tensor Core rounding inside a block, and exactly the
    // tensor_core emulation's N_c = 128. Other promotion intervals run on the emulation kernels.
    if (cuda::needs_accum_emulation(opt.accum)) return cuda::gemm_fp8_emulated(a, b, d, opt, s_);
    // NOTES: cuBLASLt's block-scaled FP8 GEMM returned results 14% off on M = 200, N = 136,
    // K = 384 (H200, CUDA 13.0), while tile-aligned shapes agree; the cublaslt backend sends only
    // shapes with M and N multiples of 128 to it.
    const bool lt_aligned = a.rows() % 128 == 0 && b.rows() % 128 == 0;
    if ((cublaslt_ && lt_aligned) || !cuda::sm90_available())
      cuda::gemm_fp8_cublaslt(a, b, d, opt.accumulate, s_);
    else
      cuda::gemm_fp8_sm90(a, b, d, opt.accumulate, s_);
  }

  void gemm_bf16(const TensorView& a, const TensorView& b, const TensorView& d, bool accumulate) override {
    FP8MOE_TIMED_OP("gemm_bf16");
    cuda::gemm_bf16_cublaslt(a, b, d, accumulate, s_);
  }

  // ---- Model ops: src/cuda/model_ops_*.cu (the CPU ops are their specification).
  void gemm(const TensorView& a, const TensorView& b, const TensorView& d, bool trans_a, bool trans_b,
            bool accumulate) override {
    FP8MOE_TIMED_GEMM("gemm", a, b, trans_a, trans_b);
    cuda::cuda_gemm(a, b, d, trans_a, trans_b, accumulate, s_);
  }
  void gemm_strided_batched(const TensorView& a, const TensorView& b, const TensorView& d, bool trans_b,
                            bool accumulate) override {
    FP8MOE_TIMED_GEMM("gemm_strided_batched", a, b, false, trans_b);
    cuda::cuda_gemm_strided_batched(a, b, d, trans_b, accumulate, s_);
  }
  void gemm_batch_invariant(const TensorView& a, const TensorView& b, const TensorView& d) override {
    FP8MOE_TIMED_GEMM("gemm_batch_invariant", a, b, false, true);
    cuda::cuda_gemm_batch_invariant(a, b, d, s_);
  }
  void convert(const TensorView& src, const TensorView& dst) override {
    FP8MOE_TIMED_OP("convert"); cuda::cuda_convert(src, dst, s_); }
  void axpy(double alpha, const TensorView& x, double beta, const TensorView& y) override {
    FP8MOE_TIMED_OP("axpy");
    cuda::cuda_axpy(alpha, x, beta, y, s_);
  }
  void copy_cols(const TensorView& src, int64_t src_col, const TensorView& dst, int64_t dst_col, int64_t ncols,
                 bool accumulate) override {
    FP8MOE_TIMED_OP("copy_cols");
    cuda::cuda_copy_cols(src, src_col, dst, dst_col, ncols, accumulate, s_);
  }
  void transpose(const TensorView& src, const TensorView& dst) override {
    FP8MOE_TIMED_OP("transpose"); cuda::cuda_transpose(src, dst, s_); }
  void embedding_forward(const TensorView& ids, const TensorView& table, const TensorView& out) override {
    FP8MOE_TIMED_OP("embedding_forward");
    cuda::cuda_embedding_forward(ids, table, out, s_);
  }
  void embedding_backward(const TensorView& ids, const TensorView& dout, const TensorView& dtable) override {
    FP8MOE_TIMED_OP("embedding_backward");
    cuda::cuda_embedding_backward(ids, dout, dtable, s_);
  }
  void rmsnorm_forward(const TensorView& x, const TensorView& w, const TensorView& y, const TensorView& rstd,
                       double eps) override {
    FP8MOE_TIMED_OP("rmsnorm_forward");
    cuda::cuda_rmsnorm_forward(x, w, y, rstd, eps, s_);
  }
  void rmsnorm_forward_fp8(const TensorView& x, const TensorView& w, const QuantizedView& out, const TensorView& rstd,
                           double eps, ScaleMode mode) override {
    FP8MOE_TIMED_OP("rmsnorm_forward_fp8");
    cuda::cuda_rmsnorm_forward_fp8(x, w, out, rstd, eps, mode, s_);
  }
  void rmsnorm_backward(const TensorView& x, const TensorView& w, const TensorView& rstd, const TensorView& dy,
                        const TensorView& dx, const TensorView& dw, bool accumulate_dx) override {
    FP8MOE_TIMED_OP("rmsnorm_backward");
    cuda::cuda_rmsnorm_backward(x, w, rstd, dy, dx, dw, accumulate_dx, s_);
  }
  void rope(const TensorView& x, int64_t col0, int64_t rot, const TensorView& positions, double theta,
            bool inverse) override {
    FP8MOE_TIMED_OP("rope");
    cuda::cuda_rope(x, col0, rot, positions, theta, inverse, s_);
  }
  void mla_split_kv(const TensorView& kv, const TensorView& ckv, int64_t pe_col, const TensorView& positions,
                    double theta, const TensorView& k, const TensorView& v) override {
    FP8MOE_TIMED_OP("mla_split_kv");
    cuda::cuda_mla_split_kv(kv, ckv, pe_col, positions, theta, k, v, s_);
  }
  void mla_split_kv_backward(const TensorView& dk, const TensorView& dv, const TensorView& positions, double theta,
                             const TensorView& dkv, const TensorView& dckv, int64_t pe_col) override {
    FP8MOE_TIMED_OP("mla_split_kv_backward");
    cuda::cuda_mla_split_kv_backward(dk, dv, positions, theta, dkv, dckv, pe_col, s_);
  }
  void attention_forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                         const TensorView& lse, int64_t seq_len, double scale, DType compute) override {
    FP8MOE_TIMED_OP("attention_forward");
    cuda::cuda_attention_forward(q, k, v, out, lse, seq_len, scale, compute, s_);
  }
  void attention_backward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                          const TensorView& lse, const TensorView& dout, const TensorView& dq, const TensorView& dk,
                          const TensorView& dv, int64_t seq_len, double scale, DType compute) override {
    FP8MOE_TIMED_OP("attention_backward");
    cuda::cuda_attention_backward(q, k, v, out, lse, dout, dq, dk, dv, seq_len, scale, compute, s_);
  }
  void mla_decode_attention(const TensorView& q, const MlaCacheView& cache, const TensorView& table,
                            const TensorView& lengths, double scale, const TensorView& o,
                            MlaDecodeSplits splits) override {
    FP8MOE_TIMED_OP("mla_decode_attention");
    cuda::mla_decode_attention_cuda(q, cache, table, lengths, scale, o, s_, cuda::MlaDecodePath::automatic, 0, splits);
  }
  void swiglu_forward(const TensorView& gate, const TensorView& up, const TensorView& out) override {
    FP8MOE_TIMED_OP("swiglu_forward");
    cuda::cuda_swiglu_forward(gate, up, out, s_);
  }
  void swiglu_backward(const TensorView& gate, const TensorView& up, const TensorView& dout, const TensorView& dgate,
                       const TensorView& dup) override {
    FP8MOE_TIMED_OP("swiglu_backward");
    cuda::cuda_swiglu_backward(gate, up, dout, dgate, dup, s_);
  }
  void swiglu_backward_fp8(const QuantizedView& gate, const QuantizedView& up, const TensorView& dout,
                           const TensorView& out, const TensorView& dgate, const TensorView& dup) override {
    FP8MOE_TIMED_OP("swiglu_backward_fp8");
    cuda::cuda_swiglu_backward_fp8(gate, up, dout, out, dgate, dup, s_);
  }
  void swiglu_forward_fp8(const TensorView& gate, const TensorView& up, const QuantizedView& gq,
                          const QuantizedView& uq, const QuantizedView& out, ScaleMode mode) override {
    FP8MOE_TIMED_OP("swiglu_forward_fp8");
    cuda::cuda_swiglu_forward_fp8(gate, up, gq, uq, out, mode, s_);
  }
  void cross_entropy(const TensorView& logits, const TensorView& targets, const TensorView& losses,
                     const TensorView& dlogits, double grad_scale) override {
    FP8MOE_TIMED_OP("cross_entropy");
    cuda::cuda_cross_entropy(logits, targets, losses, dlogits, grad_scale, s_);
  }
  void moe_route(const TensorView& logits, const TensorView& bias, const TensorView& scores, const TensorView& idx,
                 const TensorView& weights, int64_t n_group, int64_t topk_group, bool norm, double scaling) override {
    FP8MOE_TIMED_OP("moe_route");
    cuda::cuda_moe_route(logits, bias, scores, idx, weights, n_group, topk_group, norm, scaling, s_);
  }
  void moe_route_backward(const TensorView& scores, const TensorView& idx, const TensorView& dweights,
                          const TensorView& dscores, const TensorView& dlogits, bool norm, double scaling) override {
    FP8MOE_TIMED_OP("moe_route_backward");
    cuda::cuda_moe_route_backward(scores, idx, dweights, dscores, dlogits, norm, scaling, s_);
  }
  void gather_rows(const TensorView& src, const TensorView& idx, const TensorView& w, const TensorView& dst) override {
    FP8MOE_TIMED_OP("gather_rows");
    cuda::cuda_gather_rows(src, idx, w, dst, s_);
  }
  void scatter_add_rows(const TensorView& src, const TensorView& idx, const TensorView& w,
                        const TensorView& dst) override {
    FP8MOE_TIMED_OP("scatter_add_rows");
    cuda::cuda_scatter_add_rows(src, idx, w, dst, s_);
  }
  void scatter_rows(const TensorView& src, const TensorView& idx, const TensorView& dst) override {
    FP8MOE_TIMED_OP("scatter_rows");
    cuda::cuda_scatter_rows(src, idx, dst, s_);
  }
  void rows_dot(const TensorView& a, const TensorView& b, const TensorView& out) override {
    FP8MOE_TIMED_OP("rows_dot");
    cuda::cuda_rows_dot(a, b, out, s_);
  }

  // ---- MoE dispatch and grouped GEMMs: src/cuda/moe/moe_dispatch.cu, grouped_gemm.cu.
  void moe_layout(const TensorView& expert_ids, int64_t align, const TensorView& row_slot, const TensorView& row_group,
                  const TensorView& slot_row, const TensorView& offsets) override {
    FP8MOE_TIMED_OP("moe_layout");
    cuda::moe_layout_cuda(expert_ids, align, row_slot, row_group, slot_row, offsets, s_);
  }
  void moe_masked_layout(const TensorView& expert_ids, int64_t groups, int64_t every_token_group,
                         const TensorView& row_slot, const TensorView& slot_row, const TensorView& counts,
                         const TensorView& loads) override {
    FP8MOE_TIMED_OP("moe_masked_layout");
    cuda::moe_masked_layout_cuda(expert_ids, groups, every_token_group, row_slot, slot_row, counts, loads, s_);
  }
  void moe_permute(const TensorView& x, const TensorView& row_slot, int64_t topk, const TensorView& w,
                   const TensorView& out) override {
    FP8MOE_TIMED_OP("moe_permute");
    cuda::moe_permute_cuda(x, row_slot, topk, w, out, s_);
  }
  void moe_permute_quantize(const TensorView& x, const TensorView& row_slot, int64_t topk, const TensorView& w,
                            const QuantizedView& out, ScaleMode mode) override {
    FP8MOE_TIMED_OP("moe_permute_quantize");
    cuda::moe_permute_quantize_cuda(x, row_slot, topk, w, out, mode, s_);
  }
  void moe_combine(const TensorView& y, const TensorView& slot_row, const TensorView& w, const TensorView& out,
                   bool accumulate) override {
    FP8MOE_TIMED_OP("moe_combine");
    cuda::moe_combine_cuda(y, slot_row, w, out, accumulate, s_);
  }
  void moe_combine_weight_grad(const TensorView& v, const TensorView& slot_row, const TensorView& w,
                               const TensorView& dw) override {
    FP8MOE_TIMED_OP("moe_combine_weight_grad");
    cuda::moe_combine_weight_grad_cuda(v, slot_row, w, dw, s_);
  }
  void grouped_gemm_fp8_contiguous(const QuantizedView& a, const QuantizedView& b, const TensorView& row_group,
                                   int64_t groups, const TensorView& d, const GemmOptions& opt) override {
    FP8MOE_TIMED_OP("grouped_gemm_fp8_contiguous");
    if (cuda::needs_accum_emulation(opt.accum))
      return cuda::grouped_gemm_fp8_contiguous_emulated(a, b, row_group, groups, d, opt, s_);
    cuda::grouped_gemm_fp8_contiguous_cuda(a, b, row_group, groups, d, opt.accumulate, s_);
  }
  void grouped_gemm_fp8_masked(const QuantizedView& a, const QuantizedView& b, const TensorView& counts,
                               int64_t groups, const TensorView& d, const GemmOptions& opt) override {
    FP8MOE_TIMED_OP("grouped_gemm_fp8_masked");
    if (cuda::needs_accum_emulation(opt.accum))
      return cuda::grouped_gemm_fp8_masked_emulated(a, b, counts, groups, d, opt, s_);
    cuda::grouped_gemm_fp8_masked_cuda(a, b, counts, groups, d, opt.accumulate, s_);
  }
  void grouped_wgrad_fp8(const QuantizedView& dy_t, const QuantizedView& x_t, const TensorView& offsets,
                         const TensorView& d, const GemmOptions& opt) override {
    FP8MOE_TIMED_OP("grouped_wgrad_fp8");
    if (cuda::needs_accum_emulation(opt.accum))
      return cuda::grouped_wgrad_fp8_emulated(dy_t, x_t, offsets, d, opt, s_);
    cuda::grouped_wgrad_fp8_cuda(dy_t, x_t, offsets, d, opt.accumulate, s_);
  }

  // ---- Optimizer ops.
  void adamw_step(const TensorView& w, const TensorView& g, const TensorView& m, const TensorView& v,
                  const AdamWStep& p) override {
    FP8MOE_TIMED_OP("adamw_step");
    cuda::cuda_adamw_step(w, g, m, v, p, s_);
  }
  void adamw_steps(const std::vector<AdamWTensors>& ts, const AdamWStep& p) override {
    FP8MOE_TIMED_OP("adamw_steps");
    cuda::cuda_adamw_steps(ts, p, adamw_table_, s_);
  }
  double sum_squares(const TensorView& x) override {
    FP8MOE_TIMED_OP("sum_squares");
    ++host_waits_;
    return cuda::cuda_sum_squares({x}, s_);
  }
  double sum_squares_all(const std::vector<TensorView>& xs) override {
    FP8MOE_TIMED_OP("sum_squares_all");
    ++host_waits_;
    return cuda::cuda_sum_squares(xs, s_);
  }

  // ---- Step statistics.
  void moe_expert_loads(const TensorView& expert_ids, const TensorView& loads) override {
    FP8MOE_TIMED_OP("moe_expert_loads");
    cuda::cuda_moe_expert_loads(expert_ids, loads, s_);
  }
  void moe_balance_loss(const TensorView& scores, const TensorView& idx, int64_t seq_len, double alpha,
                        double grad_scale, const TensorView& loss, const TensorView& dscores) override {
    FP8MOE_TIMED_OP("moe_balance_loss");
    cuda::cuda_moe_balance_loss(scores, idx, seq_len, alpha, grad_scale, loss, dscores, s_);
  }
  void sum_in_order(const TensorView& x, const TensorView& out) override {
    FP8MOE_TIMED_OP("sum_in_order");
    cuda::cuda_sum_in_order(x, out, s_);
  }
  int64_t host_waits() const override { return host_waits_; }

 private:
  // A block of the caching allocator on the current stream, zero-filled or not.
  Tensor allocate(DType dtype, std::initializer_list<int64_t> shape, bool zero) {
    int64_t n = 1;
    for (int64_t s : shape) {
      FP8MOE_CHECK(s >= 0, "empty: negative dimension " << s);
      n *= s;
    }
    const size_t bytes = dtype_bytes(dtype, n);
    const cuda::CachedBlock block = cuda::cached_malloc(bytes, s_, device_);
    if (block.ptr && zero) {
      const cudaError_t e = cudaMemsetAsync(block.ptr, 0, bytes, s_);
      if (e != cudaSuccess) cuda::cached_free(block);
      FP8MOE_CUDA_CHECK(e);
    }
    // The deleter keeps the block's description (in the control block the shared pointer makes
    // anyway).
    std::shared_ptr<void> storage(block.ptr, [block](void*) { cuda::cached_free(block); });
    return Tensor(std::move(storage), dtype, shape, Device::cuda);
  }

  static bool is_page_locked(const void* p) {
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return a.type == cudaMemoryTypeHost;
  }

  bool cublaslt_;
  int device_ = 0;
  bool hopper_ = false;
  int64_t host_waits_ = 0;  // host_waits(): the queuing thread's (wait_copies waits in the EMA's)
  Stream compute_, current_;  // the backend's own stream, and the one ops go to now
  cudaStream_t s_ = nullptr;  // current_'s

  // copy_to_host_async: its stream, and the events "queued work reached" and "copies done".
  // NOTES: not destroyed: the backend lives until exit, and destroying them in a static
  // destruction order that outlives the context fails.
  cudaStream_t copy_stream_ = nullptr;
  cuda::DeviceTable ema_table_, adamw_table_;  // the launch tables of ema_fold and adamw_steps
  cudaEvent_t queued_ = nullptr, copied_ = nullptr;
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend() { return std::make_unique<CudaBackend>(false); }
std::unique_ptr<Backend> make_cublaslt_backend() { return std::make_unique<CudaBackend>(true); }
std::shared_ptr<void> hold_cuda_frees() {
  cuda::hold_frees();
  // A null pointer with a deleter: the deleter still runs when the last copy goes.
  return std::shared_ptr<void>(nullptr, [](void*) { cuda::release_frees(); });
}
std::shared_ptr<void> set_aside_cuda_frees(void* stream, const std::function<void()>& work) {
  cuda::begin_set_aside(static_cast<cudaStream_t>(stream));
  try {
    work();
  } catch (...) {
    // What was queued may still read them: they return once the device has run it.
    const std::vector<cuda::CachedBlock> blocks = cuda::end_set_aside();
    (void)cudaDeviceSynchronize();
    cuda::put_back_set_aside(blocks);
    throw;
  }
  auto blocks = std::make_shared<std::vector<cuda::CachedBlock>>(cuda::end_set_aside());
  return std::shared_ptr<void>(nullptr, [blocks](void*) { cuda::put_back_set_aside(*blocks); });
}

}  // namespace fp8moe
