"""The cost of `dump --ops` (issue #32), as a ratio taken in one process.

    .venv/bin/python scripts/bench_ops.py                 # bert-base 8 x 128
    .venv/bin/python scripts/bench_ops.py --layers 2 --reps 3   # a quick check of the script

Figure and target, on a bert-base-sized BertModel (BertConfig(), seed 0), batch 8 x 128:
  `dump --ops --include 'encoder.layer.0.*'` / `dump --include 'encoder.layer.0.*'`, both
  through `modeltap.dump` with tensors written, alternating after a warm-up each, medians
                                                                          <= 1.5
Ops are captured only inside the selected modules; the mode that sees them is on for the whole
forward, so the other eleven layers pay its dispatch per torch call too. `bare_forward_s`: the
model alone, for scale.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_backends import bert_base, paired  # noqa: E402

INCLUDE = "encoder.layer.0.*"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, help="fewer layers than bert-base's 12")
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    import torch

    import modeltap
    from modeltap.dump import load_dump

    model, batch = bert_base(args.layers)
    with tempfile.TemporaryDirectory() as folder:
        paths = {ops: Path(folder) / f"ops{ops}.safetensors" for ops in (False, True)}

        def run(ops: bool):
            return lambda: modeltap.dump(model, batch, paths[ops], include=[INCLUDE], ops=ops)

        def bare() -> None:
            with torch.no_grad():
                model(**batch)

        plain, with_ops = paired(run(False), run(True), args.reps)
        forward, _ = paired(bare, bare, max(1, args.reps // 2))
        dump = load_dump(paths[True])
        ops = len(json.loads(dump.metadata["ops"]))
    size = f"bert-base{'' if args.layers is None else f' ({args.layers} layers)'} 8x128"
    figures = {
        "model": size,
        "torch_threads": torch.get_num_threads(),
        "bare_forward_s": round(forward, 4),
        "dump_s": round(plain, 4),
        "dump_ops_s": round(with_ops, 4),
        "ops_captured": ops,
        "ratio": round(with_ops / plain, 3),
        "target": 1.5,
    }
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
