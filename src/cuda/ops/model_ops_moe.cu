// CUDA DeepSeekMoE routing and the row movement of expert dispatch/combine (src/cpu/ops_moe.cpp is
// the specification):
//   moe_route           one thread per token: sigmoid affinities, group scores (sum of the two best
//                       choices), the topk_group best groups, then top-k of affinity + bias inside
//                       them, in the CPU's stable-sort order (descending, ties to the lower index).
//   moe_route_backward  one thread per token, FP64 sums as on the CPU.
//   gather_rows         one thread per element; any element size without weights (a byte copy).
//   scatter_add_rows    deterministic: positions stably sorted by target row, then one thread per
//                       (row, column) adds its sources in ascending order: bit-identical to the CPU.
//   rows_dot            one warp per row, FP64 accumulation.
#include "cuda/ops/model_ops.hpp"
#include "cuda/ops/model_ops_util.cuh"

namespace fp8moe::cuda {

using namespace ops;

namespace {

constexpr int kMaxGroups = 64;  // the chosen groups are a 64-bit mask

// logits [N, E] f32, bias [E] f32 -> scores [N, E] f32, idx [N, Kt] i32, weights [N, Kt] f32.
__global__ void moe_route_kernel(const float* __restrict__ logits, const float* __restrict__ bias, float* scores,
                                 int32_t* idx, float* __restrict__ weights, int64_t N, int64_t E, int64_t n_group,
                                 int64_t topk_group, int64_t Kt, bool norm, double scaling) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= N) return;
  const float* x = logits + t * E;
  float* s = scores + t * E;
  for (int64_t e = 0; e < E; ++e) s[e] = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-x[e])));
  auto choice = [&](int64_t e) { return double(s[e]) + double(bias[e]); };
  const int64_t Gs = E / n_group;
  // Groups ranked by the sum of their two best choices (their best when of size 1).
  auto group_score = [&](int64_t g) {
    double b1 = -INFINITY, b2 = -INFINITY;
    for (int64_t e = g * Gs; e < (g + 1) * Gs; ++e) {
      const double c = choice(e);
      if (c > b1) {
        b2 = b1;
        b1 = c;
      } else if (c > b2) {
        b2 = c;
      }
    }
    return Gs >= 2 ? b1 + b2 : b1;
  };
  uint64_t chosen = 0;
  for (int64_t r = 0; r < topk_group; ++r) {
    int64_t best = -1;
    double bv = 0;
    for (int64_t g = 0; g < n_group; ++g) {
      if (chosen >> g & 1) continue;
      const double gs = group_score(g);
      if (best < 0 || gs > bv) {  // strict: ties keep the lower index (stable sort)
        best = g;
        bv = gs;
      }
    }
    chosen |= uint64_t(1) << best;
  }
  // The j-th pick is the best allowed expert ordered after pick j-1 (choice descending, index
  // ascending): the first Kt of the CPU's stable sort, which puts allowed experts first.
  int32_t* id = idx + t * Kt;
  double pv = 0;
  int64_t pe = -1;
  for (int64_t j = 0; j < Kt; ++j) {
    int64_t best = -1;
    double bv = 0;
    for (int64_t e = 0; e < E; ++e) {
      if (!(chosen >> (e / Gs) & 1)) continue;
      const double c = choice(e);
      if (pe >= 0 && !(c < pv || (c == pv && e > pe))) continue;
      if (best < 0 || c > bv) {
        best = e;
        bv = c;
      }
    }
    id[j] = int32_t(best);
    pv = bv;
    pe = best;
  }
  double sum = 0;
  for (int64_t j = 0; j < Kt; ++j) sum += double(s[id[j]]);
  const double denom = norm ? sum + 1e-20 : 1.0;
  for (int64_t j = 0; j < Kt; ++j) weights[t * Kt + j] = __double2float_rn(double(s[id[j]]) / denom * scaling);
}

