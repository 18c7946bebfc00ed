"""Independent PyTorch reference of fp8moe's DeepSeek-V3-mini (the numerical oracle of issue 5).

Written from the DeepSeek-V3 report (MLA, DeepSeekMoE with sigmoid affinities, group-limited
top-k, bias-steered selection, sequence-wise balance loss, depth-1 MTP sharing embedding and head),
not from the C++ code: it reads the config JSON and the weights from the safetensors file that
`fp8moe model --dump` writes, runs forward and autograd backward in float64, and compares logits,
losses and every gradient with what the C++ model wrote (compare.py: end to end, or per sublayer
with --teacher-forced).

  python3 compare.py DUMP_DIR CONFIG_JSON [--tol 1e-3] [--bf16] [--teacher-forced]

With bf16=True the reference rounds to BF16 where the bf16 recipe does (include/fp8moe/
model_recipe.hpp; src/model/linear.cpp, attention.cpp, mlp.cpp, moe.cpp, model.cpp), and only there:
  1. every Linear's GEMM operands (q_a/q_b/q, kv_a, kv_b, o_proj, dense MLP, shared and routed
     experts, eh_proj, lm_head of both heads): Fprop bf16(x) bf16(W)^T, Dgrad bf16(dy) bf16(W), Wgrad
     bf16(dy)^T bf16(x) with x the BF16 copy cached in the forward (Bf16Linear);
  2. the attention output O: cached in BF16 as o_proj's input, and the softmax backward's
     rowsum(dO * O) reads that cached copy (Bf16CausalAttention);
  3. SwiGLU (Bf16SwiGLU): the gate/up outputs are cached in BF16 and the backward recomputes
     silu(g) * u from them; the down projection reads bf16(silu(g) * u) of the unrounded g, u in
     the forward and of the recomputed one in its Wgrad; a routed expert's output gradient w * dy
     enters as bf16(w * dy); the routing-weight gradient is (da . a) / w of the recomputed a.
Not rounded (FP32 in the recipe, float64 here): embedding, RMSNorms, RoPE, softmax, router gate
GEMM and routing, cross-entropy, residual adds, the MoE combine. Not modelled: the FP32 evaluation
and FP32 GEMM accumulation of the values before each BF16 rounding (float64 here). A value within
an FP32 error of a BF16 rounding midpoint can therefore round to the other side than in the C++
model; set_rounding_jitter measures how far such flips move a result (compare.py --noise-floor).

Conventions shared with the C++ model (and with DeepSeek-V3's Hugging Face code up to a fixed
permutation of the RoPE dims, which leaves q.k unchanged): RoPE rotates interleaved pairs
(x[2i], x[2i+1]) by pos * theta^(-2i/d_rope); the MTP module's eh_proj sees [enorm(emb); hnorm(h)].
"""
import json
import math
import struct

import torch

_DTYPES = {"F32": torch.float32, "F64": torch.float64, "I32": torch.int32, "BF16": torch.bfloat16}


def read_safetensors(path):
    """A minimal safetensors reader (header length, JSON header, raw little-endian data)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        a, b = meta["data_offsets"]
        t = torch.frombuffer(bytearray(data[a:b]), dtype=_DTYPES[meta["dtype"]]) if b > a else torch.empty(0)
        out[name] = t.reshape(meta["shape"]).clone()
    return out


def rmsnorm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, pos, theta):
    """x [..., T, d] (T the token axis second to last), interleaved pairs."""
    d = x.shape[-1]
    freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # [d/2]
    ang = pos[:, None].double() * freq[None, :]                      # [T, d/2]
    c, s = torch.cos(ang), torch.sin(ang)
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.zeros_like(x)
    out[..., 0::2] = a * c - b * s
    out[..., 1::2] = a * s + b * c
    return out


_JITTER = {"rel": 0.0, "gen": None}


def set_rounding_jitter(rel, seed=0):
    """Multiplies every activation or gradient by (1 + rel * U(-1, 1)) just before its BF16
    rounding (weights excluded: the FP32 master weights are the same on both sides); rel = 0 (the
    default) turns it off. With rel of the order of the FP32 evaluation error of those values
    (compare.py --noise-floor: 2^-20), the reference's spread shows how much BF16 rounding flips
    alone move each tensor: the resolution of a BF16 comparison."""
    _JITTER["rel"] = rel
    _JITTER["gen"] = torch.Generator().manual_seed(seed) if rel > 0 else None


def bf16(t):
    """An activation or gradient rounded to BF16 (a rounding point of the bf16 recipe)."""
    if _JITTER["rel"] > 0:
        u = torch.rand(t.shape, generator=_JITTER["gen"], dtype=torch.float64)
        t = t * (1 + _JITTER["rel"] * (2 * u - 1))
    return t.to(torch.bfloat16).double()


def bf16_weight(w):
    """A master weight as a BF16 GEMM operand."""
    return w.to(torch.bfloat16).double()


class Bf16Linear(torch.autograd.Function):
    """y = x W^T with both operands rounded to BF16, as the bf16 recipe's GEMMs read them; the
    backward rounds dy, W and the cached x the same way (Dgrad dy W, Wgrad dy^T x). Products and
    sums stay in float64: only the recipe's roundings are modelled, not the accumulation order."""

    @staticmethod
    def forward(ctx, x, w):
        xb, wb = bf16(x), bf16_weight(w)
        ctx.save_for_backward(xb, wb)
        return xb @ wb.T

    @staticmethod
    def backward(ctx, dy):
        xb, wb = ctx.saved_tensors
        dyb = bf16(dy)
        return dyb @ wb, dyb.T @ xb


