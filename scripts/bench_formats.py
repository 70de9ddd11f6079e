"""The cost of `dump --formats` (issue #31), as a ratio taken in one process.

    .venv/bin/python scripts/bench_formats.py                  # bert-base 8 x 128, on the CPU
    .venv/bin/python scripts/bench_formats.py --device cuda    # model and statistics on a GPU
    .venv/bin/python scripts/bench_formats.py --layers 2 --reps 3   # a quick check of the script

Figure and target, on a bert-base-sized BertModel (BertConfig(), seed 0), batch 8 x 128:
  `dump --stats-only --formats fp8_e4m3,mxfp8,nvfp4,int8` / `dump --stats-only`, both through
  `modeltap.dump`, alternating after a warm-up each, medians                          <= 2.5
Every module's output is measured in each format (stats/formats.py: one vectorized pass a format
over the tensor); `bare_forward_s` is the model alone, for scale.
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

FORMATS = ("fp8_e4m3", "mxfp8", "nvfp4", "int8")
TARGET = 2.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, help="fewer layers than bert-base's 12")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--device", default="cpu", help="where the model runs (cpu, cuda)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    import torch

    import modeltap
    from modeltap.dump import load_dump

    model, batch = bert_base(args.layers)
    model = model.to(args.device)
    batch = {k: v.to(args.device) for k, v in batch.items()}
    cuda = args.device.startswith("cuda")

    def synced(f):
        def call():
            f()
            if cuda:
                torch.cuda.synchronize()

        return call

    with tempfile.TemporaryDirectory() as folder:
        paths = {f: Path(folder) / f"formats{bool(f)}.safetensors" for f in ((), FORMATS)}

        def run(formats: tuple[str, ...]):
            path = paths[formats]
            options = {"stats_only": True, "formats": formats}
            return synced(lambda: modeltap.dump(model, batch, path, **options))

        def bare() -> None:
            with torch.no_grad():
                model(**batch)

        plain, with_formats = paired(run(()), run(FORMATS), args.reps)
        forward, _ = paired(synced(bare), synced(bare), max(1, args.reps // 2))
        measured = sum(1 for s in load_dump(paths[FORMATS]).stats.values() if s.formats)
    size = f"bert-base{'' if args.layers is None else f' ({args.layers} layers)'} 8x128"
    figures = {
        "model": size,
        "device": args.device,
        "torch_threads": torch.get_num_threads(),
        "formats": list(FORMATS),
        "tensors_measured": measured,
        "bare_forward_s": round(forward, 4),
        "dump_stats_only_s": round(plain, 4),
        "dump_stats_only_formats_s": round(with_formats, 4),
        "ratio": round(with_formats / plain, 3),
        "target": TARGET,
    }
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
