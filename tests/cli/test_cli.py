#!/usr/bin/env python3
"""The fp8moe command as a user meets it: every bad input is refused with a message naming what is
wrong and the documented exit code (2 usage or bad input, 3 I/O failure, 130 interrupted), and
every file that existed before a refused command is byte-identical after it (checked by hash).

    python3 tests/cli/test_cli.py --bin build/bin/fp8moe [unittest options]

ctest runs it (tests/cli/CMakeLists.txt). It trains the tiny config for a few steps on the CPU on a
corpus it writes itself, so it needs neither a GPU nor the default corpus.
"""
import argparse
import hashlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import unittest

from cli_testing import write_corpus

BIN = None
SOURCE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The shortest real training run: one step of one sequence of 32 tokens, one validation batch (so
# that a command a missing guard lets through ends soon, and fails its test).
FAST = ["-c", "tiny", "--backend", "cpu", "--steps", "1", "--batch-size", "1", "--seq-len", "32", "--eval-batches",
        "1", "--eval-every", "1000"]
BAD_INPUT, IO_FAILURE, INTERRUPTED = 2, 3, 130


def last_wins(args):
    """args with an option of FAST given again later (the command refuses repeated options) kept
    only there."""
    args, out = list(args), []
    i = 0
    while i < len(args):
        if args[i] in FAST[::2] and args[i] in args[i + 2:]:
            i += 2
            continue
        out.append(args[i])
        i += 1
    return out


def fp8moe(*args, cwd=None, timeout=600):
    p = subprocess.run([BIN, *last_wins(args)], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def hashes(root):
    """{path relative to root: sha256} of every file below root."""
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def safetensors_metadata(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)).get("__metadata__", {})


class Cli(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.root = tempfile.mkdtemp(prefix="fp8moe_cli_")
        cls.data = os.path.join(cls.root, "data")
        os.makedirs(cls.data)
        write_corpus(os.path.join(cls.data, "corpus.txt"))
        with open(os.path.join(cls.data, "index.dat"), "wb") as f:
            f.write(b"\x00\x01binary")
        # The earlier run that the refused commands must leave alone.
        cls.run_dir = os.path.join(cls.root, "run")
        cls.first = fp8moe("train", *FAST, "--steps", "2", "--data", cls.data, "-o", cls.run_dir)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.root, ignore_errors=True)

    def setUp(self):
        self.assertEqual(self.first[0], 0, self.first)

    def refused(self, code, needle, *args, cwd=None):
        """Runs fp8moe with args, expects exit `code`, one stderr line containing `needle`, and every
        file under the scratch folder as it was (none changed, none added)."""
        before = hashes(self.root)
        rc, out, err = fp8moe(*args, cwd=cwd)
        self.assertEqual(rc, code, f"fp8moe {' '.join(args)}\nstdout: {out}\nstderr: {err}")
        self.assertIn(needle, err)
        self.assertEqual(len(err.strip().splitlines()), 1, err)
        self.assertEqual(hashes(self.root), before, f"fp8moe {' '.join(args)} changed files")
        return err

    def test_first_run_notes_the_skipped_binary_file(self):
        self.assertIn("skipped 1 file(s) that are not UTF-8 text", self.first[1])
        self.assertIn("index.dat", self.first[1])
        self.assertIn("done: step 2 of 2, train loss", self.first[1])

    def test_an_existing_run_is_not_overwritten(self):
        self.refused(BAD_INPUT, "already holds a run (metrics.jsonl, checkpoint.safetensors): --resume continues it, "
                     "--overwrite replaces it", "train", *FAST, "--steps", "2", "--data", self.data, "-o", self.run_dir)
        self.refused(BAD_INPUT, "--resume continues the run in --out and --overwrite replaces it: give one", "train",
                     *FAST, "--resume", "--overwrite", "-o", self.run_dir)

    def test_zero_and_negative_counts_are_refused_before_any_file_is_touched(self):
        for flag, value, needle in [
            ("--eval-every", "0", "--eval-every (eval_every) = 0 is out of range: must be >= 1"),
            ("--log-every", "0", "--log-every (log_every) = 0 is out of range: must be >= 1"),
            ("--eval-batches", "0", "--eval-batches (eval_batches) = 0 is out of range: must be >= 1"),
            ("--batch-size", "-1", "--batch-size (batch_size) = -1 is out of range: must be >= 1 (or 0: the config's)"),
            ("--seq-len", "-5", "--seq-len (seq_len) = -5 is out of range"),
            ("--steps", "0", "--steps (steps) = 0 is out of range: must be >= 1"),
            ("--grad-accum", "0", "--grad-accum (grad_accum) = 0 is out of range"),
            ("--ema-every", "0", "--ema-every (ema_every) = 0 is out of range"),
            ("--stop-at", "-1", "--stop-at (stop_at) = -1 is out of range"),
            ("--lr", "nan", "--lr (lr) = nan is out of range: must be finite and > 0"),
            ("--lr", "inf", "--lr (lr) = inf is out of range"),
            ("--weight-decay", "-0.1", "--weight-decay (weight_decay) = -0.1 is out of range"),
            ("--ema-decay", "nan", "--ema-decay (ema_decay) = nan is out of range: must be in [0, 1]"),
            ("--ema-decay", "1.5", "--ema-decay (ema_decay) = 1.5 is out of range"),
            ("--warmup", "2", "--warmup (warmup_frac) = 2 is out of range: must be in [0, 1]"),
            ("--clip", "nan", "--clip (clip) = nan is out of range"),
            ("--moments", "f16", "--moments (moments) = 'f16' is not one of bf16, f32"),
            ("--recipe", "fp4", "unknown recipe 'fp4'"),
            ("--attention", "fp8", "unknown attention precision 'fp8'"),
        ]:
            with self.subTest(flag=flag, value=value):
                # With --overwrite, so that nothing but the validation stands between the option and
                # the earlier run's files.
                self.refused(BAD_INPUT, needle, "train", *FAST, "--data", self.data, "-o", self.run_dir, "--overwrite",
                             flag, value)

    def test_usage_errors(self):
        self.refused(BAD_INPUT, "usage error: The following argument was not expected: --no-such-option",
                     "train", "--no-such-option")
        self.refused(BAD_INPUT, "usage error:", "train", "--steps", "many")
        self.refused(BAD_INPUT, "usage error: A subcommand is required")
        self.refused(BAD_INPUT, "usage error: --tokens: Value -5 not in range", "model", "-c", "tiny", "--tokens", "-5")

    def test_output_folders_that_cannot_be_made(self):
        a_file = os.path.join(self.data, "corpus.txt")
        self.refused(BAD_INPUT, "--out '" + a_file + "' is a file, not a folder", "train", *FAST, "--data", self.data,
                     "-o", a_file)
        self.refused(IO_FAILURE, "I/O error: train: cannot create the output folder '" + a_file + "/run'", "train",
                     *FAST, "--data", self.data, "-o", os.path.join(a_file, "run"))
        checkpoint = os.path.join(self.run_dir, "checkpoint.safetensors")
        self.refused(IO_FAILURE, "I/O error: export: cannot create the output folder", "export", checkpoint, "-o",
                     os.path.join(a_file, "hf"))
        read_only = "/sys/fp8moe_cli_test"  # sysfs refuses new folders, even to root
        if not os.path.exists(read_only):
            self.refused(IO_FAILURE, "cannot create the output folder '" + read_only + "/run'", "train", *FAST,
                         "--data", self.data, "-o", read_only + "/run")
            self.refused(IO_FAILURE, "cannot create the output folder '" + read_only + "/hf'", "export", checkpoint,
                         "-o", read_only + "/hf")

    def write_config(self, name, change):
        with open(os.path.join(SOURCE_DIR, "configs", "tiny.json")) as f:
            cfg = json.load(f)
        change(cfg)
        path = os.path.join(self.root, "configs", name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(cfg, f)
        return path

    def test_bad_configs_are_refused_naming_the_key(self):
        def rename(old, new):
            def change(c):
                c[new] = c.pop(old)
            return change

        def set_(key, value):
            def change(c):
                c[key] = value
            return change

        def remove(key):
            return lambda c: c.pop(key)

        cases = [
            ("misspelled.json", rename("hidden_size", "hiden_size"), "unknown key 'hiden_size' (did you mean 'hidden_size'?)"),
            ("empty.json", lambda c: c.clear(), "missing required keys vocab_size, hidden_size, num_hidden_layers"),
            ("missing.json", remove("kv_lora_rank"), "missing required key kv_lora_rank"),
            ("fraction.json", set_("hidden_size", 128.5), "key 'hidden_size' has the wrong type: expected an integer, got 128.5"),
            ("string.json", set_("n_routed_experts", "8"), "key 'n_routed_experts' has the wrong type: expected an integer"),
            ("zero.json", set_("num_hidden_layers", 0), "num_hidden_layers = 0 must be in [1, 16777216]"),
            ("negative.json", set_("n_shared_experts", -1), "n_shared_experts = -1 must be >= 0"),
            ("heads.json", set_("num_attention_heads", 3), "num_attention_heads = 3 does not divide hidden_size = 128"),
            ("topk.json", set_("num_experts_per_tok", 9), "num_experts_per_tok = 9 exceeds n_routed_experts = 8"),
            ("scoring.json", set_("scoring_func", "softmax"), "key 'scoring_func' = \"softmax\" is not supported"),
            ("kvheads.json", set_("num_key_value_heads", 1), "num_key_value_heads = 1 must equal num_attention_heads = 2"),
            ("eps.json", set_("rms_norm_eps", -1e-6), "rms_norm_eps = -1e-06 must be positive"),
        ]
        for name, change, needle in cases:
            with self.subTest(config=name):
                path = self.write_config(name, change)
                self.refused(BAD_INPUT, needle, "train", *FAST, "-c", path, "--data", self.data, "-o",
                             os.path.join(self.root, "new"))
                self.refused(BAD_INPUT, needle, "model", "-c", path)
        with open(os.path.join(self.root, "configs", "list.json"), "w") as f:
            f.write("[1, 2]")
        self.refused(BAD_INPUT, "expected a JSON object at the top level", "model", "-c",
                     os.path.join(self.root, "configs", "list.json"))
        self.refused(BAD_INPUT, "'tin' is neither a file nor the name of a shipped config", "model", "-c", "tin")
        self.refused(BAD_INPUT, "did you mean 'tiny'?", "model", "-c", "tin")

    def test_configs_by_name_from_any_folder(self):
        rc, out, err = fp8moe("model", "-c", "tiny", "--json", cwd="/")
        self.assertEqual(rc, 0, err)
        self.assertEqual(json.loads(out)["config"], "tiny")
        rc, out, err = fp8moe("model", "-c", "deepseek-v3.json", "--json", cwd="/")
        self.assertEqual(rc, 0, err)
        self.assertEqual(json.loads(out)["config"], "deepseek-v3")

    def test_model_itemizes_memory_per_layer_kind(self):
        """`model` itemizes the memory account per layer kind and tensor, bytes per token: the
        printed rows add up to each kind's total, and the kinds' totals to predict_memory's
        (the per-layer bytes of --json), in the text and in the JSON."""
        rc, out, err = fp8moe("model", "-c", "deepseek-v3", "--json")
        self.assertEqual(rc, 0, err)
        j = json.loads(out)
        tokens, it = j["tokens"], j["itemized"]
        self.assertEqual(it["recipes"], ["bf16", "fp8"])
        kinds = {k["kind"]: k for k in it["kinds"]}
        self.assertEqual(sorted(kinds), ["MTP module", "MoE layer", "dense layer"])
        self.assertEqual(kinds["dense layer"]["layers"], [0, 1, 2])
        self.assertEqual(len(kinds["MoE layer"]["layers"]), 58)
        self.assertEqual(kinds["MTP module"]["layers"], [61])
        for r in it["recipes"]:
            per_layer = j["saved_bytes"][r]
            self.assertEqual(it["total_bytes"][r], sum(per_layer.values()), r)
            for k in it["kinds"]:
                layer_bytes = sum(v for name, v in per_layer.items() if int(name.split(".")[1]) in k["layers"])
                self.assertAlmostEqual(k["bytes_per_token"][r] * len(k["layers"]) * tokens, layer_bytes,
                                       delta=1e-9 * layer_bytes, msg=r + " " + k["kind"])
                self.assertAlmostEqual(sum(t["bytes_per_token"][r] for t in k["tensors"]), k["bytes_per_token"][r],
                                       delta=1e-9 * k["bytes_per_token"][r], msg=r + " " + k["kind"])
        # The report's choices in the rows: the attention-out cache at 0.75 of BF16, sublayer inputs
        # and the MTP's trunk output in BF16, no RMSNorm output.
        moe = {t["tensor"]: t for t in kinds["MoE layer"]["tensors"]}
        self.assertEqual(moe["attn.attn_out"]["dtype"]["fp8"], "e5m6")
        self.assertEqual(moe["attn.attn_out"]["bytes_per_token"]["fp8"],
                         0.75 * moe["attn.attn_out"]["bytes_per_token"]["bf16"])
        for name in ("attn.x", "moe.x"):
            self.assertEqual(moe[name]["dtype"]["fp8"], "bf16")
        mtp = {t["tensor"]: t for t in kinds["MTP module"]["tensors"]}
        self.assertEqual(mtp["eh.h"]["dtype"]["fp8"], "bf16")
        self.assertFalse([t for k in it["kinds"] for t in k["tensors"] if "norm" in t["tensor"]])

        # The text: each kind's rows and total line, and the totals over all layers, as the JSON has them.
        rc, text, err = fp8moe("model", "-c", "deepseek-v3")
        self.assertEqual(rc, 0, err)
        lines = text.splitlines()
        for k in it["kinds"]:
            head = [i for i, l in enumerate(lines) if l.startswith(k["kind"] + " (")]
            self.assertEqual(len(head), 1, k["kind"])
            rows, i = {}, head[0] + 1
            while lines[i].startswith("  "):
                f = lines[i].split()
                rows[f[0]] = f
                i += 1
            self.assertEqual(sorted(rows), sorted([t["tensor"] for t in k["tensors"]] + ["total"]), k["kind"])
            for c, r in enumerate(it["recipes"]):
                for t in k["tensors"]:
                    self.assertAlmostEqual(float(rows[t["tensor"]][1 + 2 * c]), t["bytes_per_token"][r], delta=0.005)
                self.assertAlmostEqual(float(rows["total"][1 + c]), k["bytes_per_token"][r], delta=0.005)
        self.assertIn("embedding, head                    nothing kept", text)
        totals = [l for l in lines if l.startswith("all layers, bytes") and "per token" not in l]
        self.assertEqual(len(totals), 1)
        self.assertEqual([int(v) for v in totals[0].split()[3:]], [it["total_bytes"][r] for r in it["recipes"]])
        # Other recipes on request, none with an empty list.
        rc, out, err = fp8moe("model", "-c", "tiny", "--itemize", "fp32,fp8", "--json")
        self.assertEqual(rc, 0, err)
        self.assertEqual(json.loads(out)["itemized"]["recipes"], ["fp32", "fp8"])
        rc, out, err = fp8moe("model", "-c", "tiny", "--itemize", "")
        self.assertEqual(rc, 0, err)
        self.assertNotIn("activation memory kept for backward, bytes per token", out)
        self.refused(BAD_INPUT, "fp9", "model", "-c", "tiny", "--itemize", "bf16,fp9")

    def test_bad_data_is_refused(self):
        utf16 = os.path.join(self.root, "utf16.txt")
        with open(utf16, "wb") as f:
            f.write("hello world\n".encode("utf-16"))
        binary = os.path.join(self.root, "blob.bin")
        with open(binary, "wb") as f:
            f.write(bytes(range(256)) * 1000)
        self.refused(BAD_INPUT, "is UTF-16 text (byte order mark)", "train", *FAST, "--data", utf16, "-o",
                     os.path.join(self.root, "new"))
        self.refused(BAD_INPUT, "holds a NUL byte at offset 0", "train", *FAST, "--data", binary, "-o",
                     os.path.join(self.root, "new"))
        self.refused(BAD_INPUT, "does not exist", "train", *FAST, "--data", os.path.join(self.root, "none"), "-o",
                     os.path.join(self.root, "new"))
        os.remove(utf16)
        os.remove(binary)

    def test_resume_is_checked_against_the_checkpoint(self):
        missing = os.path.join(self.root, "missing")
        self.refused(BAD_INPUT, "--resume: no checkpoint to continue from", "train", *FAST, "--resume", "-o", missing)
        self.assertFalse(os.path.exists(missing))
        self.refused(BAD_INPUT, "already reached step 2 of --steps 2; give a larger --steps to continue it", "train",
                     *FAST, "--steps", "2", "--data", self.data, "--resume", "-o", self.run_dir)
        self.refused(BAD_INPUT, "--resume: --batch-size 2 differs from the 1 the run was trained with", "train",
                     "-c", "tiny", "--backend", "cpu", "--batch-size", "2", "--steps", "3", "--data", self.data,
                     "--resume", "-o", self.run_dir)
        self.refused(BAD_INPUT, "--resume: --seq-len 64 differs from the 32 the run was trained with", "train",
                     "-c", "tiny", "--backend", "cpu", "--seq-len", "64", "--steps", "3", "--data", self.data,
                     "--resume", "-o", self.run_dir)
        self.refused(BAD_INPUT, "--seed 7 differs from the 1234 the run was trained with", "train", *FAST, "--seed",
                     "7", "--steps", "3", "--data", self.data, "--resume", "-o", self.run_dir)
        self.refused(BAD_INPUT, "checkpoint was trained with recipe 'fp8', this run asks for 'bf16'", "train", *FAST,
                     "-r", "bf16", "--steps", "3", "--data", self.data, "--resume", "-o", self.run_dir)
        self.refused(BAD_INPUT, "--resume: the config's hidden_size = 256 differs from the 128 the run was trained with",
                     "train", *FAST, "-c", self.write_config("wider.json", lambda c: c.update(hidden_size=256)),
                     "--steps", "3", "--data", self.data, "--resume", "-o", self.run_dir)

    def test_interrupted_run_saves_exits_130_and_resumes_with_its_batch_shape(self):
        out_dir = os.path.join(self.root, "interrupted")
        p = subprocess.Popen([BIN, *last_wins(["train", *FAST, "--steps", "1000", "--log-every", "1", "--data", self.data,
                                                "-o", out_dir])], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines = []
        for line in p.stdout:
            lines.append(line)
            if line.startswith("step "):
                p.send_signal(signal.SIGINT)
                break
        rest, err = p.communicate(timeout=300)
        out = "".join(lines) + rest
        self.assertEqual(p.returncode, INTERRUPTED, out + err)
        self.assertRegex(err.strip(), r"^fp8moe: interrupted at step [0-9]+: checkpoint written to .*checkpoint"
                         r"\.safetensors; --resume continues the run$")
        summary = out.strip().splitlines()[-1]
        self.assertRegex(summary, r"^interrupted: step [0-9]+ of 1000, train loss [0-9.]+, [0-9]+ tokens/s$")
        self.assertNotIn("validation loss", summary)  # none was measured
        step = int(summary.split()[2])
        # Resumed without --batch-size and --seq-len: the checkpoint's (1, 32), not the config's.
        rc, out, err = fp8moe("train", "-c", "tiny", "--backend", "cpu", "--eval-batches", "1", "--steps",
                              str(step + 1), "--data", self.data, "--resume", "-o", out_dir)
        self.assertEqual(rc, 0, out + err)
        self.assertIn(f"done: step {step + 1} of {step + 1} (1 in this run), train loss", out)
        meta = safetensors_metadata(os.path.join(out_dir, "checkpoint.safetensors"))
        cfg = json.loads(meta["model_config"])
        self.assertEqual((cfg["batch_size"], cfg["seq_len"]), (1, 32))
        with open(os.path.join(out_dir, "metrics.jsonl")) as f:
            self.assertEqual([json.loads(l)["step"] for l in f], list(range(step + 1)))

    def test_export_refuses_bad_input_and_an_existing_export(self):
        checkpoint = os.path.join(self.run_dir, "checkpoint.safetensors")
        hf = os.path.join(self.root, "hf")
        self.refused(BAD_INPUT, "unknown format 'int4'", "export", checkpoint, "-o", hf, "--format", "int4")
        self.refused(BAD_INPUT, "corrupt safetensors file", "export", os.path.join(self.data, "corpus.txt"), "-o", hf)
        rc, out, err = fp8moe("export", checkpoint, "-o", hf)
        self.assertEqual(rc, 0, err)
        self.assertEqual(sorted(os.listdir(hf)),
                         ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"])
        self.refused(BAD_INPUT, "already holds an export (model.safetensors): --overwrite replaces it", "export",
                     checkpoint, "-o", hf)
        rc, out, err = fp8moe("export", checkpoint, "-o", hf, "--overwrite", "--format", "bf16")
        self.assertEqual(rc, 0, err)
        # The exported config.json is a model config fp8moe itself accepts.
        rc, out, err = fp8moe("model", "-c", os.path.join(hf, "config.json"), "--json")
        self.assertEqual(rc, 0, err)
        shutil.rmtree(hf)

    def test_overwrite_replaces_the_run(self):
        run = os.path.join(self.root, "replaced")
        shutil.copytree(self.run_dir, run)
        with open(os.path.join(run, "metrics.jsonl")) as f:
            old = f.read()
        rc, out, err = fp8moe("train", *FAST, "--steps", "1", "--ckpt-every", "0", "--data", self.data, "-o", run,
                              "--overwrite", "-q")
        self.assertEqual(rc, 0, err)
        with open(os.path.join(run, "metrics.jsonl")) as f:
            new = f.read()
        self.assertNotEqual(new, old)
        self.assertEqual(len(new.splitlines()), 1)
        # Without a checkpoint of its own, the replaced run's is gone rather than left beside new metrics.
        self.assertFalse(os.path.exists(os.path.join(run, "checkpoint.safetensors")))
        self.assertEqual(sorted(os.listdir(run)), ["metrics.jsonl"])

    def test_compare_checks_every_run_folder_before_training(self):
        out = os.path.join(self.root, "cmp")
        shutil.copytree(self.run_dir, os.path.join(out, "fp8"))
        self.refused(BAD_INPUT, "--out '" + os.path.join(out, "fp8") + "' already holds a run", "compare", *FAST,
                     "--steps", "2", "--data", self.data, "-o", out)
        self.assertFalse(os.path.exists(os.path.join(out, "bf16")))
        self.refused(BAD_INPUT, "--eval-every (eval_every) = 0", "compare", *FAST, "--data", self.data, "-o", out,
                     "--eval-every", "0")
        shutil.rmtree(out)

    def test_help_documents_the_exit_codes(self):
        rc, out, err = fp8moe("--help")
        self.assertEqual(rc, 0)
        self.assertIn("Exit codes: 0 success, 1 internal error, 2 usage error or bad input", out)
        self.assertIn("3 I/O failure", out)
        self.assertIn("130 interrupted", out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin", required=True)
    args, rest = parser.parse_known_args()
    BIN = os.path.abspath(args.bin)
    unittest.main(argv=[sys.argv[0], *rest], verbosity=2)
