"""Performance figures of issue #11 (`modeltap.record`), as ratios taken in one process.

    .venv/bin/python scripts/bench_record.py            # --reps 5: 21 training steps
    .venv/bin/python scripts/bench_record.py --reps 1   # 5 steps

A bert-base-sized BertForMaskedLM (BertConfig(), seed 0, train mode) on a batch of 8 x 128, one
training step = forward with labels, backward, AdamW step, zero_grad. Step kinds, measured in
turn (plain, off, tripwire, recorded, plain, ...) on the same model and optimizer; medians:

  plain      no modeltap
  off        inside record(every=100, on_nonfinite="off"), a step that is not recorded
  tripwire   inside record(every=100), the default tripwire, a step that is not recorded
  recorded   inside record(every=100), a recorded stats-only step (activations, gradients of
             every module output, parameter gradients, update ratios, rules; file written)

Figures and targets:
  amortized every=100, tripwire off: (99 off + 1 recorded) / 100 / plain   <= 1.02
  amortized every=100, with the tripwire (the default)                     (reported)
  recorded / plain                                                          <= 1.3
  tripwire / plain                                                          <= 1.05
The step files go under $TMPDIR (point it at tmpfs, TMPDIR=/dev/shm, to leave the disk out).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))


def setup():
    import torch
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig()).train()
    ids = torch.randint(
        0, model.config.vocab_size, (8, 128), generator=torch.Generator().manual_seed(0)
    )
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    logging.getLogger("modeltap.record").setLevel(logging.ERROR)  # rule hits are not the point
    return model, batch, opt


def train_step(model, batch, opt) -> None:
    model(**batch).loss.backward()
    opt.step()
    opt.zero_grad()


def timed(kind: str, model, batch, opt, out: Path) -> float:
    """Seconds of one step of `kind`; entering and leaving record() is not counted."""
    import modeltap

    if kind == "plain":
        start = time.perf_counter()
        train_step(model, batch, opt)
        return time.perf_counter() - start
    options = {
        "off": {"on_nonfinite": "off", "start_step": 1},
        "tripwire": {"start_step": 1},
        "recorded": {"start_step": 0},
    }[kind]
    with modeltap.record(model, out / kind, every=100, **options) as rec:
        start = time.perf_counter()
        train_step(model, batch, opt)
        rec.step()
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    import torch

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", file=sys.stderr)
    model, batch, opt = setup()
    kinds = ("plain", "off", "tripwire", "recorded")
    times: dict[str, list[float]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory() as tmp:
        timed("plain", model, batch, opt, Path(tmp))  # warm-up: first allocations, AdamW state
        for rep in range(args.reps):
            for kind in kinds:
                times[kind].append(timed(kind, model, batch, opt, Path(tmp)))
            print(f"rep {rep + 1}: " + ", ".join(f"{k} {times[k][-1]:.2f}s" for k in kinds))
    med = {k: statistics.median(v) for k, v in times.items()}
    plain = med["plain"]
    rows = [
        ("amortized every=100, tripwire off", (99 * med["off"] + med["recorded"]) / 100, 1.02),
        ("amortized every=100, tripwire on", (99 * med["tripwire"] + med["recorded"]) / 100, None),
        ("recorded stats-only step", med["recorded"], 1.3),
        ("tripwire on every step", med["tripwire"], 1.05),
        ("not recorded, tripwire off", med["off"], None),
    ]
    print(f"\nmedians of {args.reps} steps each (plain step {plain:.2f}s):")
    for name, value, target in rows:
        ratio = value / plain
        verdict = "" if target is None else (" ok" if ratio <= target else " MISSED")
        goal = "" if target is None else f" (target <= {target})"
        print(f"  {name:36s} {ratio:.3f}x{goal}{verdict}")


if __name__ == "__main__":
    main()