// scores [N, E], idx [N, Kt], dweights [N, Kt], dscores [N, E] (null: 0) -> dlogits [N, E].
__global__ void moe_route_backward_kernel(const float* __restrict__ scores, const int32_t* __restrict__ idx,
                                          const float* __restrict__ dweights, const float* __restrict__ dscores,
                                          float* __restrict__ dlogits, int64_t N, int64_t E, int64_t Kt, bool norm,
                                          double scaling) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= N) return;
  const float* s = scores + t * E;
  const int32_t* id = idx + t * Kt;
  const float* dw = dweights + t * Kt;
  float* dl = dlogits + t * E;
  for (int64_t e = 0; e < E; ++e) dl[e] = dscores ? dscores[t * E + e] : 0.0f;
  double S = 0, dot = 0;
  for (int64_t j = 0; j < Kt; ++j) {
    // NOTES: the CPU op trusts idx (moe_route wrote it); here an entry outside [0, E) is skipped
    // instead of being written outside the row.
    if (id[j] < 0 || id[j] >= E) continue;
    S += double(s[id[j]]);
    dot += double(dw[j]) * double(s[id[j]]);
  }
  const double Se = S + 1e-20;
  for (int64_t j = 0; j < Kt; ++j) {
    if (id[j] < 0 || id[j] >= E) continue;
    const double g = norm ? scaling * (double(dw[j]) / Se - dot / (Se * Se)) : scaling * double(dw[j]);
    dl[id[j]] = __fadd_rn(dl[id[j]], __double2float_rn(g));
  }
  for (int64_t e = 0; e < E; ++e) {
    const double se = s[e];
    dl[e] = __double2float_rn(double(dl[e]) * se * (1.0 - se));
  }
}

// dst [N', D] rows i < N = src [R, D] rows idx[i], element type E (a copy of any dtype); rows of
// indices outside [0, R) are left alone (a deferred range check reports them).
template <class Elem>
__global__ void gather_rows_kernel(const Elem* __restrict__ src, const int32_t* __restrict__ idx,
                                   Elem* __restrict__ dst, int64_t N, int64_t D, int64_t R) {
  for (int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; k < N * D; k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = k / D, j = k - i * D, r = idx[i];
    if (r >= 0 && r < R) dst[k] = src[r * D + j];
  }
}

// dst [R, W] rows idx[i] = src rows i < N, as W elements of the row's width (idx outside [0, R):
// skipped).
template <class Elem>
__global__ void scatter_rows_kernel(const Elem* __restrict__ src, const int32_t* __restrict__ idx,
                                    Elem* __restrict__ dst, int64_t N, int64_t W, int64_t R) {
  for (int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; k < N * W; k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = k / W, j = k - i * W, r = idx[i];
    if (r >= 0 && r < R) dst[r * W + j] = src[k];
  }
}

// dst [N', D] rows i < N = w[i] * src [R, D] rows idx[i] (f32).
__global__ void gather_rows_weighted_kernel(const float* __restrict__ src, const int32_t* __restrict__ idx,
                                            const float* __restrict__ w, float* __restrict__ dst, int64_t N,
                                            int64_t D, int64_t R) {
  for (int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; k < N * D; k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = k / D, j = k - i * D, r = idx[i];
    if (r >= 0 && r < R) dst[k] = __fmul_rn(w[i], src[r * D + j]);
  }
}

// out [N] = rows of a, b [>= N, D] dotted; one warp per row.
__global__ void rows_dot_kernel(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ out,
                                int64_t N, int64_t D) {
  const int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (i >= N) return;
  double acc = 0;
  for (int64_t j = lane; j < D; j += 32) acc += double(a[i * D + j]) * double(b[i * D + j]);
  acc = warp_sum(acc);
  if (lane == 0) out[i] = __double2float_rn(acc);
}

}  // namespace

