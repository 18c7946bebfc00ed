"""Compares one `fp8moe model --dump DIR` with the PyTorch reference (deepseek_mini.py).

  python3 tests/reference/compare.py DIR configs/tiny.json [--weights DIR_OF_WEIGHTS] [--tol 1e-3]

Relative error per tensor ||ours - ref|| / ||ref|| for the logits, the four losses and every
gradient, plus calc_diff = 1 - 2 sum(xy) / sum(x^2 + y^2). Fails (exit 1) when any relative error
exceeds --tol: the fp32 recipe against the exact reference, the bf16 recipe with --bf16 (the
reference then rounds every Linear's operands to BF16 as the recipe does); for fp8 dumps pass
--report-only (their distance is the FP8 recipe's error).
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from deepseek_mini import Reference, read_safetensors  # noqa: E402


def rel(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    nb = b.norm().item()
    return (a - b).norm().item() / nb if nb > 0 else (a - b).norm().item()


def calc_diff(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    den = (a * a + b * b).sum().item()
    return 1 - 2 * (a * b).sum().item() / den if den > 0 else 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dump")
    ap.add_argument("config")
    ap.add_argument("--weights", default=None, help="folder with weights.safetensors (default: DUMP)")
    ap.add_argument("--tol", type=float, default=1e-3)
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--bf16", action="store_true", help="model the bf16 recipe's BF16 GEMM operands")
    a = ap.parse_args()
    cfg = json.load(open(a.config))
    weights = read_safetensors(os.path.join(a.weights or a.dump, "weights.safetensors"))
    batch = read_safetensors(os.path.join(a.dump, "batch.safetensors"))
    ours = read_safetensors(os.path.join(a.dump, "outputs.safetensors"))
    ref = Reference(cfg, weights, bf16=a.bf16)
    logits, losses = ref.forward(batch["tokens"], batch["targets"])
    losses["total"].backward()
    rows = [("logits", rel(ours["logits"], logits.detach()), calc_diff(ours["logits"], logits.detach()))]
    for i, k in enumerate(["total", "main", "mtp", "balance"]):
        rows.append((f"loss.{k}", rel(ours["losses"][i:i + 1], losses[k].detach().reshape(1)), 0.0))
    for name, w in ref.w.items():
        if not w.requires_grad:
            continue
        g = w.grad if w.grad is not None else torch.zeros_like(w)
        if g.norm() == 0 and ours["grad." + name].double().norm() == 0:
            rows.append(("grad." + name, 0.0, 0.0))
            continue
        rows.append(("grad." + name, rel(ours["grad." + name], g), calc_diff(ours["grad." + name], g)))
    worst = max(rows, key=lambda r: r[1])
    bad = [r for r in rows if r[1] > a.tol]
    for n, r, d in rows:
        print(f"{n:60s} rel {r:.3e}  calc_diff {d:.3e}{'  <-- over tol' if r > a.tol else ''}")
    print(f"{a.dump}: {len(rows)} tensors, worst rel error {worst[1]:.3e} ({worst[0]}), "
          f"loss ours {ours['losses'][0].item():.8f} ref {losses['total'].item():.8f}; "
          f"{len(bad)} over tol {a.tol}")
    if bad and not a.report_only:
        sys.exit(1)


if __name__ == "__main__":
    main()
