"""Compares one `fp8moe model --dump DIR` with the PyTorch reference (deepseek_mini.py).

  python3 tests/reference/compare.py DIR configs/tiny.json [--weights DIR_OF_WEIGHTS] [--tol 1e-3]
  python3 tests/reference/compare.py DIR configs/tiny.json --teacher-forced [--bf16] [--tol 1e-3]

End to end (default): the reference runs the whole model on the dumped weights and batch; relative
error per tensor ||ours - ref|| / ||ref|| for the logits, the four losses and every gradient, plus
calc_diff = 1 - 2 sum(xy) / sum(x^2 + y^2). Fails (exit 1) when any relative error exceeds --tol:
the fp32 recipe against the exact reference, the bf16 recipe with --bf16 (the reference then rounds
the GEMM operands to BF16 where the recipe does); for fp8 dumps pass --report-only (their distance
is the FP8 recipe's error).

Teacher forced (--teacher-forced, needs a dump made with --dump-sublayers): every sublayer of the
reference runs on the input the C++ model gave that sublayer (sub.<i>.<sublayer>.x) and its backward
on the output gradient the C++ model gave it (dy; for the heads the gradient of their weighted loss),
so that roundings to different sides in one sublayer do not propagate into the next. Compared per
sublayer: its output (y; the logits and loss of a head; the balance loss of a MoE layer), its input
gradient (dx) and the gradients of the parameters it owns. Shared parameters are compared as the sum
of their teacher-forced contributions: embed_tokens = the embedding lookup's backward (the scatter of
sub.0's dumped dx over the tokens, exact) + the MTP eh sublayer's; lm_head = main head + MTP head.
Besides rel and calc_diff the table gives max = max|ours - ref| / max|ref|.

--noise-floor N (with --bf16): reruns the reference N times with every activation and gradient
multiplied by (1 + --jitter * U(-1, 1)) before its BF16 rounding, and adds a column floor = the
largest rel distance of those reruns from the unperturbed reference. The default jitter 2^-20 (16
FP32 units of roundoff) is about the FP32 accumulation error of the recipe's GEMM outputs (K = 128
to 256) in their upper tail: the C++ model computes the values before each BF16 rounding in FP32,
the reference in float64. The floor shows how far BF16 rounding flips alone move each tensor, and
it raises that tensor's bound: a tensor fails when its rel exceeds both --tol and its floor. A
backend whose FP32 sums run in another order (the CUDA GEMMs split K and order the products
differently from the CPU's) flips other roundings than the CPU does and lands anywhere within the
floor; a different computation lands far above it.
"""
import argparse
import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from deepseek_mini import Reference, read_safetensors, set_rounding_jitter  # noqa: E402


