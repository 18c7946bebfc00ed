// CPU MoE dispatch, the specification of the device ops (contracts: include/fp8moe/backend.hpp,
// "MoE dispatch and grouped GEMMs"; argument checks: fp8moe/moe_dispatch_args.hpp):
//   moe_layout               build_moe_layout (moe_grouped.hpp) written out as the device tables:
//                            row_slot (t * k + j), row_group, slot_row, offsets; rows past
//                            offsets[G] are -1.
//   moe_masked_layout        each group's slots in slot order at its M_max rows; counts, loads.
//   moe_permute              out[r] = w[slot] * x[slot / k] (FP32 product; FP64 for f64), zero rows
//                            for slot < 0.
//   moe_permute_quantize     moe_permute into FP32, then quantize_1x128: the definition the fused
//                            CUDA kernel reproduces bit for bit.
//   moe_combine              out[t] (+)= sum_j w[t, j] * y[slot_row[t, j]], products rounded to FP32
//                            and added in slot order.
//   moe_combine_weight_grad  dw[t, j] = v[slot_row[t, j]] / w[t, j].
// Index tables are validated here (an error names the first entry out of range); the CUDA ops,
// which never synchronize, skip such entries instead.
#include <algorithm>

#include "cpu_ops.hpp"
#include "fp8moe/moe_dispatch_args.hpp"
#include "fp8moe/moe_grouped.hpp"

