"""The cost of `record(..., ops=True)` on the steps it does not record (issue #32), in one process.

    .venv/bin/python scripts/bench_record_ops.py               # 8 rounds of 60 steps each
    .venv/bin/python scripts/bench_record_ops.py --rounds 2    # a quick check of the script

Figure and target: the median time of a training step (a tiny BERT classifier, 4 layers of 128,
batch 8 x 32, SGD, 1 thread) on steps 1 to 99 of `record(every=100, ops=True)` over the same
under `record(every=100)`, rounds alternating with a bare loop for scale: ~1 (the mode that sees
ops is entered only in a recorded step's forwards, and its module hooks exist only then).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

import modeltap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=60, help="unrecorded steps per round (<99)")
    args = parser.parse_args()
    from transformers import BertConfig, BertForSequenceClassification

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=4,
                        num_attention_heads=4, intermediate_size=512,
                        max_position_embeddings=64, num_labels=2)  # fmt: skip
    model = BertForSequenceClassification(config).train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 1000, (8, 32))
    labels = torch.randint(0, 2, (8,))

    def steps(rec: object, n: int) -> list[float]:
        times = []
        for _ in range(n):
            start = time.perf_counter()
            model(input_ids=ids, labels=labels).loss.backward()
            opt.step()
            opt.zero_grad()
            if rec is not None:
                rec.step()  # type: ignore[attr-defined]
            times.append(time.perf_counter() - start)
        return times

    runs: dict[str, list[float]] = {"bare": [], "record": [], "record_ops": []}
    for _ in range(args.rounds):
        for name, times in runs.items():
            if name == "bare":
                steps(None, 3)
                times += steps(None, args.steps)
                continue
            with tempfile.TemporaryDirectory() as folder:
                options = {"ops": True} if name == "record_ops" else {}
                # start_step=1: steps 1 .. 99 are not recorded at every=100
                with modeltap.record(model, folder, every=100, start_step=1, **options) as rec:
                    steps(rec, 3)
                    times += steps(rec, args.steps)
    medians = {f"{name}_ms": statistics.median(t) * 1e3 for name, t in runs.items()}
    ratio = medians["record_ops_ms"] / medians["record_ms"]
    print(json.dumps({**medians, "ops_over_record": round(ratio, 3)}))


if __name__ == "__main__":
    main()
