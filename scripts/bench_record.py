"""Performance figures of `modeltap.record` (issues #11 and #20), as ratios taken in one process.

    .venv/bin/python scripts/bench_record.py            # --reps 5: 56 training steps
    .venv/bin/python scripts/bench_record.py --reps 1   # 12 steps
    .venv/bin/python scripts/bench_record.py --trainer  # also transformers' Trainer, with and
                                                        # without ModeltapCallback
    .venv/bin/python scripts/bench_record.py --trainer-only --reps 6  # the Trainer rows alone

A bert-base-sized BertForMaskedLM (BertConfig(), seed 0, train mode) on a batch of 8 x 128, one
training step = forward with labels, backward, AdamW step, zero_grad. Step kinds, measured in
turn (plain, off, tripwire, recorded, ...) on the same model and optimizer; medians. Each kind
not recorded first runs one untimed step in its record() block, as a run's first step (checked
in full: it teaches the lazy tripwire its sources).

  plain            no modeltap
  off              inside record(every=100, on_nonfinite="off"), a step that is not recorded
  tripwire         inside record(every=100), the default tripwire, a step that is not recorded
                   (the lazy check of record.sentinel, after the run's first step taught it)
  eager            inside record(every=100, eager_tripwire=True): every module checked
  recorded         inside record(every=100), a recorded stats-only step (activations, gradients
                   of every module output, parameter gradients, update ratios, rules; file written)
  flight           inside record(every=100, flight=True): the flight recorder armed, a step that
                   is not recorded (checked lazily: RNG states kept once, at the forward)
  flight-recorded  the same, a recorded step

Figures and targets:
  amortized every=100, tripwire off: (99 off + 1 recorded) / 100 / plain   <= 1.02
  amortized every=100, with the tripwire (the default)                     (reported)
  amortized every=100, eager tripwire                                       (reported)
  amortized every=100, flight recorder armed                                <= 1.05
  recorded / plain                                                          <= 1.3
  tripwire / plain                                                          <= 1.05
  eager / plain, off / plain                                                (reported)
With --trainer: a MiniLM-sized BertForSequenceClassification (6 layers, hidden 384) trained by
transformers' Trainer on 8 x 64 batches, runs alternating without the callback, with
ModeltapCallback(every=100) (steps not recorded) and with every=1 (every step recorded), each
with and without flight=True; the median step time of each (the first two steps of a run left
out; runs of 12 steps, --reps // 2 runs per kind):
  amortized Trainer + callback every=100 / Trainer                          <= 1.02
  the same with flight=True (99 flight every=100 + 1 flight every=1)        <= 1.05
  (the same with the tripwire off, on_nonfinite="off", and eager_tripwire=True, beside it)
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
        "eager": {"start_step": 1, "eager_tripwire": True},
        "recorded": {"start_step": 0},
        "flight": {"flight": True, "start_step": 1},
        "flight-recorded": {"flight": True, "start_step": 0},
    }[kind]
    with modeltap.record(model, out / kind, every=100, overwrite=True, **options) as rec:
        if options["start_step"]:  # as in a run: the first step (untimed) is checked in full,
            train_step(model, batch, opt)  # which teaches the lazy tripwire its sources
            rec.step()
        start = time.perf_counter()
        train_step(model, batch, opt)
        rec.step()
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--trainer", action="store_true", help="also the Trainer callback")
    parser.add_argument("--trainer-only", action="store_true", help="the Trainer rows alone")
    args = parser.parse_args()
    import torch

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", file=sys.stderr)
    if args.trainer_only:
        trainer_figures(args.reps)
        return
    model, batch, opt = setup()
    kinds = ("plain", "off", "tripwire", "eager", "recorded", "flight", "flight-recorded")
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
        (
            "amortized every=100, eager tripwire",
            (99 * med["eager"] + med["recorded"]) / 100,
            None,
        ),
        (
            "amortized every=100, flight recorder",
            (99 * med["flight"] + med["flight-recorded"]) / 100,
            1.05,
        ),
        ("recorded stats-only step", med["recorded"], 1.3),
        ("tripwire on, a step not recorded", med["tripwire"], 1.05),
        ("eager tripwire, a step not recorded", med["eager"], None),
        ("not recorded, tripwire off", med["off"], None),
    ]
    print(f"\nmedians of {args.reps} steps each (plain step {plain:.2f}s):")
    for name, value, target in rows:
        ratio = value / plain
        print(f"  {name:36s} {ratio:.3f}x{_verdict(ratio, target)}")
    if args.trainer:
        trainer_figures(args.reps)


def trainer_run(every: int | None, out: Path, **options: object) -> list[float]:
    """Seconds of each step of one Trainer run (with ModeltapCallback(every) unless None)."""
    import torch
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from modeltap.integrations import ModeltapCallback

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_step_begin(self, *args, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            self.times.append(time.perf_counter() - self.start)

    torch.manual_seed(0)
    config = BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                        intermediate_size=1536, num_labels=2)
    model = BertForSequenceClassification(config)
    generator = torch.Generator().manual_seed(0)
    data = [
        {"input_ids": torch.randint(1000, 30000, (64,), generator=generator), "labels": i % 2}
        for i in range(8 * 12)
    ]
    clock = Clock()
    callbacks: list = [clock]
    if every is not None:
        callbacks.insert(0, ModeltapCallback(out, every=every, overwrite=True, **options))
    args = TrainingArguments(
        output_dir=str(out / "trainer"), max_steps=12, per_device_train_batch_size=8,
        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
        logging_strategy="no", seed=0,
    )
    Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks).train()
    return clock.times[2:]


def _verdict(ratio: float, target: float | None) -> str:
    if target is None:
        return ""
    return f" (target <= {target}) " + ("ok" if ratio <= target else "MISSED")


def trainer_figures(reps: int) -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    kinds: dict[str, tuple[int | None, dict]] = {
        "Trainer": (None, {}),
        "callback every=100": (100, {}),
        "callback every=100, tripwire off": (100, {"on_nonfinite": "off"}),
        "callback every=100, eager tripwire": (100, {"eager_tripwire": True}),
        "callback every=100, flight recorder": (100, {"flight": True}),
        "callback every=1": (1, {}),
        "callback every=1, flight recorder": (1, {"flight": True}),
    }
    times: dict[str, list[float]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(max(1, reps // 2)):  # each run: 12 steps of each kind
            for name, (every, options) in kinds.items():
                times[name] += trainer_run(every, Path(tmp) / "run", **options)
            print(f"trainer rep {rep + 1}: " + ", ".join(
                f"{k} {statistics.median(v):.3f}s" for k, v in times.items()))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\nTrainer, median step {med['Trainer']:.3f}s:")
    # (kind not recorded, its recorded kind, target)
    shown = (
        ("callback every=100", "callback every=1", 1.02),
        ("callback every=100, tripwire off", "callback every=1", None),
        ("callback every=100, eager tripwire", "callback every=1", None),
        ("callback every=100, flight recorder", "callback every=1, flight recorder", 1.05),
    )
    for kind, recorded, target in shown:
        ratio = (99 * med[kind] + med[recorded]) / 100 / med["Trainer"]
        print(f"  {'amortized ' + kind:46s} {ratio:.3f}x{_verdict(ratio, target)}")
    print(f"  {'recorded step (every=1)':36s} {med['callback every=1'] / med['Trainer']:.3f}x")


if __name__ == "__main__":
    main()
