// Host helpers of the CUDA model ops (see model_ops_util.cuh): argument checks, stream-ordered
// scratch, device tables of launch arguments, and the stable key sort (CUB radix sort) behind the deterministic scatter-adds.
#include <cub/device/device_radix_sort.cuh>

#include <cstring>

#include "cuda/ops/model_ops.hpp"
#include "cuda/ops/model_ops_util.cuh"
#include "cuda/runtime/caching_allocator.hpp"

namespace fp8moe::cuda::ops {

void check_dev(const TensorView& t, const char* op, const char* arg, DType dtype, int ndim) {
  FP8MOE_CHECK(t.data != nullptr, op << ": " << arg << " is undefined");
  FP8MOE_CHECK(t.device == Device::cuda, op << ": " << arg << " must be a device tensor, got " << t.str());
  FP8MOE_CHECK(t.dtype == dtype, op << ": " << arg << " must be " << dtype_name(dtype) << ", got " << t.str()
                                    << (t.dtype == DType::f64 ? " (f64 unsupported on cuda)" : ""));
  FP8MOE_CHECK(ndim < 0 || t.ndim == ndim, op << ": " << arg << " must have " << ndim << " dims, got " << t.str());
  FP8MOE_CHECK(t.is_contiguous(), op << ": " << arg << " must be contiguous, got " << t.str());
}

void check_f32(const TensorView& t, const char* op, const char* arg, int ndim) {
  FP8MOE_CHECK(!(t.data && t.dtype == DType::f64), op << ": " << arg << " " << t.str() << ": f64 unsupported on cuda");
  check_dev(t, op, arg, DType::f32, ndim);
}

void check_2d_any(const TensorView& t, const char* op, const char* arg) {
  FP8MOE_CHECK(t.device == Device::cuda && t.data, op << ": " << arg << " must be a defined device tensor, got "
                                                       << t.str());
  FP8MOE_CHECK(t.ndim == 2 && t.is_contiguous(), op << ": " << arg << " must be 2-D contiguous, got " << t.str());
  FP8MOE_CHECK(t.dtype == DType::f32 || t.dtype == DType::f64 || t.dtype == DType::bf16,
               op << ": " << arg << " must be f32, f64 or bf16, got " << t.str());
}

namespace {

__global__ void iota_kernel(int32_t* p, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = int32_t(i);
}

}  // namespace

DeviceBuffer::DeviceBuffer(size_t bytes, cudaStream_t stream) : block_(cached_malloc(bytes, stream)) {}

DeviceBuffer::~DeviceBuffer() { cached_free(block_); }

void stable_sort_by_key(const int32_t* keys, int64_t n, int64_t nkeys, int32_t* keys_out, int32_t* pos_out,
                        cudaStream_t stream) {
  if (n <= 0) return;
  FP8MOE_CHECK(n < (int64_t(1) << 31), "stable_sort_by_key: n = " << n << " exceeds the i32 range");
  int end_bit = 1;
  while (end_bit < 32 && (int64_t(1) << end_bit) < nkeys) ++end_bit;
  DeviceBuffer pos_in(size_t(n) * sizeof(int32_t), stream);
  iota_kernel<<<grid_for(n, 256, 4096), 256, 0, stream>>>(pos_in.as<int32_t>(), n);
  FP8MOE_CUDA_CHECK_LAUNCH("iota_kernel");
  // Keys are in [0, nkeys): as unsigned they sort the same and only end_bit bits matter.
  const auto* kin = reinterpret_cast<const uint32_t*>(keys);
  auto* kout = reinterpret_cast<uint32_t*>(keys_out);
  size_t temp_bytes = 0;
  FP8MOE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, kin, kout, pos_in.as<int32_t>(), pos_out,
                                                    int(n), 0, end_bit, stream));
  DeviceBuffer temp(temp_bytes, stream);
  FP8MOE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.as<void>(), temp_bytes, kin, kout, pos_in.as<int32_t>(),
                                                    pos_out, int(n), 0, end_bit, stream));
}

