"""Time and size of `modeltap report` pages (issue #21's figures).

    .venv/bin/python scripts/bench_report.py [--folder DIR] [--no-browser]

1. The dump page of a bert-base-sized BertModel (BertConfig(), seed 0) on an 8 x 128 batch,
   dumped stats-only with --hist: time to build and render it once the imports are done
   (target <= 1 s), and its size (target <= 6 MB).
2. The run page of a synthetic run of 1,000 recorded steps x 200 modules (each with an output
   and a gradient norm, and 50 parameters' update ratios): build and render time (target <= 3 s).
3. Each page opened from disk in headless Chromium (scripts/setup.sh --browser): milliseconds from
   navigation start to the first chart drawn (target <= 2 s).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

# Debian's chromium, as tests/fixtures/browser.py launches it (Playwright's download can't run).
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]  # fmt: skip


def timed(build, repeat: int = 3) -> tuple[float, float, str]:  # noqa: ANN001
    """(first, median of `repeat`) seconds of build(), and its last result."""
    times = []
    result = ""
    for _ in range(repeat):
        start = time.perf_counter()
        result = build()
        times.append(time.perf_counter() - start)
    return times[0], statistics.median(times), result


def synthetic_run(folder: Path, steps: int = 1000, modules: int = 200, params: int = 50):  # noqa: ANN201
    from modeltap.record.index import RankIndex, RunIndex

    rng = random.Random(0)
    names = [f"encoder.layer.{i // 10}.m{i % 10}" for i in range(modules)]
    entries = []
    for step in range(steps):
        keys = {}
        for name in names:
            keys[name] = {"norm": rng.lognormvariate(2, 0.3), "absmax": 3.0, "dead": 0.01}
            keys["grad/" + name] = {"norm": rng.lognormvariate(-3, 0.5), "absmax": 0.1}
        updates = {f"p{i}.weight": rng.lognormvariate(-7, 0.2) for i in range(params)}
        entries.append({"step": step, "keys": keys, "updates": updates, "hits": []})
    return RunIndex(folder, {0: RankIndex(0, {"every": 1}, entries)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--folder", help="where to write the dump and pages (default: temp)")
    parser.add_argument("--no-browser", action="store_true", help="skip the Chromium timing")
    args = parser.parse_args()

    import torch
    from transformers import BertConfig, BertModel

    from modeltap.dump import load_dump
    from modeltap.dumping import dump_model
    from modeltap.loading import Inputs
    from modeltap.render.report import dump_page, render, run_page

    with tempfile.TemporaryDirectory(dir=args.folder) as tmp:
        folder = Path(tmp)
        torch.manual_seed(0)
        model = BertModel(BertConfig()).eval()
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, model.config.vocab_size, (8, 128), generator=gen)
        inputs = Inputs((), {"input_ids": ids}, {"bench": "report"})
        path = dump_model(model, inputs, folder / "bert.safetensors", stats_only=True, hist=True)
        del model
        opened = load_dump(path)
        keys = f"{len(opened.keys())} keys ({len(opened.stats)} distinct tensors)"

        render(dump_page(load_dump(path)))  # warm: templates compiled, plotly.js read once
        first, median, html = timed(lambda: render(dump_page(load_dump(path))))
        dump_html = folder / "dump.html"
        dump_html.write_text(html)
        print(f"dump page, bert-base 8 x 128, {keys} with histograms: "
              f"{first:.3f} s first, {median:.3f} s median of 3 (target <= 1 s); "
              f"{len(html.encode()) / 1e6:.2f} MB (target <= 6 MB)")  # fmt: skip

        run = synthetic_run(folder)
        first, median, html = timed(lambda: render(run_page(run)))
        run_html = folder / "run.html"
        run_html.write_text(html)
        print(f"run page, 1,000 steps x 200 modules (+200 gradient keys, 50 update ratios): "
              f"{first:.3f} s first, {median:.3f} s median of 3 (target <= 3 s); "
              f"{len(html.encode()) / 1e6:.2f} MB")  # fmt: skip

        if args.no_browser:
            return
        from playwright.sync_api import sync_playwright

        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            for name, page_path in (("dump", dump_html), ("run", run_html)):
                loads = []
                for _ in range(3):
                    page = browser.new_page(viewport={"width": 1280, "height": 900})
                    page.goto(page_path.as_uri())
                    page.wait_for_function("window.modeltapFirstChart !== undefined")
                    loads.append(page.evaluate("window.modeltapFirstChart"))
                    page.close()
                print(f"{name} page in Chromium, navigation start to first chart: "
                      f"{', '.join(f'{ms:.0f}' for ms in loads)} ms (target <= 2000)")  # fmt: skip
            browser.close()


if __name__ == "__main__":
    main()
