"""A broad architecture matrix, not part of the suite: every key of modeltap's capture and dump,
each repeated call (`name@k`) included, against plain forward hooks, on tiny random models of as
many transformers families as build from a config in a few seconds.

    PYTHONPATH=src .venv/bin/python scripts/arch_zoo.py              # every family below
    PYTHONPATH=src .venv/bin/python scripts/arch_zoo.py llama t5     # some of them
    PYTHONPATH=src .venv/bin/python scripts/arch_zoo.py --compile    # also torch.compile
                                                                     # (aot_eager) where a module
                                                                     # runs several times
    PYTHONPATH=src .venv/bin/python scripts/arch_zoo.py --hash-seeds # which families call their
                                                                     # modules in hash order

Each family: a config with every size the config has set small (hidden 32, 2 layers, 4 heads),
`AutoModel.from_config`, seed 0, input_ids 2 x 7 (and decoder_input_ids for encoder-decoders).
The reference is a plain forward hook on every module, written here: `name` for its first call,
`name@k` for the k-th after it, `name:path` for the parts of a structured output, each cloned as
its module returns. modeltap's `capture` (deferred hooks) and `dumping.dump_model` (the dump's hooks
and writer) must hold exactly those values under exactly those keys. `--compile` compares the
compiled capture's repeated calls with the same reference (aot_eager: equal up to rounding).
`--hash-seeds` runs the references in two processes (PYTHONHASHSEED 0 and 1) and lists the
families whose calls come in another order: the `modeltap` command pins the seed for them.

A family that does not build or run here is listed as skipped with the reason (a dependency, a
config that wants other sizes), never counted as passed. Prints one line per family, then totals;
exits 1 when a key is missing or holds another value.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

SMALL: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "head_dim": 8,
    "max_position_embeddings": 64,
    "d_model": 32,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
    "num_layers": 2,
    "num_decoder_layers": 2,
    "num_heads": 4,
    "d_ff": 64,
    "d_kv": 8,
    "ffn_dim": 64,
    "embedding_size": 32,
    "num_local_experts": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "decoder_start_token_id": 0,
}

# Per family: what SMALL does not fit (None: leave the config's own), or a second layer type so
# that a module runs once per type.
OVERRIDES: dict[str, dict[str, Any]] = {
    "gemma3_text": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4},
    "modernbert": {"global_attn_every_n_layers": 2, "num_hidden_layers": 3, "local_attention": 4},
    "gemma2": {"sliding_window": 4},
    "cohere2": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4},
    "mistral": {"sliding_window": 4},
    "qwen2": {"use_sliding_window": False},
    "mamba": {"state_size": 4, "conv_kernel": 4, "expand": 2},
    "mamba2": {"state_size": 4, "n_groups": 1, "expand": 2, "num_heads": 8, "head_dim": 8},
    "rwkv": {"attention_hidden_size": 32, "context_length": 16},
    "recurrent_gemma": {
        "lru_width": 32,
        "attention_window_size": 4,
        "block_types": ["recurrent", "attention"],
    },
    "xlnet": {"d_inner": 64, "n_layer": 2, "n_head": 4, "max_position_embeddings": None},
    "funnel": {
        "block_sizes": [1, 1],
        "d_head": 8,
        "d_inner": 64,
        "num_hidden_layers": None,
        "num_layers": None,
    },
    "falcon": {"head_dim": None},
    "gptj": {"rotary_dim": 4},
    "codegen": {"rotary_dim": 4},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": 4},
    "deberta-v2": {"position_buckets": 8, "max_relative_positions": 16},
    "big_bird": {"attention_type": "original_full"},
    "longformer": {"attention_window": 4},
    "led": {"attention_window": 4, "max_encoder_position_embeddings": 64},
    "reformer": {"axial_pos_shape": [4, 4], "axial_pos_embds_dim": [16, 16]},
    "fsmt": {"src_vocab_size": 128, "tgt_vocab_size": 128, "langs": ["en", "de"]},
    "prophetnet": {
        "ngram": 2,
        "num_encoder_layers": 2,
        "num_decoder_layers": 2,
        "num_hidden_layers": None,
        "num_layers": None,
    },
    "xlm": {"emb_dim": 32, "n_layers": 2, "n_heads": 4},
    "flaubert": {"emb_dim": 32, "n_layers": 2, "n_heads": 4},
    "ctrl": {"dff": 64},
    "openai-gpt": {"n_positions": 64},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2},
    "canine": {"downsampling_rate": 2, "num_hash_functions": 2, "num_hash_buckets": 64},
}

FAMILIES = [
    # encoders
    "bert", "roberta", "distilbert", "albert", "electra", "deberta", "deberta-v2", "xlm-roberta",
    "camembert", "mpnet", "convbert", "ernie", "roformer", "nystromformer", "yoso", "squeezebert",
    "mobilebert", "megatron-bert", "rembert", "esm", "big_bird", "longformer", "funnel", "xlnet",
    "modernbert", "canine", "xlm", "flaubert", "data2vec-text", "xmod", "luke", "mra",
    # decoders
    "gpt2", "openai-gpt", "ctrl", "gpt_neo", "gpt_neox", "gptj", "codegen", "bloom", "opt",
    "falcon", "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi",
    "phi3", "gemma", "gemma2", "gemma3_text", "cohere", "cohere2", "stablelm", "starcoder2",
    "olmo", "olmo2", "olmoe", "granite", "granitemoe", "mpt", "persimmon", "recurrent_gemma",
    "biogpt", "xglm", "gpt_bigcode", "glm", "glm4", "helium", "nemotron", "jetmoe", "dbrx",
    "mamba", "mamba2", "rwkv", "jamba", "reformer",
    # encoder-decoders
    "t5", "mt5", "umt5", "longt5", "bart", "mbart", "pegasus", "marian", "blenderbot",
    "blenderbot-small", "m2m_100", "plbart", "led", "prophetnet", "switch_transformers", "fsmt",
]  # fmt: skip


def build(family: str) -> tuple[Any, dict[str, Any]]:
    """A tiny random `family` model in eval mode, seed 0, and its inputs."""
    import torch
    from transformers import AutoConfig, AutoModel

    from modeltap.loading import Inputs, add_decoder_inputs

    torch.manual_seed(0)
    settings = {**SMALL, **OVERRIDES.get(family, {})}
    config = AutoConfig.for_model(family, **{k: v for k, v in settings.items() if v is not None})
    model = AutoModel.from_config(config).eval()
    ids = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(1))
    if family == "reformer":
        ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    inputs = add_decoder_inputs(model, Inputs((), {"input_ids": ids}, {}))
    return model, inputs.kwargs


def plain_hook_values(model: Any, kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict]:
    """Every module's output on every call, by key, from plain forward hooks; and the modules
    called more than once, with their call counts."""
    import torch

    values: dict[str, Any] = {}
    calls: dict[str, int] = {}

    def leaves(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            yield path, value
        elif isinstance(value, dict):
            for name, item in value.items():
                yield from leaves(item, f"{path}.{name}" if path else str(name))
        elif isinstance(value, (tuple, list)):
            for index, item in enumerate(value):
                yield from leaves(item, f"{path}.{index}" if path else str(index))

    def hook(name: str) -> Any:
        def keep(module: Any, args: Any, output: Any) -> None:
            k = calls.get(name, 0)
            calls[name] = k + 1
            head = name if k == 0 else f"{name}@{k}"
            for path, tensor in leaves(output, ""):
                values[f"{head}:{path}" if path else head] = tensor.detach().clone()

        return keep

    handles = [m.register_forward_hook(hook(n or "__root__")) for n, m in model.named_modules()]
    try:
        torch.manual_seed(0)
        with torch.no_grad():
            model(**kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return values, {name: n for name, n in calls.items() if n > 1}


def read(path: Path) -> dict[str, Any]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - no iteration
        aliases = json.loads(f.metadata().get("aliases", "{}"))
    return {**stored, **{a: stored[k] for a, k in aliases.items()}}


def differences(want: dict[str, Any], got: dict[str, Any], *, atol: float = 0.0) -> list[str]:
    import torch

    bad = [f"missing {k}" for k in want if k not in got]
    bad += [f"extra {k}" for k in got if k not in want]
    for key, value in want.items():
        other = got.get(key)
        if other is None:
            continue
        if atol == 0:
            same = other.shape == value.shape and torch.equal(other, value)
        else:
            a, b = other.double(), value.double()
            same = a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=atol, equal_nan=True)
        if not same:
            bad.append(f"value {key}")
    return bad


def check(family: str, with_compile: bool, folder: Path) -> dict[str, Any]:
    from modeltap.capture import capture
    from modeltap.dumping import dump_model
    from modeltap.loading import Inputs

    model, kwargs = build(family)
    want, repeated = plain_hook_values(model, kwargs)
    captured = capture(model, **kwargs, seed=0)
    bad = differences(want, {k: captured[k] for k in captured.keys()})
    dumped = read(dump_model(model, Inputs((), kwargs, {}), folder / f"{family}.safetensors"))
    bad += [f"dump: {b}" for b in differences(want, dumped)]
    row = {"keys": len(want), "repeated": repeated, "bad": bad}
    if with_compile and repeated:
        from modeltap.capture.compile import compile_capture

        got, _ = compile_capture(model, **kwargs, backend="aot_eager", seed=0)
        calls = {k: v for k, v in want.items() if k.partition(":")[0].split("@")[0] in repeated}
        compiled = {k: got[k] for k in got.keys() if k in calls}
        row["bad"] += [f"compile: {b}" for b in differences(calls, compiled, atol=1e-5)]
    return row


def signatures(families: list[str]) -> dict[str, dict[str, float]]:
    """For each family, each repeated call's key -> the sum of its values (in this process)."""
    out = {}
    for family in families:
        try:
            model, kwargs = build(family)
            want, repeated = plain_hook_values(model, kwargs)
        except Exception:  # reported by the main run
            continue
        out[family] = {
            k: float(v.double().sum())
            for k, v in want.items()
            if k.partition(":")[0].split("@")[0] in repeated
        }
    return out