class Bf16SwiGLU(torch.autograd.Function):
    """w[:, None] * down(silu(gate(h)) * up(h)) as the bf16 recipe computes it and its gradient
    (src/model/mlp.cpp, moe.cpp): BF16 GEMM operands; the gate/up outputs are cached in BF16 and the
    backward recomputes the SwiGLU from them (the forward used the unrounded values); the output
    gradient enters the down projection's Dgrad as bf16(w * dy); the routing-weight gradient is
    (da . a) / w with a the recomputed SwiGLU output."""

    @staticmethod
    def forward(ctx, h, wg, wu, wd, w):
        hb, wgb, wub, wdb = bf16(h), bf16_weight(wg), bf16_weight(wu), bf16_weight(wd)
        g, u = hb @ wgb.T, hb @ wub.T
        a = torch.nn.functional.silu(g) * u
        ctx.save_for_backward(hb, wgb, wub, wdb, bf16(g), bf16(u), w)
        return w[:, None] * (bf16(a) @ wdb.T)

    @staticmethod
    def backward(ctx, dout):
        hb, wgb, wub, wdb, gr, ur, w = ctx.saved_tensors
        dye = bf16(w[:, None] * dout)
        da = dye @ wdb
        sg = torch.sigmoid(gr)
        a = gr * sg * ur
        dw = (da * a).sum(-1) / w
        dg = bf16(da * ur * sg * (1 + gr * (1 - sg)))
        du = bf16(da * gr * sg)
        return dg @ wgb + du @ wub, dg.T @ hb, du.T @ hb, dye.T @ bf16(a), dw


