// The analytic account of the bytes each layer keeps from forward to backward (report §3.2.3 and
// §3.3.3), from the config and the recipe alone. RMSNorm outputs are not kept (the backward
// recomputes them from the norms' inputs, which are; the MTP's embedding too, from the token ids). It lists the same tensors, in the same formats,
// as the layers' forward records (Saved::kept), so tests can check one against the other; with FP8
// the cached Linear inputs are padded to 128 tokens (the Wgrad's K) and carry 4-byte scales per 128,
// and the routed experts cache their segments of the expert-sorted layout, each padded to 128 rows.
#include "model_internal.hpp"

namespace fp8moe {

namespace {

struct Acc {
  const Recipe& r;
  std::vector<MemoryItem>& items;
  std::string layer;

  void plain(const std::string& name, DType dt, int64_t n) { items.push_back({layer, name, dt, n, int64_t(dtype_bytes(dt, n))}); }
  void act(const std::string& name, int64_t n) { plain(name, r.act_dtype, n); }
  // A cached activation [T, K] (model::cache_activation).
  void cached(const std::string& name, int64_t T, int64_t K, bool pad, DType qdtype = DType::e4m3) {
    switch (r.linear) {
      case LinearPrecision::full: act(name, T * K); return;
      case LinearPrecision::bf16: plain(name, DType::bf16, T * K); return;
      case LinearPrecision::fp8: {
        const int64_t rows = pad ? round_up(T, kQuantGroup) : T;
        if (r.f32_cache) act(name, rows * K);  // the exact copy (fp8-f32-cache), listed first
        plain(name, qdtype, rows * K);
        const auto ss = scale_shape(ScaleKind::tile_1x128, rows, K);
        plain(name + ".scales", DType::f32, ss[0] * ss[1]);
        return;
      }
    }
  }
};

}  // namespace

MemoryAccount predict_memory(const ModelConfig& c, const Recipe& r, int64_t T,
                             const std::vector<std::vector<int64_t>>* loads) {
  validate_config(c, r);
  MemoryAccount m;
  const int64_t D = c.hidden_size, H = c.num_attention_heads, E = c.n_routed_experts, K = c.num_experts_per_tok;
  int64_t moe_index = 0;
  for (int64_t l = 0; l < c.num_layers_total(); ++l) {
    const std::string L = "layers." + std::to_string(l);
    if (l >= c.num_hidden_layers) {
      // The trunk output as the sublayers keep their inputs, the token ids and the norms' rstd; the
      // embedding and eh_proj's input (the two norm outputs) are recomputed.
      Acc a{r, m.items, L + ".eh"};
      a.plain("h", r.residual_cache, T * D);
      a.plain("ids", DType::i32, T);
      a.act("rstd_e", T);
      a.act("rstd_h", T);
    }
    {
      Acc a{r, m.items, L + ".attn"};
      a.plain("x", r.residual_cache, T * D);
      a.act("rstd", T);
      if (c.q_lora_rank > 0) {
        a.act("q_a_out", T * c.q_lora_rank);
        a.act("rstd_q", T);
      }
      a.act("kv_a_out", T * (c.kv_lora_rank + c.qk_rope_head_dim));
      a.act("rstd_kv", T);
      a.cached("attn_out", T, H * c.v_head_dim, true, r.attn_out_cache);
      a.act("lse", H * T);
    }
    if (!c.is_moe_layer(l)) {
      Acc a{r, m.items, L + ".mlp"};
      a.plain("x", r.residual_cache, T * D);
      a.act("rstd", T);
      a.cached("gate_out", T, c.intermediate_size, false);
      a.cached("up_out", T, c.intermediate_size, false);
      continue;
    }
    Acc a{r, m.items, L + ".moe"};
    a.plain("x", r.residual_cache, T * D);
    a.act("rstd", T);
    if (c.n_shared_experts > 0) {
      const int64_t F = c.n_shared_experts * c.moe_intermediate_size;
      a.cached("shared.gate_out", T, F, false);
      a.cached("shared.up_out", T, F, false);
    }
    a.act("scores", T * E);
    a.plain("topk_idx", DType::i32, T * K);
    a.act("topk_w", T * K);
    // The expert-sorted layout: row_slot [R], slot_row [T, K], row_group [R], offsets [E + 1].
    const int64_t R = moe_layout_rows(T * K, E, 128);
    a.plain("layout", DType::i32, R);
    a.plain("layout", DType::i32, T * K);
    a.plain("layout", DType::i32, R);
    a.plain("layout", DType::i32, E + 1);
    // Balanced routing unless the observed loads are given; each expert's segment padded to 128.
    const auto load = [&](int64_t e) {
      return loads ? (*loads)[size_t(moe_index)][size_t(e)] : (T * K) / E + (e < (T * K) % E ? 1 : 0);
    };
    if (r.groups_experts()) {  // all segments at once
      // The grouped FP8 GEMMs run over the layout's bound (the loads stay on the device), the BF16
      // segment GEMMs over the rows the segments use.
      int64_t rows = 0;
      for (int64_t e = 0; e < E; ++e) rows += round_up(load(e), 128);
      if (r.linear != LinearPrecision::bf16) rows = R;
      a.cached("experts.in", rows, D, true);
      a.cached("experts.gate_out", rows, c.moe_intermediate_size, false);
      a.cached("experts.up_out", rows, c.moe_intermediate_size, false);
      ++moe_index;
      continue;
    }
    for (int64_t e = 0; e < E; ++e) {
      const int64_t n = load(e);
      if (n == 0) continue;
      a.cached("experts.in", round_up(n, 128), D, true);
      a.cached("experts.gate_out", round_up(n, 128), c.moe_intermediate_size, false);
      a.cached("experts.up_out", round_up(n, 128), c.moe_intermediate_size, false);
    }
    ++moe_index;
  }
  return m;
}

}  // namespace fp8moe