def rel(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    nb = b.norm().item()
    return (a - b).norm().item() / nb if nb > 0 else (a - b).norm().item()


def max_rel(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    mb = b.abs().max().item() if b.numel() else 0.0
    d = (a - b).abs().max().item() if b.numel() else 0.0
    return d / mb if mb > 0 else d


def calc_diff(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    den = (a * a + b * b).sum().item()
    return 1 - 2 * (a * b).sum().item() / den if den > 0 else 0.0


def row(name, ours, ref):
    """(name, ours, ref) as float64 tensors of one shape."""
    ours = ours.detach().double()
    return (name, ours, ref.detach().double().reshape(ours.shape))


def metrics(ours, ref):
    """(rel, calc_diff, max); 0 for two zero tensors (an expert no token was routed to)."""
    if ref.norm() == 0 and ours.norm() == 0:
        return 0.0, 0.0, 0.0
    return rel(ours, ref), calc_diff(ours, ref), max_rel(ours, ref)


def end_to_end(a, cfg, weights, batch, ours):
    ref = Reference(cfg, weights, bf16=a.bf16)
    logits, losses = ref.forward(batch["tokens"], batch["targets"])
    losses["total"].backward()
    rows = [row("logits", ours["logits"], logits)]
    for i, k in enumerate(["total", "main", "mtp", "balance"]):
        rows.append(row(f"loss.{k}", ours["losses"][i:i + 1], losses[k].reshape(1)))
    for name, w in ref.w.items():
        if w.requires_grad:
            rows.append(row("grad." + name, ours["grad." + name], w.grad if w.grad is not None else torch.zeros_like(w)))
    return rows, f"loss ours {ours['losses'][0].item():.8f} ref {losses['total'].item():.8f}"


def teacher_forced(a, cfg, weights, batch, ours, subs):
    """Per sublayer i (in execution order): its y (+ loss or balance loss), its dx, then the
    gradients of the parameters only it uses; then the shared parameters (sum of contributions) and
    any parameter no sublayer used (a routed expert that got no token: its gradient must be 0)."""
    B, S = batch["tokens"].shape
    T, L = B * S, cfg["num_hidden_layers"]
    tgt = batch["targets"].reshape(T)
    pos = torch.arange(S)
    ref = Reference(cfg, weights, bf16=a.bf16)
    grads = {}    # parameter name -> summed teacher-forced gradient
    owners = {}   # parameter name -> the sublayers contributing
    per_sub = {}  # sublayer -> its output and dx rows
    names = sorted({(int(m.group(1)), m.group(2)) for m in (re.match(r"sub\.(\d+)\.(.+)\.[a-z]+$", k) for k in subs)})
    for i, layer in names:
        pre = f"sub.{i}.{layer}."
        x = subs[pre + "x"].double().requires_grad_()
        for w in ref.w.values():
            w.grad = None
        extra = {}  # scalar outputs compared with the dump: name -> (ours, ref)
        m = re.match(r"layers\.(\d+)\.(attn|mlp|moe|eh|shared_head)$", layer)
        if layer == "head" or (m and m.group(2) == "shared_head"):
            mtp = layer != "head"
            norm = f"model.layers.{L}.shared_head.norm.weight" if mtp else "model.norm.weight"
            y, loss = ref.head(x, norm, ref.mtp_targets(tgt, S)[1] if mtp else tgt)
            extra["loss"] = (subs[pre + "loss"], loss)
            # The dump's head gradients are of the weighted loss (grad_scale 1).
            (loss * (cfg.get("mtp_loss_weight", 0.0) if mtp else 1.0)).backward()
        else:
            kind, p = m.group(2), f"model.layers.{m.group(1)}."
            losses = {"balance": torch.zeros((), dtype=torch.float64)}
            if kind == "attn":
                y = ref.attention(p, x, B, S, pos)
            elif kind == "mlp":
                y = ref.dense(p, x)
            elif kind == "moe":
                y, _ = ref.moe(p, x, B, S, losses)
                extra["aux"] = (subs[pre + "aux"], losses["balance"])
            else:
                y = ref.eh(x, ref.mtp_targets(tgt, S)[0])
            outs, dys = [y], [subs[pre + "dy"].double()]
            if losses["balance"].requires_grad:  # the MoE layer's own loss (gradient scale 1)
                outs.append(losses["balance"])
                dys.append(torch.ones((), dtype=torch.float64))
            torch.autograd.backward(outs, dys)
        rows = per_sub[f"sub.{i}"] = [row(pre + "y", subs[pre + "y"], y)]
        rows += [row(pre + k, o, r.reshape(1)) for k, (o, r) in extra.items()]
        rows.append(row(pre + "dx", subs[pre + "dx"], x.grad))
        for name, w in ref.w.items():
            if w.grad is not None and w.requires_grad:
                grads[name] = grads.get(name, 0) + w.grad
                owners.setdefault(name, []).append(f"sub.{i}")
    # The embedding lookup's backward: the first sublayer's input gradient scattered over the tokens.
    emb = "model.embed_tokens.weight"
    dx0 = subs[f"sub.{names[0][0]}.{names[0][1]}.dx"].double()
    grads[emb] = grads.get(emb, 0) + torch.zeros_like(ref.w[emb]).index_add(0, batch["tokens"].reshape(T).long(), dx0)
    owners.setdefault(emb, []).insert(0, "embedding")
    shared, unused = [], []
    for name, w in ref.w.items():
        if not w.requires_grad:
            continue
        own = owners.get(name, [])
        if not own:
            unused.append(row(f"unused.grad.{name}", ours["grad." + name], torch.zeros_like(w)))
        elif len(own) == 1:
            per_sub[own[0]].append(row(f"{own[0]}.grad.{name}", ours["grad." + name], grads[name]))
        else:
            shared.append(row(f"shared({'+'.join(own)}).grad.{name}", ours["grad." + name], grads[name]))
    return [r for rows in per_sub.values() for r in rows] + shared + unused, f"{len(names)} sublayers"


def noise_floor(run, rows, n, jitter):
    """Largest rel distance per tensor of n reruns with rounding jitter from the plain reference."""
    floor = {name: 0.0 for name, _, _ in rows}
    ref = {name: r for name, _, r in rows}
    for k in range(n):
        set_rounding_jitter(jitter, seed=k)
        for name, _, r in run()[0]:
            floor[name] = max(floor[name], rel(r, ref[name]))
    set_rounding_jitter(0.0)
    return floor


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dump")
    ap.add_argument("config")
    ap.add_argument("--weights", default=None, help="folder with weights.safetensors (default: DUMP)")
    ap.add_argument("--tol", type=float, default=1e-3)
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--bf16", action="store_true", help="model the bf16 recipe's BF16 GEMM operands")
    ap.add_argument("--teacher-forced", action="store_true",
                    help="per sublayer on the dumped inputs and output gradients (dump with --dump-sublayers)")
    ap.add_argument("--noise-floor", type=int, default=0, metavar="N",
                    help="with --bf16: N reruns with jitter before every BF16 rounding")
    ap.add_argument("--jitter", type=float, default=2.0 ** -20,
                    help="relative size of the --noise-floor jitter (default 2^-20: 16 FP32 units of roundoff)")
    a = ap.parse_args()
    if a.noise_floor and not a.bf16:
        ap.error("--noise-floor needs --bf16 (the fp32 reference has no rounding points)")
    cfg = json.load(open(a.config))
    weights = read_safetensors(os.path.join(a.weights or a.dump, "weights.safetensors"))
    batch = read_safetensors(os.path.join(a.dump, "batch.safetensors"))
    ours = read_safetensors(os.path.join(a.dump, "outputs.safetensors"))
    if a.teacher_forced:
        subs = read_safetensors(os.path.join(a.dump, "sublayers.safetensors"))
        run = lambda: teacher_forced(a, cfg, weights, batch, ours, subs)  # noqa: E731
    else:
        run = lambda: end_to_end(a, cfg, weights, batch, ours)  # noqa: E731
    tensors, note = run()
    floor = noise_floor(run, tensors, a.noise_floor, a.jitter) if a.noise_floor else None
    rows = [(name,) + metrics(o, r) for name, o, r in tensors]
    bound = {n: max(a.tol, floor[n]) if floor else a.tol for n, _, _ in tensors}
    bad = [r for r in rows if r[1] > bound[r[0]]]
    over = "  <-- over tol and floor" if floor else "  <-- over tol"
    for n, r, d, m in rows:
        fl = f"  floor {floor[n]:.3e}" if floor else ""
        print(f"{n:72s} rel {r:.3e}  calc_diff {d:.3e}  max {m:.3e}{fl}{over if r > bound[n] else ''}")
    worst = max(rows, key=lambda r: r[1])
    mode = "teacher-forced" if a.teacher_forced else "end to end"
    if a.teacher_forced:
        kinds = {"output": lambda n: not n.endswith(".dx") and ".grad." not in n,
                 "dx": lambda n: n.endswith(".dx"), "param grad": lambda n: ".grad." in n}
        parts = []
        for k, f in kinds.items():
            w = max((r for r in rows if f(r[0])), key=lambda r: r[1])
            parts.append(f"{k} {w[1]:.3e} ({w[0]}{f', floor {floor[w[0]]:.3e}' if floor else ''})")
        print("worst per kind: " + "; ".join(parts))
    # Above the floor and above FP32-level differences (the fp32 recipe agrees to ~1e-6).
    above = f", {sum(r[1] > max(floor[r[0]], 1e-5) for r in rows)} above their noise floor" if floor else ""
    print(f"{a.dump} ({mode}{', bf16 reference' if a.bf16 else ''}): {len(rows)} tensors, "
          f"worst rel error {worst[1]:.3e} ({worst[0]}), {note}; {sum(r[1] > a.tol for r in rows)} over tol {a.tol}{above}"
          f"{f', {len(bad)} over both' if floor else ''}")
    if bad and not a.report_only:
        sys.exit(1)


if __name__ == "__main__":
    main()