def hash_dependent(families: list[str]) -> list[str]:
    """Families whose repeated calls hold other values under PYTHONHASHSEED 0 and 1."""
    runs = []
    for seed in ("0", "1"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run(
            [sys.executable, __file__, "--signatures", *families],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return sorted(f for f in runs[0] if runs[0][f] != runs[1].get(f))


def main() -> int:
    import warnings

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("families", nargs="*", help="default: all of FAMILIES")
    parser.add_argument("--compile", action="store_true", help="also torch.compile (aot_eager)")
    parser.add_argument("--hash-seeds", action="store_true", help="find hash-order families")
    parser.add_argument("--signatures", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    families = args.families or FAMILIES
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if args.signatures:
        print(json.dumps(signatures(families)))
        return 0
    passed, failed, skipped = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for family in families:
            start = time.perf_counter()
            try:
                row = check(family, args.compile, Path(tmp))
            except Exception as exc:
                reason = " ".join(str(exc).split())[:110] or type(exc).__name__
                skipped.append(family)
                print(f"{family:22} skipped: {type(exc).__name__}: {reason}", flush=True)
                continue
            seconds = time.perf_counter() - start
            repeated = ", ".join(f"{k} x{n}" for k, n in list(row["repeated"].items())[:3])
            more = len(row["repeated"]) - 3
            repeated += f" (+{more})" if more > 0 else ""
            status = "ok" if not row["bad"] else "FAILED " + "; ".join(row["bad"][:4])
            print(
                f"{family:22} {status}: {row['keys']} keys, {seconds:.1f} s"
                + (f", repeated: {repeated}" if repeated else ""),
                flush=True,
            )
            (failed if row["bad"] else passed).append(family)
    print(f"\n{len(passed)} passed, {len(failed)} failed, {len(skipped)} skipped")
    if failed:
        print("failed: " + ", ".join(failed))
    if args.hash_seeds:
        found = hash_dependent(passed + failed)
        print("call order depends on the hash seed: " + (", ".join(found) or "none"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