namespace fp8moe::cpu {

namespace {

// Every idx[i] (i < n) in [-1, hi); the error names op, arg, the entry and the range.
void check_indices(const TensorView& idx, int64_t hi, const char* op, const char* arg, const char* range) {
  const int32_t* p = idx.ptr<const int32_t>();
  for (int64_t i = 0; i < idx.numel(); ++i)
    FP8MOE_CHECK(p[i] >= -1 && p[i] < hi,
                 op << ": " << arg << "[" << i << "] = " << p[i] << " outside [-1, " << range << " = " << hi << ")");
}

}  // namespace

void moe_layout(const TensorView& expert_ids, int64_t align, const TensorView& row_slot, const TensorView& row_group,
                const TensorView& slot_row, const TensorView& offsets) {
  const MoeDispatchDims d =
      check_moe_layout_args(Device::cpu, expert_ids, align, row_slot, row_group, slot_row, offsets);
  const MoeLayout L = build_moe_layout(expert_ids, d.groups, align);  // validates the expert ids
  int32_t* rs = row_slot.ptr<int32_t>();
  int32_t* rg = row_group.ptr<int32_t>();
  std::fill_n(rs, d.rows, -1);
  std::fill_n(rg, d.rows, -1);
  std::copy(L.row_group.begin(), L.row_group.end(), rg);
  std::copy(L.slot_row.begin(), L.slot_row.end(), slot_row.ptr<int32_t>());
  for (int64_t slot = 0; slot < d.tokens * d.topk; ++slot) {
    const int32_t row = L.slot_row[size_t(slot)];
    if (row >= 0) rs[row] = int32_t(slot);
  }
  std::copy(L.offsets.begin(), L.offsets.end(), offsets.ptr<int32_t>());
}

void moe_masked_layout(const TensorView& expert_ids, int64_t groups, int64_t every_token_group,
                       const TensorView& row_slot, const TensorView& slot_row, const TensorView& counts,
                       const TensorView& loads) {
  const MoeDispatchDims d = check_moe_masked_layout_args(Device::cpu, expert_ids, groups, every_token_group, row_slot,
                                                         slot_row, counts, loads);
  const int64_t k = expert_ids.size(1), K = d.topk, M = d.rows / groups;
  check_indices(expert_ids, groups, "moe_masked_layout", "expert_ids", "G");
  const int32_t* ids = expert_ids.ptr<const int32_t>();
  int32_t* rs = row_slot.ptr<int32_t>();
  int32_t* sr = slot_row.ptr<int32_t>();
  int32_t* n = counts.ptr<int32_t>();
  std::fill_n(rs, d.rows, -1);
  std::fill_n(n, groups, 0);
  for (int64_t t = 0; t < d.tokens; ++t)
    for (int64_t j = 0; j < K; ++j) {
      const int64_t s = t * K + j, g = j < k ? ids[t * k + j] : every_token_group;
      if (g < 0) {
        sr[s] = -1;
        continue;
      }
      FP8MOE_CHECK(n[g] < M, "moe_masked_layout: group " << g << " has more than M_max = " << M << " slots");
      const int64_t r = g * M + n[g]++;
      rs[r] = int32_t(s);
      sr[s] = int32_t(r);
    }
  if (loads.defined())
    for (int64_t g = 0; g < groups; ++g) loads.ptr<int64_t>()[g] += n[g];
}

namespace {

// Element i of an f32 | f64 | bf16 tensor as double, and its store (via float unless f64).
double load_d(const TensorView& t, int64_t i) {
  return t.dtype == DType::f64 ? t.ptr<const double>()[i] : double(load_float(t, i));
}
void store_d(const TensorView& t, int64_t i, double v) {
  if (t.dtype == DType::f64) t.ptr<double>()[i] = v;
  else store_float(t, i, float(v));
}

// out[r] = w[slot] * x[slot / k] for slot = row_slot[r] >= 0, else zeros (arguments checked); the
// product in FP32, or FP64 when out is f64.
void permute_rows(const TensorView& x, const TensorView& row_slot, int64_t topk, const TensorView& w,
                  const TensorView& out, const MoeDispatchDims& d) {
  const int64_t D = d.cols;
  const bool f64 = out.dtype == DType::f64;
  const int32_t* rs = row_slot.ptr<const int32_t>();
#pragma omp parallel for schedule(static) if (d.rows * D > kParallelWork)
  for (int64_t r = 0; r < d.rows; ++r) {
    const int32_t slot = rs[r];
    const int64_t src = slot < 0 ? 0 : slot / topk * D;
    for (int64_t c = 0; c < D; ++c) {
      if (f64) {
        double v = slot < 0 ? 0.0 : load_d(x, src + c);
        if (slot >= 0 && w.defined()) v = load_d(w, slot) * v;
        store_d(out, r * D + c, v);
      } else {
        float v = slot < 0 ? 0.0f : load_float(x, src + c);
        if (slot >= 0 && w.defined()) v = float(load_d(w, slot)) * v;
        store_float(out, r * D + c, v);
      }
    }
  }
}

}  // namespace

void moe_permute(const TensorView& x, const TensorView& row_slot, int64_t topk, const TensorView& w,
                 const TensorView& out) {
  const MoeDispatchDims d = check_moe_permute_args(Device::cpu, x, row_slot, topk, w, out);
  check_indices(row_slot, d.tokens * topk, "moe_permute", "row_slot", "T * topk");
  permute_rows(x, row_slot, topk, w, out, d);
}

void moe_permute_quantize(const TensorView& x, const TensorView& row_slot, int64_t topk, const TensorView& w,
                          const QuantizedView& out, ScaleMode mode) {
  const MoeDispatchDims d = check_moe_permute_quantize_args(Device::cpu, x, row_slot, topk, w, out);
  check_indices(row_slot, d.tokens * topk, "moe_permute_quantize", "row_slot", "T * topk");
  Tensor rows = Tensor::host(DType::f32, {d.rows, d.cols});
  permute_rows(x, row_slot, topk, w, rows.view(), d);
  quantize_1x128(rows.view(), out, mode);
}

void moe_combine(const TensorView& y, const TensorView& slot_row, const TensorView& w, const TensorView& out,
                 bool accumulate) {
  const MoeDispatchDims d = check_moe_combine_args(Device::cpu, y, slot_row, w, out);
  check_indices(slot_row, d.rows, "moe_combine", "slot_row", "R");
  const int64_t N = d.cols, k = d.topk;
  const int32_t* sr = slot_row.ptr<const int32_t>();
  // Row by row, slot by slot: every element still sums its products in slot order (in FP32, or
  // FP64 when out is f64).
  const auto run = [&](auto zero) {
    using T = decltype(zero);
#pragma omp parallel for schedule(static) if (d.tokens * k * N > kParallelWork)
    for (int64_t t = 0; t < d.tokens; ++t) {
      T* o = out.ptr<T>() + t * N;
      if (!accumulate) std::fill_n(o, N, T(0));
      for (int64_t j = 0; j < k; ++j) {
        const int32_t row = sr[t * k + j];
        if (row < 0) continue;
        const T wj = w.defined() ? T(load_d(w, t * k + j)) : T(1);
        for (int64_t n = 0; n < N; ++n) o[n] += wj * T(load_d(y, row * N + n));
      }
    }
  };
  out.dtype == DType::f64 ? run(0.0) : run(0.0f);
}

void moe_combine_weight_grad(const TensorView& v, const TensorView& slot_row, const TensorView& w,
                             const TensorView& dw) {
  const MoeDispatchDims d = check_moe_combine_weight_grad_args(Device::cpu, v, slot_row, w, dw);
  check_indices(slot_row, d.rows, "moe_combine_weight_grad", "slot_row", "R");
  const int32_t* sr = slot_row.ptr<const int32_t>();
  for (int64_t i = 0; i < d.tokens * d.topk; ++i) {
    if (dw.dtype == DType::f64)
      dw.ptr<double>()[i] = sr[i] < 0 ? 0.0 : load_d(v, sr[i]) / load_d(w, i);
    else
      dw.ptr<float>()[i] = sr[i] < 0 ? 0.0f : float(load_d(v, sr[i])) / float(load_d(w, i));
  }
}

}  // namespace fp8moe::cpu
