#!/usr/bin/env python3
"""The exported BF16 folder served by fp8moe against Hugging Face transformers' DeepseekV3ForCausalLM.

Trains a tiny model for a few steps (or takes --checkpoint), exports it as a BF16 Hugging Face
folder, and compares the next-token logits at every position of a prompt: fp8moe's engine with
FP32 Linears over the BF16 weights and an exact cache (`fp8moe generate --linear f32 --cache f32
--logits-out`) against transformers in FP32 on the same folder. Passes when calc_diff (1 - 2 sum xy
/ sum (x^2 + y^2)) < 1e-5 and the argmax agrees at every position. Exits 0 printing SKIPPED where
torch or transformers (with DeepSeek-V3) is missing.

Run: tests/serve/hf_compare.py --fp8moe build/bin/fp8moe [--checkpoint runs/x/checkpoint.safetensors]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

try:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers import DeepseekV3ForCausalLM  # noqa: F401  (present from transformers 4.55)
except Exception as e:  # noqa: BLE001 - any import failure means: not here
    print(f"SKIPPED: torch/transformers with DeepseekV3 not available ({e})")
    sys.exit(0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fp8moe", required=True)
    ap.add_argument("--config", default="configs/tiny.json")
    ap.add_argument("--checkpoint", default="")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompt", default="The quick brown fox jumps over the lazy dog. " * 3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.checkpoint
        if not ckpt:
            subprocess.run([args.fp8moe, "train", "-c", args.config, "--steps", str(args.steps), "-o",
                            os.path.join(tmp, "run"), "--quiet"], check=True)
            ckpt = os.path.join(tmp, "run", "checkpoint.safetensors")
        hf = os.path.join(tmp, "hf")
        subprocess.run([args.fp8moe, "export", ckpt, "-o", hf, "--format", "bf16"], check=True)
        out = os.path.join(tmp, "logits.json")
        subprocess.run([args.fp8moe, "generate", "--hf", hf, "--linear", "f32", "--cache", "f32", "--logits-out", out,
                        args.prompt], check=True)
        ours = torch.tensor(json.load(open(out))["logits"], dtype=torch.float64)
        model = AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.float32)
        model.eval()
        ids = torch.tensor([list(args.prompt.encode())])
        with torch.no_grad():
            theirs = model(ids).logits[0].double()
    diff = 1 - 2 * (ours * theirs).sum() / (ours * ours + theirs * theirs).sum()
    agree = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    print(f"{ours.shape[0]} positions: calc_diff {diff.item():.3e}, max |diff| {(ours - theirs).abs().max().item():.3e} "
          f"of max |logit| {theirs.abs().max().item():.3f}, argmax agreement {agree * 100:.1f}%")
    if not (diff.item() < 1e-5 and agree == 1.0):
        sys.exit("logits differ from transformers'")
    print("logits match transformers' DeepseekV3ForCausalLM")


if __name__ == "__main__":
    main()
