"""Issue #29 item 16: how a `generate` dump's size grows with steps x keys, and how much of it is
header padding, with the writer's padding rule (`DumpWriter._wasted`) and without it (every
reservation kept whole, as before the rule).

    .venv/bin/python scripts/bench_header.py
    .venv/bin/python scripts/bench_header.py --steps 10 50 200 --layers 2 8

Workload: a tiny T5ForConditionalGeneration built from a config (d_model 16, EOS off so that
every step asked for runs), an 8-token prompt, greedy, the default plan (tensors of the prefill
and the last step, statistics of the others). `layers` sets the encoder's and decoder's depth,
and so the keys per step. Columns: keys with statistics, bytes of header JSON, then for each
rule the header bytes (JSON + padding) and the file's bytes, and the seconds of the call.
"""

from __future__ import annotations

import argparse
import struct
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))


def model_and_inputs(layers: int):  # noqa: ANN201
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    from modeltap.loading import Inputs

    torch.manual_seed(0)
    config = T5Config(
        vocab_size=512, d_model=16, d_kv=8, d_ff=32, num_layers=layers, num_heads=2,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    model = T5ForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = None
    ids = torch.randint(2, 512, (1, 8))
    return model, Inputs((), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, {})


def header_sizes(path: Path) -> tuple[int, int]:
    """(header bytes as declared, of which JSON)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return n, len(f.read(n).rstrip(b" "))


def one(layers: int, steps: int, *, padding_rule: bool, folder: Path) -> dict[str, float]:
    import json

    from modeltap.dump.writer import DumpWriter
    from modeltap.generate import generate_model
    from modeltap.generate.options import Decoding

    model, inputs = model_and_inputs(layers)
    rule = DumpWriter._wasted
    if not padding_rule:
        DumpWriter._wasted = lambda self, header: False  # type: ignore[method-assign]
    try:
        path = folder / f"t5-{layers}-{steps}-{padding_rule}.safetensors"
        start = time.perf_counter()
        generate_model(model, inputs, path, decoding=Decoding(max_new_tokens=steps))
        seconds = time.perf_counter() - start
    finally:
        DumpWriter._wasted = rule  # type: ignore[method-assign]
    header, json_bytes = header_sizes(path)
    with open(path, "rb") as f:
        f.seek(8)
        keys = len(json.loads(json.loads(f.read(header))["__metadata__"]["stats"]))
    size = path.stat().st_size
    path.unlink()
    return {"keys": keys, "json": json_bytes, "header": header, "file": size, "s": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--steps", type=int, nargs="+", default=[10, 50, 200])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8])
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    mb = 1e6
    print(
        "| layers | steps | keys | JSON MB | before: header MB | file MB | s "
        "| after: header MB | file MB | s |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for layers in args.layers:
            for steps in args.steps:
                old = one(layers, steps, padding_rule=False, folder=Path(tmp))
                new = one(layers, steps, padding_rule=True, folder=Path(tmp))
                print(
                    f"| {layers} | {steps} | {new['keys']} | {new['json'] / mb:.2f} "
                    f"| {old['header'] / mb:.2f} | {old['file'] / mb:.2f} | {old['s']:.2f} "
                    f"| {new['header'] / mb:.2f} | {new['file'] / mb:.2f} | {new['s']:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
