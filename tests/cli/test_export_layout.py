#!/usr/bin/env python3
"""`fp8moe export` against DeepSeek-V3's released layout: a tiny model trained for one step is
exported, and the folder is read back with Hugging Face's `safetensors` package; every tensor's
name, shape and dtype must be the one DeepSeek-V3's own checkpoint has for that name, scaled to the
mini model's config (the table below, itself checked against DeepSeek-V3's real shapes), and
config.json must carry the keys of DeepSeek-V3's config.json. Where `tokenizers` and
`transformers` are installed, they must load the tokenizer and the config.

    python3 tests/cli/test_export_layout.py --bin build/bin/fp8moe [--python-path build/python]

Exits 77 (skipped for ctest) when `safetensors` cannot be imported; scripts/setup.sh installs it
into build/python with pip.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

from cli_testing import write_corpus

BIN = None
SOURCE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SKIPPED = 77


def ceil128(n):
    return (n + 127) // 128


def deepseek_v3_layout(c, fmt="fp8"):
    """{name: (shape, dtype)} of every tensor of DeepSeek-V3's Hugging Face checkpoint for config c
    (a dict with the keys of its config.json), and the names that only the released checkpoint has
    (the MTP layer's copies of the embedding and the head, which the mini model shares)."""
    D, H, V = c["hidden_size"], c["num_attention_heads"], c["vocab_size"]
    nope, rope, vdim = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    q_lora, kv_lora = c.get("q_lora_rank") or 0, c["kv_lora_rank"]
    layout, shared_copies = {}, set()

    def bf16(name, *shape):
        layout[name] = (list(shape), "BF16")

    def linear(name, out_features, in_features):
        # E4M3 with one F32 scale per 128x128 block in the released weights.
        if fmt == "fp8":
            layout[name + ".weight"] = ([out_features, in_features], "F8_E4M3")
            layout[name + ".weight_scale_inv"] = ([ceil128(out_features), ceil128(in_features)], "F32")
        else:
            bf16(name + ".weight", out_features, in_features)

    def mlp(prefix, hidden):
        linear(prefix + "gate_proj", hidden, D)
        linear(prefix + "up_proj", hidden, D)
        linear(prefix + "down_proj", D, hidden)

    bf16("model.embed_tokens.weight", V, D)
    L, mtp = c["num_hidden_layers"], c.get("num_nextn_predict_layers", 0)
    for layer in range(L + mtp):
        p = f"model.layers.{layer}."
        if layer >= L:  # the MTP module (its eh_proj is BF16 in DeepSeek-V3's checkpoint)
            for n in ("enorm", "hnorm", "shared_head.norm"):
                bf16(p + n + ".weight", D)
            bf16(p + "eh_proj.weight", D, 2 * D)
            bf16(p + "embed_tokens.weight", V, D)
            bf16(p + "shared_head.head.weight", V, D)
            shared_copies |= {p + "embed_tokens.weight", p + "shared_head.head.weight"}
        bf16(p + "input_layernorm.weight", D)
        bf16(p + "post_attention_layernorm.weight", D)
        a = p + "self_attn."
        if q_lora:
            linear(a + "q_a_proj", q_lora, D)
            bf16(a + "q_a_layernorm.weight", q_lora)
            linear(a + "q_b_proj", H * (nope + rope), q_lora)
        else:
            linear(a + "q_proj", H * (nope + rope), D)
        linear(a + "kv_a_proj_with_mqa", kv_lora + rope, D)
        bf16(a + "kv_a_layernorm.weight", kv_lora)
        linear(a + "kv_b_proj", H * (nope + vdim), kv_lora)
        linear(a + "o_proj", D, H * vdim)
        if layer >= c["first_k_dense_replace"] and c["n_routed_experts"] > 0:
            E = c["n_routed_experts"]
            bf16(p + "mlp.gate.weight", E, D)
            layout[p + "mlp.gate.e_score_correction_bias"] = ([E], "F32")
            if c["n_shared_experts"] > 0:
                mlp(p + "mlp.shared_experts.", c["n_shared_experts"] * c["moe_intermediate_size"])
            for e in range(E):
                mlp(p + f"mlp.experts.{e}.", c["moe_intermediate_size"])
        else:
            mlp(p + "mlp.", c["intermediate_size"])
    bf16("model.norm.weight", D)
    bf16("lm_head.weight", V, D)
    return layout, shared_copies


def read_layout(path):
    from safetensors import safe_open

    with safe_open(path, framework="numpy") as f:
        return {k: (list(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}


def run(*args):
    p = subprocess.run([BIN, *args], capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise AssertionError(f"fp8moe {' '.join(args)} exited {p.returncode}: {p.stderr}")


class ExportLayout(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.root = tempfile.mkdtemp(prefix="fp8moe_export_layout_")
        corpus = os.path.join(cls.root, "corpus.txt")
        write_corpus(corpus)
        run_dir = os.path.join(cls.root, "run")
        run("train", "-c", "tiny", "--backend", "cpu", "--steps", "1", "--batch-size", "1", "--seq-len", "32",
            "--eval-batches", "1", "--data", corpus, "-o", run_dir, "-q")
        cls.folders = {}
        for fmt in ("fp8", "bf16"):
            cls.folders[fmt] = os.path.join(cls.root, fmt)
            run("export", os.path.join(run_dir, "checkpoint.safetensors"), "-o", cls.folders[fmt], "--format", fmt)
        with open(os.path.join(SOURCE_DIR, "configs", "tiny.json")) as f:
            cls.tiny = json.load(f)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.root, ignore_errors=True)

    def test_the_table_is_deepseek_v3s_own_layout(self):
        with open(os.path.join(SOURCE_DIR, "configs", "deepseek-v3.json")) as f:
            v3, _ = deepseek_v3_layout(json.load(f))
        # Shapes and dtypes of DeepSeek-V3's released model.safetensors (671B, 61 layers + MTP).
        known = {
            "model.embed_tokens.weight": ([129280, 7168], "BF16"),
            "model.layers.0.self_attn.q_a_proj.weight": ([1536, 7168], "F8_E4M3"),
            "model.layers.0.self_attn.q_a_proj.weight_scale_inv": ([12, 56], "F32"),
            "model.layers.0.self_attn.q_b_proj.weight": ([24576, 1536], "F8_E4M3"),
            "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": ([576, 7168], "F8_E4M3"),
            "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv": ([5, 56], "F32"),
            "model.layers.0.self_attn.kv_a_layernorm.weight": ([512], "BF16"),
            "model.layers.0.self_attn.kv_b_proj.weight": ([32768, 512], "F8_E4M3"),
            "model.layers.0.self_attn.o_proj.weight": ([7168, 16384], "F8_E4M3"),
            "model.layers.0.mlp.gate_proj.weight": ([18432, 7168], "F8_E4M3"),
            "model.layers.0.mlp.down_proj.weight_scale_inv": ([56, 144], "F32"),
            "model.layers.3.mlp.gate.weight": ([256, 7168], "BF16"),
            "model.layers.3.mlp.gate.e_score_correction_bias": ([256], "F32"),
            "model.layers.3.mlp.shared_experts.up_proj.weight": ([2048, 7168], "F8_E4M3"),
            "model.layers.60.mlp.experts.255.down_proj.weight": ([7168, 2048], "F8_E4M3"),
            "model.layers.61.eh_proj.weight": ([7168, 14336], "BF16"),
            "model.layers.61.shared_head.head.weight": ([129280, 7168], "BF16"),
            "lm_head.weight": ([129280, 7168], "BF16"),
        }
        for name, want in known.items():
            self.assertEqual(v3[name], want, name)
        self.assertNotIn("model.layers.61.eh_proj.weight_scale_inv", v3)
        self.assertNotIn("model.layers.3.mlp.gate.weight_scale_inv", v3)

    def check_against_the_table(self, fmt):
        got = read_layout(os.path.join(self.folders[fmt], "model.safetensors"))
        want, shared_copies = deepseek_v3_layout(self.tiny, fmt)
        self.assertEqual(sorted(set(got) - set(want)), [], "tensors that DeepSeek-V3's checkpoint does not have")
        self.assertEqual(sorted(set(want) - set(got) - shared_copies), [], "DeepSeek-V3 tensors the export lacks")
        for name, (shape, dtype) in got.items():
            self.assertEqual((shape, dtype), want[name], name)
        return got

    def test_fp8_export_matches_the_layout(self):
        got = self.check_against_the_table("fp8")
        self.assertEqual(got["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"], ([160, 128], "F8_E4M3"))
        self.assertEqual(got["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"], ([2, 1], "F32"))

    def test_bf16_export_matches_the_layout(self):
        got = self.check_against_the_table("bf16")
        self.assertFalse(any(n.endswith("_scale_inv") for n in got))

    def test_config_json_has_deepseek_v3s_keys(self):
        for fmt, folder in self.folders.items():
            with open(os.path.join(folder, "config.json")) as f:
                cfg = json.load(f)
            with self.subTest(fmt=fmt):
                # The keys of DeepSeek-V3's own config.json that loaders read.
                for key in ["architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
                            "moe_intermediate_size", "num_hidden_layers", "num_nextn_predict_layers",
                            "num_attention_heads", "num_key_value_heads", "n_shared_experts", "n_routed_experts",
                            "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim",
                            "qk_nope_head_dim", "topk_method", "n_group", "topk_group", "num_experts_per_tok",
                            "moe_layer_freq", "first_k_dense_replace", "norm_topk_prob", "scoring_func",
                            "aux_loss_alpha", "seq_aux", "hidden_act", "max_position_embeddings", "initializer_range",
                            "rms_norm_eps", "use_cache", "tie_word_embeddings", "rope_theta", "rope_scaling",
                            "attention_bias", "attention_dropout", "torch_dtype", "bos_token_id", "eos_token_id",
                            "ep_size", "pretraining_tp"]:
                    self.assertIn(key, cfg)
                self.assertEqual(cfg["architectures"], ["DeepseekV3ForCausalLM"])
                self.assertEqual(cfg["model_type"], "deepseek_v3")
                self.assertEqual(cfg["hidden_act"], "silu")
                self.assertEqual(cfg["topk_method"], "noaux_tc")
                self.assertEqual(cfg["scoring_func"], "sigmoid")
                self.assertEqual(cfg["num_key_value_heads"], cfg["num_attention_heads"])
                self.assertFalse(cfg["tie_word_embeddings"])
                for key in ["hidden_size", "num_hidden_layers", "n_routed_experts", "kv_lora_rank", "vocab_size"]:
                    self.assertEqual(cfg[key], self.tiny[key], key)
        with open(os.path.join(self.folders["fp8"], "config.json")) as f:
            self.assertEqual(json.load(f)["quantization_config"],
                             {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                              "weight_block_size": [128, 128]})
        with open(os.path.join(self.folders["bf16"], "config.json")) as f:
            self.assertNotIn("quantization_config", json.load(f))

    def test_tokenizer_is_the_byte_vocabulary(self):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            self.skipTest("tokenizers is not installed")
        tok = Tokenizer.from_file(os.path.join(self.folders["fp8"], "tokenizer.json"))
        self.assertEqual(tok.get_vocab_size(), 256)
        text = "Héllo, wörld!\n\ttabs\x00 and \x7f bytes"
        ids = tok.encode(text).ids
        self.assertEqual(ids, list(text.encode("utf-8")))  # token id = byte value, as the trainer reads text
        self.assertEqual(tok.decode(ids), text)

    def test_transformers_loads_the_config_and_the_tokenizer(self):
        try:
            import transformers
        except ImportError:
            self.skipTest("transformers is not installed")
        folder = self.folders["fp8"]
        cfg = transformers.AutoConfig.from_pretrained(folder)
        self.assertEqual(cfg.model_type, "deepseek_v3")
        self.assertEqual(cfg.hidden_size, self.tiny["hidden_size"])
        self.assertEqual(cfg.n_routed_experts, self.tiny["n_routed_experts"])
        tok = transformers.AutoTokenizer.from_pretrained(folder)
        self.assertEqual(tok("fp8 moe\n")["input_ids"], list(b"fp8 moe\n"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin", required=True)
    parser.add_argument("--python-path", default="", help="a folder with the safetensors package (scripts/setup.sh)")
    args, rest = parser.parse_known_args()
    BIN = os.path.abspath(args.bin)
    if args.python_path:
        sys.path.insert(0, args.python_path)
    try:
        import safetensors  # noqa: F401
        import numpy  # noqa: F401
    except ImportError as e:
        print(f"test_export_layout: skipped: {e} (scripts/setup.sh installs safetensors with pip)")
        sys.exit(SKIPPED)
    unittest.main(argv=[sys.argv[0], *rest], verbosity=2)