void cuda_moe_route(const TensorView& logits, const TensorView& bias, const TensorView& scores, const TensorView& idx,
                    const TensorView& weights, int64_t n_group, int64_t topk_group, bool norm, double scaling, cudaStream_t stream) {
  check_f32(logits, "moe_route", "logits", 2);
  const int64_t N = logits.size(0), E = logits.size(1);
  check_f32(bias, "moe_route", "bias", 1);
  check_shape(bias, "moe_route: bias", {E});
  check_f32(scores, "moe_route", "scores", 2);
  check_shape(scores, "moe_route: scores", {N, E});
  check_dev(idx, "moe_route", "idx", DType::i32, 2);
  const int64_t Kt = idx.size(1);
  check_f32(weights, "moe_route", "weights", 2);
  check_shape(weights, "moe_route: weights", {N, Kt});
  FP8MOE_CHECK(n_group > 0 && E % n_group == 0, "moe_route: n_group = " << n_group << " must divide E = " << E);
  FP8MOE_CHECK(topk_group > 0 && topk_group <= n_group,
               "moe_route: topk_group = " << topk_group << " must be in [1, n_group = " << n_group << "]");
  const int64_t Gs = E / n_group;
  FP8MOE_CHECK(Kt > 0 && Kt <= topk_group * Gs, "moe_route: top-k = " << Kt << " exceeds the " << topk_group * Gs
                                                                       << " experts of topk_group groups");
  FP8MOE_CHECK(n_group <= kMaxGroups, "moe_route: n_group = " << n_group << " above " << kMaxGroups
                                                              << " unsupported on cuda");
  if (N == 0) return;
  constexpr int kThreads = 64;
  moe_route_kernel<<<grid_for(N, kThreads, INT32_MAX), kThreads, 0, stream>>>(
      logits.ptr<const float>(), bias.ptr<const float>(), scores.ptr<float>(), idx.ptr<int32_t>(),
      weights.ptr<float>(), N, E, n_group, topk_group, Kt, norm, scaling);
  FP8MOE_CUDA_CHECK_LAUNCH("moe_route_kernel");
}

void cuda_moe_route_backward(const TensorView& scores, const TensorView& idx, const TensorView& dweights,
                             const TensorView& dscores, const TensorView& dlogits, bool norm, double scaling, cudaStream_t stream) {
  check_f32(scores, "moe_route_backward", "scores", 2);
  const int64_t N = scores.size(0), E = scores.size(1);
  check_dev(idx, "moe_route_backward", "idx", DType::i32, 2);
  const int64_t Kt = idx.size(1);
  check_shape(idx, "moe_route_backward: idx", {N, Kt});
  check_f32(dweights, "moe_route_backward", "dweights", 2);
  check_shape(dweights, "moe_route_backward: dweights", {N, Kt});
  check_f32(dlogits, "moe_route_backward", "dlogits", 2);
  check_shape(dlogits, "moe_route_backward: dlogits", {N, E});
  if (dscores.defined()) {
    check_f32(dscores, "moe_route_backward", "dscores", 2);
    check_shape(dscores, "moe_route_backward: dscores", {N, E});
  }
  if (N == 0) return;
  constexpr int kThreads = 64;
  moe_route_backward_kernel<<<grid_for(N, kThreads, INT32_MAX), kThreads, 0, stream>>>(
      scores.ptr<const float>(), idx.ptr<const int32_t>(), dweights.ptr<const float>(),
      dscores.defined() ? dscores.ptr<const float>() : nullptr, dlogits.ptr<float>(), N, E, Kt, norm, scaling);
  FP8MOE_CUDA_CHECK_LAUNCH("moe_route_backward_kernel");
}

