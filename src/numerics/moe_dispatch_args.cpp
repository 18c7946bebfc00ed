// Argument checks of the MoE dispatch ops, shared by the backends (fp8moe/moe_dispatch_args.hpp).
// Messages read "<op>: <arg>: expected ...".
#include "fp8moe/moe_dispatch_args.hpp"

#include <cstdint>
#include <limits>
#include <string>

#include "fp8moe/backend.hpp"

namespace fp8moe {

namespace {

constexpr int64_t kMaxI32 = std::numeric_limits<int32_t>::max();

struct ArgChecker {
  Device device;
  const char* op;

  std::string name(const char* arg) const { return std::string(op) + ": " + arg; }
  void on_device(const TensorView& t, const char* arg) const {
    FP8MOE_CHECK(!t.defined() || t.device == device,
                 op << ": " << arg << " must be a " << device_name(device) << " tensor, got " << t.str());
  }
  void tensor(const TensorView& t, const char* arg, std::initializer_list<DType> dtypes, int ndim) const {
    check_tensor(t, name(arg).c_str(), dtypes, ndim);
    on_device(t, arg);
  }
  // f32 (or bf16 where allowed); f64 too on the cpu, for the fp64 recipe.
  void floats(const TensorView& t, const char* arg, bool bf16, int ndim) const {
    if (device == Device::cpu)
      bf16 ? tensor(t, arg, {DType::f32, DType::bf16, DType::f64}, ndim) : tensor(t, arg, {DType::f32, DType::f64}, ndim);
    else
      bf16 ? tensor(t, arg, {DType::f32, DType::bf16}, ndim) : tensor(t, arg, {DType::f32}, ndim);
  }
  void shape(const TensorView& t, const char* arg, std::initializer_list<int64_t> dims) const {
    check_shape(t, name(arg).c_str(), dims);
  }
  // Optional per-slot weights: undefined, or [T, k] f32 (f64 on the cpu).
  void weights(const TensorView& w, int64_t tokens, int64_t topk) const {
    if (!w.defined()) return;
    floats(w, "w", false, 2);
    shape(w, "w", {tokens, topk});
  }
};

// The inputs moe_permute and moe_permute_quantize share: x [T, D], row_slot [R], w.
MoeDispatchDims check_permute_inputs(const ArgChecker& c, const TensorView& x, const TensorView& row_slot,
                                     int64_t topk, const TensorView& w) {
  c.floats(x, "x", true, 2);
  c.tensor(row_slot, "row_slot", {DType::i32}, 1);
  FP8MOE_CHECK(topk >= 1, c.op << ": topk must be >= 1, got " << topk);
  MoeDispatchDims d;
  d.tokens = x.size(0);
  d.topk = topk;
  d.rows = row_slot.size(0);
  d.cols = x.size(1);
  FP8MOE_CHECK(d.tokens * topk <= kMaxI32 + 1,
               c.op << ": T * topk = " << d.tokens * topk << " slots exceed the i32 slot indices of row_slot");
  c.weights(w, d.tokens, topk);
  return d;
}

// slot_row [T, k] i32 and the optional weights beside it.
MoeDispatchDims check_slot_table(const ArgChecker& c, const TensorView& slot_row, const TensorView& w) {
  c.tensor(slot_row, "slot_row", {DType::i32}, 2);
  MoeDispatchDims d;
  d.tokens = slot_row.size(0);
  d.topk = slot_row.size(1);
  c.weights(w, d.tokens, d.topk);
  return d;
}

}  // namespace

MoeDispatchDims check_moe_layout_args(Device device, const TensorView& expert_ids, int64_t align,
                                      const TensorView& row_slot, const TensorView& row_group,
                                      const TensorView& slot_row, const TensorView& offsets) {
  const ArgChecker c{device, "moe_layout"};
  c.tensor(expert_ids, "expert_ids", {DType::i32}, 2);
  c.tensor(row_slot, "row_slot", {DType::i32}, 1);
  c.tensor(row_group, "row_group", {DType::i32}, 1);
  c.tensor(slot_row, "slot_row", {DType::i32}, 2);
  c.tensor(offsets, "offsets", {DType::i32}, 1);
  MoeDispatchDims d;
  d.tokens = expert_ids.size(0);
  d.topk = expert_ids.size(1);
  d.rows = row_slot.size(0);
  d.groups = offsets.size(0) - 1;
  FP8MOE_CHECK(align >= 1 && align <= kMaxI32, "moe_layout: align must be in [1, 2^31), got " << align);
  FP8MOE_CHECK(d.groups >= 1, "moe_layout: offsets must hold G + 1 >= 2 entries (G experts), got " << offsets.str());
  FP8MOE_CHECK(d.groups < kMaxI32, "moe_layout: G = " << d.groups << " experts exceed the i32 expert ids");
  c.shape(row_group, "row_group", {d.rows});
  c.shape(slot_row, "slot_row", {d.tokens, d.topk});
  const int64_t slots = d.tokens * d.topk, need = moe_layout_rows(slots, d.groups, align);
  FP8MOE_CHECK(slots <= kMaxI32, "moe_layout: T * k = " << slots << " slots exceed the i32 range of row_slot");
  FP8MOE_CHECK(need <= kMaxI32, "moe_layout: moe_layout_rows(T * k = " << slots << ", G = " << d.groups
                                                                       << ", align = " << align << ") = " << need
                                                                       << " exceeds the i32 range of slot_row");
  FP8MOE_CHECK(d.rows >= need, "moe_layout: row_slot has " << d.rows << " rows, fewer than moe_layout_rows(T * k = "
                                                           << slots << ", G = " << d.groups << ", align = " << align
                                                           << ") = " << need);
  return d;
}

MoeDispatchDims check_moe_masked_layout_args(Device device, const TensorView& expert_ids, int64_t groups,
                                             int64_t every_token_group, const TensorView& row_slot,
                                             const TensorView& slot_row, const TensorView& counts,
                                             const TensorView& loads) {
  const ArgChecker c{device, "moe_masked_layout"};
  c.tensor(expert_ids, "expert_ids", {DType::i32}, 2);
  c.tensor(row_slot, "row_slot", {DType::i32}, 1);
  c.tensor(slot_row, "slot_row", {DType::i32}, 2);
  c.tensor(counts, "counts", {DType::i32}, 1);
  MoeDispatchDims d;
  d.tokens = expert_ids.size(0);
  d.topk = expert_ids.size(1) + (every_token_group >= 0 ? 1 : 0);
  d.rows = row_slot.size(0);
  d.groups = groups;
  FP8MOE_CHECK(groups >= 1 && groups < kMaxI32, "moe_masked_layout: groups must be in [1, 2^31 - 1), got " << groups);
  FP8MOE_CHECK(every_token_group < groups,
               "moe_masked_layout: every_token_group " << every_token_group << " is not one of the " << groups
                                                       << " groups (-1: none)");
  FP8MOE_CHECK(d.rows % groups == 0 && d.rows <= kMaxI32,
               "moe_masked_layout: row_slot's " << d.rows << " rows are not G * M_max (G = " << groups
                                                << ") within the i32 range");
  FP8MOE_CHECK(d.tokens * d.topk <= kMaxI32,
               "moe_masked_layout: T * K = " << d.tokens * d.topk << " slots exceed the i32 range of row_slot");
  c.shape(slot_row, "slot_row", {d.tokens, d.topk});
  c.shape(counts, "counts", {groups});
  if (loads.defined()) {
    c.tensor(loads, "loads", {DType::i64}, 1);
    c.shape(loads, "loads", {groups});
  }
  return d;
}

MoeDispatchDims check_moe_permute_args(Device device, const TensorView& x, const TensorView& row_slot, int64_t topk,
                                       const TensorView& w, const TensorView& out) {
  const ArgChecker c{device, "moe_permute"};
  const MoeDispatchDims d = check_permute_inputs(c, x, row_slot, topk, w);
  c.floats(out, "out", true, 2);
  c.shape(out, "out", {d.rows, d.cols});
  return d;
}

MoeDispatchDims check_moe_permute_quantize_args(Device device, const TensorView& x, const TensorView& row_slot,
                                                int64_t topk, const TensorView& w, const QuantizedView& out) {
  const ArgChecker c{device, "moe_permute_quantize"};
  const MoeDispatchDims d = check_permute_inputs(c, x, row_slot, topk, w);
  check_quantized(out, "moe_permute_quantize: out", ScaleKind::tile_1x128);
  c.tensor(out.values, "out.values", {DType::e4m3, DType::e5m2}, 2);
  c.on_device(out.scales, "out.scales");
  c.shape(out.values, "out.values", {d.rows, d.cols});
  FP8MOE_CHECK(d.cols % kQuantGroup == 0,
               "moe_permute_quantize: D = " << d.cols << " columns must be a multiple of " << kQuantGroup);
  return d;
}

MoeDispatchDims check_moe_combine_args(Device device, const TensorView& y, const TensorView& slot_row,
                                       const TensorView& w, const TensorView& out) {
  const ArgChecker c{device, "moe_combine"};
  c.floats(y, "y", true, 2);
  MoeDispatchDims d = check_slot_table(c, slot_row, w);
  d.rows = y.size(0);
  d.cols = y.size(1);
  c.floats(out, "out", false, 2);
  c.shape(out, "out", {d.tokens, d.cols});
  return d;
}

MoeDispatchDims check_moe_combine_weight_grad_args(Device device, const TensorView& v, const TensorView& slot_row,
                                                   const TensorView& w, const TensorView& dw) {
  const ArgChecker c{device, "moe_combine_weight_grad"};
  c.floats(v, "v", false, 1);
  FP8MOE_CHECK(w.defined(), "moe_combine_weight_grad: w is undefined (the weights divide v)");
  MoeDispatchDims d = check_slot_table(c, slot_row, w);
  d.rows = v.size(0);
  c.floats(dw, "dw", false, 2);
  c.shape(dw, "dw", {d.tokens, d.topk});
  return d;
}

MoeDispatchDims check_moe_balance_loss_args(Device device, const TensorView& scores, const TensorView& idx,
                                            int64_t seq_len, const TensorView& loss, const TensorView& dscores) {
  const ArgChecker c{device, "moe_balance_loss"};
  c.floats(scores, "scores", false, 2);
  c.tensor(idx, "idx", {DType::i32}, 2);
  MoeDispatchDims d;
  d.tokens = scores.size(0);
  d.groups = scores.size(1);
  d.topk = idx.size(1);
  c.shape(idx, "idx", {d.tokens, d.topk});
  FP8MOE_CHECK(seq_len > 0 && d.tokens % seq_len == 0,
               "moe_balance_loss: " << d.tokens << " tokens are not whole sequences of " << seq_len);
  if (loss.defined()) {
    c.tensor(loss, "loss", {DType::f64}, 1);
    c.shape(loss, "loss", {1});
  }
  if (dscores.defined()) {
    c.tensor(dscores, "dscores", {scores.dtype}, 2);
    c.shape(dscores, "dscores", {d.tokens, d.groups});
  }
  return d;
}

}  // namespace fp8moe
