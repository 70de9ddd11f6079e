"""Calibrate the recorder's rule thresholds on healthy training runs (a benchmark, not a test).

Runs a few steps of real training with `modeltap.record(every=1)` and no rules, then prints, per
rule, the most extreme value a healthy run reached, beside the default threshold:

  - MiniLM (the real all-MiniLM-L6-v2 in models/) fine-tuned as a 2-class sequence classifier;
  - a bert-base-sized BertForMaskedLM (random init, 12 layers, hidden 768) on masked tokens
    (--bert-base; about a minute on 2 cores).

    .venv/bin/python scripts/calibrate_rules.py [--steps 8] [--bert-base]

A default threshold is right when the healthy extremes stay clear of it: no warnings on a healthy
run. The Rules section of docs/commands/record.md holds the figures this printed.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "numbers users can trust",
    "a model inspection tool for engineers",
    "gradients vanish and explode in deep networks",
    "hello world",
    "layer norms keep activations in range",
    "a second sentence about the model",
    "which layer lost accuracy after quantization",
]


def minilm(steps: int, out: Path) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    import modeltap

    folder = ROOT / "models" / "all-MiniLM-L6-v2"
    tok = AutoTokenizer.from_pretrained(folder)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=2)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5)
    with modeltap.record(model, out, every=1, rules=[]) as rec:
        for step in range(steps):
            texts = [TEXTS[(2 * step) % len(TEXTS)], TEXTS[(2 * step + 1) % len(TEXTS)]]
            batch = tok(texts, padding=True, return_tensors="pt")
            labels = torch.tensor([step % 2, (step + 1) % 2])
            model(**batch, labels=labels).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            rec.step()


def bert_base_mlm(steps: int, out: Path) -> None:
    from transformers import BertConfig, BertForMaskedLM

    import modeltap

    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig()).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    with modeltap.record(model, out, every=1, rules=[]) as rec:
        for _ in range(steps):
            ids = torch.randint(1000, 30000, (4, 64), generator=generator)
            labels = ids.clone()
            masked = torch.rand(ids.shape, generator=generator) < 0.15
            labels[~masked] = -100
            ids[masked] = 103  # [MASK]
            model(input_ids=ids, labels=labels).loss.backward()
            opt.step()
            opt.zero_grad()
            rec.step()


def extremes(folder: Path, n: int = 3) -> dict[str, list[tuple[float, str]]]:
    """Per measured quantity, the `n` most extreme (value, key) pairs of the run."""
    from modeltap.record import read_run
    from modeltap.record.rules import is_logits

    run = read_run(folder).ranks[0]
    values: dict[str, dict[str, float]] = {}
    largest: dict[str, bool] = {}

    def keep(name: str, value: float, key: str, large: bool) -> None:
        if not math.isfinite(value):
            return
        seen = values.setdefault(name, {})
        largest[name] = large
        if key not in seen or (value > seen[key]) == large:
            seen[key] = value

    for step in run.steps:
        params = set(step.get("updates", {}))
        for key, s in step["keys"].items():
            if key.startswith("grad/"):
                name = key[5:]
                is_param = name in params or name.endswith((".weight", ".bias"))
                kind = "parameter" if is_param else "output"
                keep(f"smallest {kind} gradient norm", s["norm"], key, False)
                keep(f"largest {kind} gradient norm", s["norm"], key, True)
            elif s.get("dead") is not None and not is_logits(key):
                keep("largest dead share (floating, not logits)", s["dead"], key, True)
        for name, ratio in step.get("updates", {}).items():
            if name.endswith(".weight") and ratio > 0:
                keep("smallest update ratio (weights)", ratio, name, False)
                keep("largest update ratio (weights)", ratio, name, True)
    return {
        name: sorted(((v, k) for k, v in seen.items()), reverse=largest[name])[:n]
        for name, seen in values.items()
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--bert-base", action="store_true")
    parser.add_argument("--top", type=int, default=3, help="values shown per quantity")
    args = parser.parse_args()
    from modeltap.record.rules import DeadUnits, ExplodingGradient, UpdateRatio, VanishingGradient

    print(
        f"defaults: vanishing < {VanishingGradient().threshold:g}, "
        f"exploding > {ExplodingGradient().threshold:g}, dead share > {DeadUnits().fraction:g}, "
        f"update ratio outside [{UpdateRatio().low:g}, {UpdateRatio().high:g}]"
    )
    runs = [("MiniLM classifier", minilm)]
    if args.bert_base:
        runs.append(("bert-base MLM", bert_base_mlm))
    for title, train in runs:
        with tempfile.TemporaryDirectory() as folder:
            train(args.steps, Path(folder) / "run")
            print(f"{title}, {args.steps} steps:")
            for name, found in sorted(extremes(Path(folder) / "run", args.top).items()):
                for i, (value, key) in enumerate(found):
                    print(f"  {name if i == 0 else '':45s} {value:10.3g}  {key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