void cuda_gather_rows(const TensorView& src, const TensorView& idx, const TensorView& w, const TensorView& dst, cudaStream_t stream) {
  check_dev(idx, "gather_rows", "idx", DType::i32, 1);
  FP8MOE_CHECK(src.dtype == dst.dtype && src.ndim == 2 && dst.ndim == 2 && src.size(1) == dst.size(1),
               "gather_rows: src " << src.str() << " and dst " << dst.str() << " must be [*, D] of one dtype");
  FP8MOE_CHECK(src.device == Device::cuda && dst.device == Device::cuda && src.data && dst.data,
               "gather_rows: src " << src.str() << " and dst " << dst.str() << " must be defined device tensors");
  FP8MOE_CHECK(src.is_contiguous() && dst.is_contiguous(), "gather_rows: src " << src.str() << " and dst "
                                                                              << dst.str() << " must be contiguous");
  FP8MOE_CHECK(dst.size(0) >= idx.size(0), "gather_rows: dst " << dst.str() << " has fewer rows than idx "
                                                               << idx.str());
  const int64_t N = idx.size(0), Rs = src.size(0), D = src.size(1);
  int32_t bad = 0;
  const int64_t i = first_out_of_range(idx.ptr<const int32_t>(), N, 0, Rs, &bad, "gather_rows: idx", stream);
  FP8MOE_CHECK(i < 0, "gather_rows: idx[" << i << "] = " << bad << " outside [0, " << Rs << ")");
  if (w.defined()) {
    check_f32(dst, "gather_rows", "dst", 2);
    check_f32(w, "gather_rows", "w", 1);
    check_shape(w, "gather_rows: w", {N});
  }
  if (N * D == 0) return;
  const unsigned grid = grid_for(N * D, 256);
  const int32_t* id = idx.ptr<const int32_t>();
  if (w.defined()) {
    gather_rows_weighted_kernel<<<grid, 256, 0, stream>>>(src.ptr<const float>(), id, w.ptr<const float>(), dst.ptr<float>(), N,
                                               D, Rs);
  } else {
    switch (dtype_size(src.dtype)) {
      case 1: gather_rows_kernel<<<grid, 256, 0, stream>>>(src.ptr<const uint8_t>(), id, dst.ptr<uint8_t>(), N, D, Rs); break;
      case 2: gather_rows_kernel<<<grid, 256, 0, stream>>>(src.ptr<const uint16_t>(), id, dst.ptr<uint16_t>(), N, D, Rs); break;
      case 4: gather_rows_kernel<<<grid, 256, 0, stream>>>(src.ptr<const uint32_t>(), id, dst.ptr<uint32_t>(), N, D, Rs); break;
      default: gather_rows_kernel<<<grid, 256, 0, stream>>>(src.ptr<const uint64_t>(), id, dst.ptr<uint64_t>(), N, D, Rs); break;
    }
  }
  FP8MOE_CUDA_CHECK_LAUNCH("gather_rows_kernel");
}

void cuda_scatter_add_rows(const TensorView& src, const TensorView& idx, const TensorView& w,
                           const TensorView& dst, cudaStream_t stream) {
  check_dev(idx, "scatter_add_rows", "idx", DType::i32, 1);
  check_f32(dst, "scatter_add_rows", "dst", 2);
  check_f32(src, "scatter_add_rows", "src", 2);
  const int64_t N = idx.size(0), D = dst.size(1), R = dst.size(0);
  FP8MOE_CHECK(src.size(1) == D && src.size(0) >= N, "scatter_add_rows: src " << src.str() << " must be [>= " << N
                                                                              << ", " << D << "]");
  if (w.defined()) {
    check_f32(w, "scatter_add_rows", "w", 1);
    check_shape(w, "scatter_add_rows: w", {N});
  }
  int32_t bad = 0;
  const int64_t i = first_out_of_range(idx.ptr<const int32_t>(), N, 0, R, &bad, "scatter_add_rows: idx", stream);
  FP8MOE_CHECK(i < 0, "scatter_add_rows: idx[" << i << "] = " << bad << " outside [0, " << R << ")");
  if (N == 0 || D == 0) return;
  DeviceBuffer keys(size_t(N) * sizeof(int32_t), stream), pos(size_t(N) * sizeof(int32_t), stream);
  stable_sort_by_key(idx.ptr<const int32_t>(), N, R, keys.as<int32_t>(), pos.as<int32_t>(), stream);
  sorted_scatter_add(keys.as<int32_t>(), pos.as<int32_t>(), N, w.defined() ? w.ptr<const float>() : nullptr,
                     src.ptr<const float>(), dst.ptr<float>(), D, R, stream);
}

