// CPU grouped FP8 GEMMs: the Backend ops over the references of moe_grouped.hpp, with the group
// tables (row_group, counts, offsets) read from i32 tensors.
#include <vector>

#include "cpu_ops.hpp"
#include "fp8moe/moe_grouped.hpp"

namespace fp8moe::cpu {

namespace {

template <class T>
std::vector<T> read_i32(const TensorView& t, const char* op, const char* arg, int64_t n) {
  check_op_tensor(t, op, arg, DType::i32, 1);
  FP8MOE_CHECK(n < 0 || t.size(0) == n, op << ": " << arg << " must have " << n << " entries, got " << t.str());
  const int32_t* p = t.ptr<const int32_t>();
  return std::vector<T>(p, p + t.size(0));
}

}  // namespace

void grouped_gemm_fp8_contiguous(const QuantizedView& a, const QuantizedView& b, const TensorView& row_group,
                                 int64_t groups, const TensorView& d, const GemmOptions& opt) {
  const auto rg = read_i32<int32_t>(row_group, "grouped_gemm_fp8_contiguous", "row_group", a.rows());
  if (!opt.accumulate) return grouped_gemm_fp8_contiguous_ref(a, b, rg, groups, d, opt);
  // Accumulate: the product of each row's group added to d, padding rows untouched.
  Tensor part = Tensor::host(DType::f32, {d.size(0), d.size(1)});
  grouped_gemm_fp8_contiguous_ref(a, b, rg, groups, part, opt);
  check_tensor(d, "d", DType::f32, 2);
  const int64_t N = d.size(1);
  for (int64_t r = 0; r < d.size(0); ++r)
    if (rg[size_t(r)] >= 0)
      for (int64_t n = 0; n < N; ++n) d.ptr<float>()[r * N + n] += part.ptr<float>()[r * N + n];
}

void grouped_gemm_fp8_masked(const QuantizedView& a, const QuantizedView& b, const TensorView& counts,
                             int64_t groups, const TensorView& d, const GemmOptions& opt) {
  FP8MOE_CHECK(!opt.accumulate, "grouped_gemm_fp8_masked: accumulate is unsupported (the output is overwritten)");
  grouped_gemm_fp8_masked_ref(a, b, read_i32<int64_t>(counts, "grouped_gemm_fp8_masked", "counts", groups), groups,
                              d, opt);
}

void grouped_wgrad_fp8(const QuantizedView& dy_t, const QuantizedView& x_t, const TensorView& offsets,
                       const TensorView& d, const GemmOptions& opt) {
  grouped_wgrad_fp8_ref(dy_t, x_t, read_i32<int64_t>(offsets, "grouped_wgrad_fp8", "offsets", -1), d, opt);
}

}  // namespace fp8moe::cpu