namespace {

// Grid (n, ceil(D / 128)), 128 threads; blocks not at the start of a run exit at once.
// NOTES: the block walks its run 128 positions at a time: the positions go through shared memory
// and each thread loads kBatch source values before it adds them, in the run's order. The plain
// loop (key, position, value, add per step) kept one dependent chain of global loads per thread;
// a byte-level vocabulary has runs of thousands of tokens (0.74 ms for the 8192 x 4096 embedding
// backward of configs/gemm.json). Same additions in the same order: bit-identical.
__global__ void __launch_bounds__(128) sorted_scatter_add_kernel(const int32_t* __restrict__ keys,
                                                                 const int32_t* __restrict__ pos, int64_t n,
                                                                 const float* __restrict__ w,
                                                                 const float* __restrict__ src, float* dst, int64_t D,
                                                                 int64_t R) {
  constexpr int kChunk = 128, kBatch = 8;
  __shared__ int32_t s_pos[kChunk];
  const int64_t p = blockIdx.x;
  const int64_t j = int64_t(blockIdx.y) * 128 + threadIdx.x;
  const int32_t key = keys[p];
  if (key < 0 || key >= R || (p > 0 && keys[p - 1] == key)) return;  // uniform over the block
  const bool col = j < D;
  float acc = col ? dst[int64_t(key) * D + j] : 0.0f;
  for (int64_t q0 = p;; q0 += kChunk) {
    const int64_t q = q0 + threadIdx.x;
    const bool in = q < n && keys[q] == key;  // the run is a prefix of the chunk (keys are sorted)
    s_pos[threadIdx.x] = in ? pos[q] : 0;
    const int cnt = __syncthreads_count(in);
    if (col) {
      for (int c = 0; c < cnt; c += kBatch) {
        float v[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          if (c + u < cnt) {
            const int64_t i = s_pos[c + u];
            // mul and add stay separate roundings (no FMA), as in the CPU loop `dst += w * src`.
            v[u] = w ? __fmul_rn(w[i], src[i * D + j]) : src[i * D + j];
          }
        }
#pragma unroll
        for (int u = 0; u < kBatch; ++u)
          if (c + u < cnt) acc = __fadd_rn(acc, v[u]);
      }
    }
    if (cnt < kChunk) break;
    __syncthreads();  // s_pos is rewritten for the next chunk
  }
  if (col) dst[int64_t(key) * D + j] = acc;
}

}  // namespace

void sorted_scatter_add(const int32_t* keys, const int32_t* pos, int64_t n, const float* w, const float* src,
                        float* dst, int64_t D, int64_t R, cudaStream_t stream) {
  if (n <= 0 || D <= 0) return;
  FP8MOE_CHECK(ceil_div(D, 128) <= 65535, "sorted_scatter_add: D = " << D << " too large");
  sorted_scatter_add_kernel<<<dim3(unsigned(n), unsigned(ceil_div(D, 128))), 128, 0, stream>>>(keys, pos, n, w, src, dst, D, R);
  FP8MOE_CUDA_CHECK_LAUNCH("sorted_scatter_add_kernel");
}

}  // namespace fp8moe::cuda::ops

namespace fp8moe::cuda {

DeviceTable::~DeviceTable() {
  if (dev_) cudaFree(dev_);
}

const void* DeviceTable::get_bytes(const void* host, size_t bytes) {
  const auto* b = static_cast<const unsigned char*>(host);
  if (bytes == last_.size() && (bytes == 0 || std::memcmp(b, last_.data(), bytes) == 0)) return dev_;
  if (dev_) FP8MOE_CUDA_CHECK(cudaFree(dev_));  // synchronizes: no launch reads the old table any more
  dev_ = nullptr;
  if (bytes > 0) {
    FP8MOE_CUDA_CHECK(cudaMalloc(&dev_, bytes));
    FP8MOE_CUDA_CHECK(cudaMemcpy(dev_, b, bytes, cudaMemcpyHostToDevice));
  }
  last_.assign(b, b + bytes);
  return dev_;
}

}  // namespace fp8moe::cuda
