"""The cost of `dump --formats` (issue #31), as a ratio taken in one process.

    .venv/bin/python scripts/bench_formats.py                  # bert-base 8 x 128, on the CPU
    .venv/bin/python scripts/bench_formats.py --device cuda    # model and statistics on a GPU
    .venv/bin/python scripts/bench_formats.py --layers 2 --reps 3   # a quick check of the script
    .venv/bin/python scripts/bench_formats.py --micro --against HEAD~1  # format_errors alone,
                                                       # per tensor size, this tree vs a commit

Figure and target, on a bert-base-sized BertModel (BertConfig(), seed 0), batch 8 x 128:
  `dump --stats-only --formats fp8_e4m3,mxfp8,nvfp4,int8` / `dump --stats-only`, both through
  `modeltap.dump`, alternating after a warm-up each, medians of wall time          <= 2.5
The process's CPU time (all threads) is given beside it: on a machine others share, the wall
times wander and the CPU times less. Every module's output is measured in each format
(stats/formats.py); `bare_forward_s` is the model alone, for scale. On a GPU the figures are
also checked against the CPU's on random tensors (`device_check`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_backends import bert_base  # noqa: E402

FORMATS = ("fp8_e4m3", "mxfp8", "nvfp4", "int8")
TARGET = 2.5
# bert-base 8 x 128's tensors: hidden states, the MLP's inner ones, the pooler's, the embeddings'
SIZES = ((8, 128, 768), (8, 128, 3072), (8, 768), (1, 128, 768))


def paired(fs: list[Callable[[], object]], reps: int) -> list[dict[str, float]]:
    """Median wall and process-CPU seconds of each f, run in turn after one warm-up each."""
    for f in fs:
        f()
    wall: list[list[float]] = [[] for _ in fs]
    cpu: list[list[float]] = [[] for _ in fs]
    for _ in range(reps):
        for i, f in enumerate(fs):
            w, c = time.perf_counter(), time.process_time()
            f()
            wall[i].append(time.perf_counter() - w)
            cpu[i].append(time.process_time() - c)
    return [
        {"wall": statistics.median(w), "cpu": statistics.median(c)}
        for w, c in zip(wall, cpu, strict=True)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, help="fewer layers than bert-base's 12")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--device", default="cpu", help="where the model runs (cpu, cuda)")
    parser.add_argument("--micro", action="store_true", help="format_errors alone, per size")
    parser.add_argument("--against", metavar="REV", help="with --micro: also a commit's code")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    import torch

    cuda = args.device.startswith("cuda")

    def synced(f: Callable[[], object]) -> Callable[[], None]:
        def call() -> None:
            f()
            if cuda:
                torch.cuda.synchronize()

        return call

    if args.micro:
        micro(args, synced)
        return
    figures = ratio(args, synced)
    if cuda:
        figures["device_check"] = device_check(args.device)
    print(json.dumps(figures, indent=1))
    verdict = "PASS" if figures["ratio"] <= TARGET else "FAIL"
    print(f"ratio {figures['ratio']} on {figures['device']} (target <= {TARGET}): {verdict}")


def ratio(args: argparse.Namespace, synced: Callable) -> dict:
    import torch

    import modeltap
    from modeltap.dump import load_dump

    model, batch = bert_base(args.layers)
    model = model.to(args.device)
    batch = {k: v.to(args.device) for k, v in batch.items()}
    with tempfile.TemporaryDirectory() as folder:
        paths = {f: Path(folder) / f"formats{bool(f)}.safetensors" for f in ((), FORMATS)}

        def run(formats: tuple[str, ...]) -> Callable[[], None]:
            options = {"stats_only": True, "formats": formats}
            return synced(lambda: modeltap.dump(model, batch, paths[formats], **options))

        def bare() -> None:
            with torch.no_grad():
                model(**batch)

        plain, with_formats = paired([run(()), run(FORMATS)], args.reps)
        (forward,) = paired([synced(bare)], max(1, args.reps // 2))
        measured = sum(1 for s in load_dump(paths[FORMATS]).stats.values() if s.formats)
    size = f"bert-base{'' if args.layers is None else f' ({args.layers} layers)'} 8x128"
    device = torch.cuda.get_device_name(args.device) if args.device != "cpu" else "cpu"
    return {
        "model": size,
        "device": device,
        "torch_threads": torch.get_num_threads(),
        "formats": list(FORMATS),
        "tensors_measured": measured,
        "bare_forward_s": round(forward["wall"], 4),
        "dump_stats_only_s": round(plain["wall"], 4),
        "dump_stats_only_formats_s": round(with_formats["wall"], 4),
        "ratio": round(with_formats["wall"] / plain["wall"], 3),
        "cpu_s": [round(plain["cpu"], 3), round(with_formats["cpu"], 3)],
        "cpu_ratio": round(with_formats["cpu"] / plain["cpu"], 3),
        "target": TARGET,
    }


def micro(args: argparse.Namespace, synced: Callable) -> None:
    """Milliseconds of format_errors(x, FORMATS, finite=True) per size, this tree's code and
    (--against) a commit's, alternating."""
    import torch

    from modeltap.stats import formats

    codes = {"now": formats.format_errors}
    if args.against:
        codes[args.against] = _formats_at(args.against).format_errors
    gen = torch.Generator().manual_seed(0)
    rows = {}
    for shape in SIZES:
        x = (torch.randn(shape, generator=gen) * 2).to(args.device)
        reps = args.reps * (3 if x.numel() > 100_000 else 30)
        runs = [synced(lambda f=f, x=x: f(x, FORMATS, finite=True)) for f in codes.values()]
        times = paired(runs, reps)
        rows["x".join(map(str, shape))] = {
            name: round(t["wall"] * 1e3, 3) for name, t in zip(codes, times, strict=True)
        }
    print(json.dumps({"device": args.device, "torch_threads": torch.get_num_threads(),
                      "format_errors_ms": rows}, indent=1))  # fmt: skip


def _formats_at(rev: str):
    """stats/formats.py as it was at `rev`, imported on its own."""
    source = subprocess.run(
        ["git", "show", f"{rev}:src/modeltap/stats/formats.py"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    path = Path(tempfile.mkdtemp()) / "formats_then.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("formats_then", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def device_check(device: str) -> dict:
    """The largest differences between the device's figures and the CPU's, on random tensors
    with outliers: counts should agree exactly, rel_rmse within float rounding."""
    import torch

    from modeltap.stats.formats import FORMATS as ALL
    from modeltap.stats.formats import format_errors

    gen = torch.Generator().manual_seed(1)
    worst = {"rel_rmse_rel": 0.0, "underflow": 0.0, "clipped": 0.0}
    for shape in ((8, 128, 768), (5, 77), (3, 33, 48)):
        x = torch.randn(shape, generator=gen) * 10.0 ** torch.empty(shape).uniform_(-4, 2)
        here, there = format_errors(x, ALL), format_errors(x.to(device), ALL)
        for fmt in ALL:
            a, b = here[fmt], there[fmt]
            rel = abs(a["rel_rmse"] - b["rel_rmse"]) / max(a["rel_rmse"], 1e-30)
            worst["rel_rmse_rel"] = max(worst["rel_rmse_rel"], rel)
            for key in ("underflow", "clipped"):
                worst[key] = max(worst[key], abs(a[key] - b[key]))
    worst["ok"] = worst["rel_rmse_rel"] < 1e-4 and not worst["underflow"] and not worst["clipped"]
    return worst


if __name__ == "__main__":
    main()
