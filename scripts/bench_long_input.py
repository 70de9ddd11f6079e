"""Big activations (issue #10): a long input dumps without holding more than the forward holds.

    .venv/bin/python scripts/bench_long_input.py [--layers 6] [--batch 8] [--seq 2048]

A BertModel (hidden 384, `max_position_embeddings` raised to the sequence length, seed 0) runs on a
batch x seq input twice, each in a fresh process: a bare forward under no_grad, and `dump_model` of
every module to a file in a temporary folder. Prints each one's peak RSS and wall time, the dump's
size and the RSS ratio (a dump that kept the layers' outputs in memory would grow with the number of
layers; one that streams them stays at the bare forward's peak).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

CHILD = """
import os, sys, time, torch
from transformers import BertConfig, BertModel
layers, batch, seq = (int(a) for a in sys.argv[1:4])
mode, out = sys.argv[4], sys.argv[5]
torch.manual_seed(0)
cfg = BertConfig(hidden_size=384, num_hidden_layers=layers, num_attention_heads=6,
                 intermediate_size=1536, max_position_embeddings=seq)
model = BertModel(cfg).eval()
ids = torch.randint(0, cfg.vocab_size, (batch, seq))
start = time.perf_counter()
if mode == "bare":
    with torch.no_grad():
        model(input_ids=ids)
    size = 0
else:
    from modeltap.loading import Inputs
    from modeltap.dumping import dump_model
    size = os.path.getsize(dump_model(model, Inputs((), {"input_ids": ids}, {}), out))
import resource
print(time.perf_counter() - start, size, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def run(mode: str, args: argparse.Namespace, out: str) -> tuple[float, int, float]:
    """(seconds, bytes written, peak RSS in MB) of one fresh process."""
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(args.layers), str(args.batch), str(args.seq), mode, out],
        capture_output=True,
        text=True,
        check=True,
    )
    seconds, size, peak_kb = done.stdout.split()
    return float(seconds), int(size), int(peak_kb) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "long.safetensors")
        t0 = time.perf_counter()
        dump_s, size, dump_mb = run("dump", args, out)
        os.unlink(out)
        bare_s, _, bare_mb = run("bare", args, out)
    print(
        f"{args.layers} layers, {args.batch} x {args.seq} tokens ({time.perf_counter() - t0:.0f} s)"
    )
    print(f"bare forward: {bare_s:.1f} s; dump: {dump_s:.1f} s, {size / 1e9:.2f} GB written")
    print(
        f"peak RSS: dump {dump_mb:.0f} MB, bare forward {bare_mb:.0f} MB: {dump_mb / bare_mb:.3f}"
    )


if __name__ == "__main__":
    main()