// The rows moved in the widest element (16 bytes down to 1) that divides the row and both
// pointers; no range check on the host (a read-back), entries out of range are skipped.
void cuda_scatter_rows(const TensorView& src, const TensorView& idx, const TensorView& dst, cudaStream_t stream) {
  check_dev(idx, "scatter_rows", "idx", DType::i32, 1);
  FP8MOE_CHECK(src.dtype == dst.dtype && src.ndim == 2 && dst.ndim == 2 && src.size(1) == dst.size(1) &&
                   src.size(0) >= idx.size(0),
               "scatter_rows: src " << src.str() << " and dst " << dst.str() << " must be [*, C] of one dtype, src of >= "
                                    << idx.size(0) << " rows");
  FP8MOE_CHECK(src.device == Device::cuda && dst.device == Device::cuda && src.data && dst.data &&
                   src.is_contiguous() && dst.is_contiguous(),
               "scatter_rows: src " << src.str() << " and dst " << dst.str() << " must be contiguous device tensors");
  const int64_t N = idx.size(0), R = dst.size(0), row = int64_t(src.size(1)) * int64_t(dtype_size(src.dtype));
  if (N == 0 || row == 0) return;
  const uintptr_t both = reinterpret_cast<uintptr_t>(src.data) | reinterpret_cast<uintptr_t>(dst.data) | uintptr_t(row);
  const int64_t width = (both & 15) == 0 ? 16 : (both & 7) == 0 ? 8 : (both & 3) == 0 ? 4 : (both & 1) == 0 ? 2 : 1;
  const int64_t W = row / width;
  const unsigned grid = grid_for(N * W, 256);
  const int32_t* id = idx.ptr<const int32_t>();
  switch (width) {
    case 16: scatter_rows_kernel<<<grid, 256, 0, stream>>>(src.ptr<const uint4>(), id, dst.ptr<uint4>(), N, W, R); break;
    case 8: scatter_rows_kernel<<<grid, 256, 0, stream>>>(src.ptr<const uint2>(), id, dst.ptr<uint2>(), N, W, R); break;
    case 4: scatter_rows_kernel<<<grid, 256, 0, stream>>>(src.ptr<const uint32_t>(), id, dst.ptr<uint32_t>(), N, W, R); break;
    case 2: scatter_rows_kernel<<<grid, 256, 0, stream>>>(src.ptr<const uint16_t>(), id, dst.ptr<uint16_t>(), N, W, R); break;
    default: scatter_rows_kernel<<<grid, 256, 0, stream>>>(src.ptr<const uint8_t>(), id, dst.ptr<uint8_t>(), N, W, R); break;
  }
  FP8MOE_CUDA_CHECK_LAUNCH("scatter_rows_kernel");
}

void cuda_rows_dot(const TensorView& a, const TensorView& b, const TensorView& out, cudaStream_t stream) {
  check_f32(out, "rows_dot", "out", 1);
  check_f32(a, "rows_dot", "a", 2);
  check_f32(b, "rows_dot", "b", 2);
  const int64_t N = out.size(0), D = a.size(1);
  FP8MOE_CHECK(b.size(1) == D && a.size(0) >= N && b.size(0) >= N,
               "rows_dot: a " << a.str() << ", b " << b.str() << " must both be [>= " << N << ", D]");
  if (N == 0) return;
  rows_dot_kernel<<<grid_for(N * 32, 256, INT32_MAX), 256, 0, stream>>>(a.ptr<const float>(), b.ptr<const float>(),
                                                             out.ptr<float>(), N, D);
  FP8MOE_CUDA_CHECK_LAUNCH("rows_dot_kernel");
}

}  // namespace fp8moe::cuda