class Bf16CausalAttention(torch.autograd.Function):
    """softmax(Q K^T * scale, causal) V [B, H, S, dv], with the bf16 recipe's backward: the
    attention output is cached in BF16 (it is the o_proj input) and the softmax backward's
    rowsum(dO * O) reads that cached copy (src/model/attention.cpp)."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        S = q.shape[-2]
        scores = (q @ k.transpose(-1, -2)) * scale
        mask = torch.ones(S, S, dtype=torch.bool).tril()
        p = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)
        o = p @ v
        ctx.save_for_backward(q, k, v, p, bf16(o))
        ctx.scale = scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, p, o_cached = ctx.saved_tensors
        dv = p.transpose(-1, -2) @ do
        dp = do @ v.transpose(-1, -2)
        ds = p * (dp - (do * o_cached).sum(-1, keepdim=True)) * ctx.scale
        return ds @ k, ds.transpose(-1, -2) @ q, dv, None


class Reference:
    def __init__(self, cfg, weights, bf16=False):
        self.c = cfg
        self.bf16 = bf16  # the bf16 recipe: every Linear (not the router, not the embedding) in BF16
        self.w = {k: v.double().requires_grad_(not k.endswith("e_score_correction_bias")) for k, v in weights.items()}

    def W(self, name):
        return self.w[name]

    def lin(self, x, name):
        """A Linear: x [T, in] @ W^T, in the recipe's GEMM precision."""
        return Bf16Linear.apply(x, self.W(name)) if self.bf16 else x @ self.W(name).T

    def attention(self, p, x, B, S, pos):
        c = self.c
        H, dn, dr, dv = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
        eps = c["rms_norm_eps"]
        T = x.shape[0]
        h = rmsnorm(x, self.W(p + "input_layernorm.weight"), eps)
        if c.get("q_lora_rank", 0):
            cq = rmsnorm(self.lin(h, p + "self_attn.q_a_proj.weight"), self.W(p + "self_attn.q_a_layernorm.weight"), eps)
            q = self.lin(cq, p + "self_attn.q_b_proj.weight")
        else:
            q = self.lin(h, p + "self_attn.q_proj.weight")
        q = q.view(B, S, H, dn + dr).transpose(1, 2)                       # [B, H, S, dqk]
        ckv = self.lin(h, p + "self_attn.kv_a_proj_with_mqa.weight")      # [T, rkv + dr]
        rkv = c["kv_lora_rank"]
        latent, k_pe = ckv[:, :rkv], ckv[:, rkv:]
        kv = self.lin(rmsnorm(latent, self.W(p + "self_attn.kv_a_layernorm.weight"), eps), p + "self_attn.kv_b_proj.weight")
        kv = kv.view(B, S, H, dn + dv).transpose(1, 2)                      # [B, H, S, dn + dv]
        k_nope, v = kv[..., :dn], kv[..., dn:]
        q_pe = rope(q[..., dn:], pos[:S], c["rope_theta"])
        k_pe = rope(k_pe.view(B, 1, S, dr), pos[:S], c["rope_theta"]).expand(B, H, S, dr)
        Q = torch.cat([q[..., :dn], q_pe], -1)
        K = torch.cat([k_nope, k_pe], -1)
        if self.bf16:
            o = Bf16CausalAttention.apply(Q, K, v, 1.0 / math.sqrt(dn + dr))  # [B, H, S, dv]
        else:
            scores = Q @ K.transpose(-1, -2) / math.sqrt(dn + dr)          # [B, H, S, S]
            mask = torch.ones(S, S, dtype=torch.bool).tril()
            scores = scores.masked_fill(~mask, float("-inf"))
            o = torch.softmax(scores, -1) @ v                               # [B, H, S, dv]
        o = o.transpose(1, 2).reshape(T, H * dv)
        return x + self.lin(o, p + "self_attn.o_proj.weight")

    def mlp(self, p, h, w=None):
        """SwiGLU MLP; w [n] scales each row's output (the routing weights of an expert)."""
        if self.bf16:
            ones = torch.ones(h.shape[0], dtype=torch.float64)
            return Bf16SwiGLU.apply(h, self.W(p + "gate_proj.weight"), self.W(p + "up_proj.weight"),
                                    self.W(p + "down_proj.weight"), ones if w is None else w)
        y = self.mlp_plain(p, h)
        return y if w is None else y * w[:, None]

    def mlp_plain(self, p, h):
        g = self.lin(h, p + "gate_proj.weight")
        u = self.lin(h, p + "up_proj.weight")
        return self.lin(torch.nn.functional.silu(g) * u, p + "down_proj.weight")

    def moe(self, p, x, B, S, losses):
        c = self.c
        E, K = c["n_routed_experts"], c["num_experts_per_tok"]
        G, TG = c["n_group"], c["topk_group"]
        T, D = x.shape
        h = rmsnorm(x, self.W(p + "post_attention_layernorm.weight"), c["rms_norm_eps"])
        y = x.clone()
        if c["n_shared_experts"] > 0:
            y = y + self.mlp(p + "mlp.shared_experts.", h)
        s = torch.sigmoid(h @ self.W(p + "mlp.gate.weight").T)            # [T, E]
        choice = s.detach() + self.W(p + "mlp.gate.e_score_correction_bias")
        gs = E // G
        grouped = choice.view(T, G, gs)
        gscore = grouped.topk(min(2, gs), -1).values.sum(-1)                # [T, G]
        keep = torch.zeros(T, G, dtype=torch.bool)
        keep.scatter_(1, gscore.topk(TG, -1).indices, True)
        masked = choice.masked_fill(~keep.repeat_interleave(gs, 1), float("-inf"))
        idx = masked.topk(K, -1).indices                                    # [T, K]
        w = s.gather(1, idx)
        if c.get("norm_topk_prob", True):
            w = w / w.sum(-1, keepdim=True)
        w = w * c["routed_scaling_factor"]
        for e in range(E):
            t, j = (idx == e).nonzero(as_tuple=True)
            if t.numel() == 0:
                continue
            y = y.index_add(0, t, self.mlp(p + f"mlp.experts.{e}.", h[t], w[t, j]))
        # Sequence-wise balance loss: alpha * sum_i f_i P_i, averaged over sequences.
        alpha = c.get("aux_loss_alpha", 0.0)
        if alpha > 0:
            sn = (s / s.sum(-1, keepdim=True)).view(B, S, E)
            onehot = torch.zeros(T, E, dtype=torch.float64).scatter_(1, idx, 1.0).view(B, S, E)
            f = onehot.sum(1) * E / (K * S)                                  # [B, E]
            P = sn.mean(1)                                                   # [B, E]
            losses["balance"] = losses["balance"] + alpha * (f * P).sum(-1).mean()
        loads = torch.bincount(idx.flatten(), minlength=E)
        return y, loads

    def block(self, layer, x, B, S, pos, losses):
        c = self.c
        p = f"model.layers.{layer}."
        x = self.attention(p, x, B, S, pos)
        moe = c["n_routed_experts"] > 0 and layer >= c["first_k_dense_replace"]
        if moe:
            x, _ = self.moe(p, x, B, S, losses)
        else:
            x = self.dense(p, x)
        return x

    def dense(self, p, x):
        """The dense MLP sublayer: x + mlp(post_attention_layernorm(x))."""
        h = rmsnorm(x, self.W(p + "post_attention_layernorm.weight"), self.c["rms_norm_eps"])
        return x + self.mlp(p + "mlp.", h)

    def head(self, h, norm_name, targets):
        logits = self.lin(rmsnorm(h, self.W(norm_name), self.c["rms_norm_eps"]), "lm_head.weight")
        loss = torch.nn.functional.cross_entropy(logits, targets.long(), ignore_index=-1)
        return logits, loss

    def mtp_targets(self, tgt, S):
        """tgt [T] (token t+1 of each position) -> the MTP module's inputs ids [T] (token t+1) and
        targets [T] (token t+2 inside the sequence, else -1)."""
        T = tgt.shape[0]
        ids = tgt.clamp(min=0).long()
        nxt = torch.full((T,), -1, dtype=torch.int32)
        inside = (torch.arange(T) % S) < S - 1
        shifted = torch.cat([tgt[1:], tgt[:1]])
        nxt[inside] = shifted[inside]
        nxt[tgt < 0] = -1
        return ids, nxt

    def eh(self, h, ids):
        """The MTP module's input: eh_proj([enorm(embed(ids)); hnorm(h)]), h the trunk output."""
        c = self.c
        p = f"model.layers.{c['num_hidden_layers']}."
        e = rmsnorm(self.W("model.embed_tokens.weight")[ids], self.W(p + "enorm.weight"), c["rms_norm_eps"])
        hh = rmsnorm(h, self.W(p + "hnorm.weight"), c["rms_norm_eps"])
        return self.lin(torch.cat([e, hh], -1), p + "eh_proj.weight")

    def forward(self, tokens, targets):
        """tokens, targets [B, S] int32 -> (logits [T, V], losses dict)."""
        c = self.c
        B, S = tokens.shape
        T = B * S
        pos = torch.arange(S)
        tok, tgt = tokens.reshape(T).long(), targets.reshape(T)
        x = self.W("model.embed_tokens.weight")[tok]
        losses = {"balance": torch.zeros((), dtype=torch.float64)}
        L = c["num_hidden_layers"]
        for l in range(L):
            x = self.block(l, x, B, S, pos, losses)
        logits, losses["main"] = self.head(x, "model.norm.weight", tgt)
        losses["mtp"] = torch.zeros((), dtype=torch.float64)
        if c.get("num_nextn_predict_layers", 0) > 0:
            p = f"model.layers.{L}."
            ids, nxt = self.mtp_targets(tgt, S)
            m = self.block(L, self.eh(x, ids), B, S, pos, losses)
            _, losses["mtp"] = self.head(m, p + "shared_head.norm.weight", nxt)
        losses["total"] = losses["main"] + c.get("mtp_loss_weight", 0.0) * losses["mtp"] + losses["balance"]
        return logits, losses
