"""Issue 29 #22: the GPU figures, in one table (scripts/gpu_check.sh runs it after the CUDA tests).

    python scripts/gpu_check.py --device cuda          # a 1.1B Llama in bf16 on the GPU
    python scripts/gpu_check.py --device cpu --tiny    # the same flow, a tiny Llama, on the CPU

The model is built from a LlamaConfig (hidden 2048, intermediate 8192, 16 layers, 32 heads, 8 KV
heads, 32000 tokens: 1.10B parameters; seed 0, no download) and saved in bf16 with the tests'
byte-level BPE tokenizer (tests/fixtures/hf.py, laid out offline). Then:

  1. the commands as a user types them, each a process of its own: `modeltap dump`, `grads` and
     `generate` of the saved folder on a sentence, `--device DEVICE --dtype bfloat16`: exit
     status, seconds (start-up and loading included) and the file's size.
  2. the figures: each side in a fresh process that loads the model, makes 4 x 256 random ids
     (seed 0), runs its call once to warm up, then REPS timed calls, each ending with the device
     synchronized; the median, and the peak RSS (VmHWM, reset after the warm-up where Linux lets
     it be: else the process's peak, loading included, marked *) and the GPU's peak allocated
     memory over the timed calls. modeltap's sides take the statistics on the device and copy
     tensors through a pinned buffer with non-blocking copies, as every CUDA dump does
     (docs/performance.md: "For CUDA tensors").
       dump       dump_model (tensors + statistics)         / a bare forward
                                                            / bare hooks keeping each module's
                                                              output + safetensors' save_file
       stats      dump_model(stats_only=True)               / a bare forward
       grads      dump_model(grads=GradSpec(), activations=False), modeltap grads' call
                                                            / forward + backward, every module's
                                                              output gradient kept in memory
       generate   generate_model, 32 new tokens, statistics of every step, tensors of the first
                  and last                                  / model.generate, greedy, 32 tokens
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

SIDES = {  # figure -> (modeltap's side, the bare side)
    "dump": ("dump", "forward"),
    "bare-dump": ("dump", "bare-dump"),
    "stats": ("stats", "forward"),
    "grads": ("grads", "backward"),
    "generate": ("generate", "bare-generate"),
}
LABELS = {
    "dump": "dump / bare forward",
    "bare-dump": "dump / bare hooks + save_file",
    "stats": "statistics only / bare forward",
    "grads": "grads / forward + backward (hooks, in memory)",
    "generate": "generate, stats every step / bare generate",
}
TEXT = "modeltap dumps every layer of a transformer"


def shape(tiny: bool) -> dict:
    if tiny:
        return dict(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, batch=(2, 16), new_tokens=4, reps=1,
        )  # fmt: skip
    return dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, batch=(4, 256), new_tokens=32, reps=3,
    )  # fmt: skip


def build(folder: Path, tiny: bool, device: str) -> int:
    """Save the Llama (bf16) and a tokenizer into `folder`; returns its parameter count."""
    import torch
    from tests.fixtures.hf import gpt2_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes = {k: v for k, v in shape(tiny).items() if k not in ("batch", "new_tokens", "reps")}
    config = LlamaConfig(**sizes, max_position_embeddings=2048, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: no float32 copy of 1.1B weights
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config).to(torch.bfloat16).eval()  # whatever init made
    finally:
        torch.set_default_dtype(default)
    model.generation_config.eos_token_id = None  # every run makes all its new tokens
    model.generation_config.pad_token_id = 0
    model.save_pretrained(folder)
    gpt2_tokenizer().save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def _peak_rss_mb() -> float:
    status = Path("/proc/self/status").read_text().splitlines()
    return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def child(side: str, folder: Path, device: str, tiny: bool, out: Path) -> dict:
    """One side's figures in this fresh process."""
    import torch
    from transformers import AutoModelForCausalLM

    from modeltap.dumping import dump_model
    from modeltap.generate import Decoding, StepPlan, generate_model
    from modeltap.grads import GradSpec
    from modeltap.loading import Inputs

    size = shape(tiny)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map=device)
    model.eval()
    rows, length = size["batch"]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, size["vocab_size"], (rows, length), generator=generator).to(device)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if side in ("generate", "bare-generate"):  # a prompt of 16 tokens, then the new ones
        batch = {k: v[:, :16] for k, v in batch.items()}
    inputs = Inputs((), batch, {"gpu_check": True})
    new = size["new_tokens"]

    def forward() -> None:
        with torch.no_grad():
            model(**batch)

    def backward() -> None:  # every module's output gradient kept, as bench_perf's bare_grads
        grads: dict[str, torch.Tensor] = {}

        def keep(name: str):
            def hook(module, args, output) -> None:
                first = output[0] if isinstance(output, tuple) else output
                if isinstance(first, torch.Tensor) and first.requires_grad:
                    first.register_hook(lambda g: grads.__setitem__(name, g))

            return hook

        handles = [m.register_forward_hook(keep(n)) for n, m in model.named_modules()]
        try:
            model(**batch).logits.sum().backward()
        finally:
            for handle in handles:
                handle.remove()
            model.zero_grad(set_to_none=True)

    def bare_dump() -> None:  # as bench_perf's bare_dump: save_file copies each to the host
        from safetensors.torch import save_file

        kept: dict[str, torch.Tensor] = {}

        def keep(name: str):
            def hook(module, args, output) -> None:
                first = output[0] if isinstance(output, tuple) else output
                if isinstance(first, torch.Tensor):
                    kept[name or "root"] = first.detach()

            return hook

        handles = [m.register_forward_hook(keep(n)) for n, m in model.named_modules()]
        try:
            forward()
        finally:
            for handle in handles:
                handle.remove()
        unique, storages = {}, set()
        for key, t in kept.items():  # save_file refuses tensors that share memory
            storage = t.untyped_storage().data_ptr()
            unique[key] = t.clone() if storage in storages else t.contiguous()
            storages.add(storage)
        save_file(unique, str(out))

    def bare_generate() -> None:
        with torch.no_grad():
            model.generate(**batch, max_new_tokens=new, do_sample=False)

    calls = {
        "forward": forward,
        "backward": backward,
        "bare-generate": bare_generate,
        "bare-dump": bare_dump,
        "dump": lambda: dump_model(model, inputs, out),
        "stats": lambda: dump_model(model, inputs, out, stats_only=True),
        "grads": lambda: dump_model(model, inputs, out, grads=GradSpec(), activations=False),
        "generate": lambda: generate_model(
            model, inputs, out, decoding=Decoding(max_new_tokens=new), plan=StepPlan("ends")
        ),
    }
    call = calls[side]
    call()  # warm-up: kernels chosen, the pinned buffer and the writer thread started
    _sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:  # the peak RSS from here on (Linux), not the loading's
        Path("/proc/self/clear_refs").write_text("5")
        reset = True
    except OSError:
        reset = False
    seconds = []
    for _ in range(size["reps"]):
        out.unlink(missing_ok=True)
        _sync(device)
        start = time.perf_counter()
        call()
        _sync(device)
        seconds.append(time.perf_counter() - start)
    written = out.stat().st_size if out.exists() else 0
    out.unlink(missing_ok=True)
    return {
        "side": side,
        "seconds": statistics.median(seconds),
        "rss_mb": _peak_rss_mb()
        if reset
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_reset": reset,
        "gpu_mb": torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None,
        "file_mb": written / 1e6,
    }


def fresh(side: str, folder: Path, args: argparse.Namespace, scratch: Path) -> dict:
    command = [sys.executable, __file__, "--child", side, str(folder), "--device", args.device]
    command += ["--scratch", str(scratch)] + (["--tiny"] if args.tiny else [])
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise SystemExit(f"gpu_check: {side} failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def command(verb: str, folder: Path, args: argparse.Namespace, scratch: Path) -> tuple:
    """`modeltap VERB MODEL TEXT --device D --dtype bfloat16` as a user runs it."""
    out = scratch / f"{verb}.safetensors"
    line = [sys.executable, "-m", "modeltap", verb, str(folder), TEXT, "-o", str(out)]
    line += ["--device", args.device, "--dtype", "bfloat16"]
    if verb == "generate":
        line += ["--max-new-tokens", str(shape(args.tiny)["new_tokens"])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path[:2])}
    start = time.perf_counter()
    done = subprocess.run(line, capture_output=True, text=True, env=env, timeout=args.timeout)
    seconds = time.perf_counter() - start
    size = out.stat().st_size / 1e6 if out.exists() else 0.0
    out.unlink(missing_ok=True)
    error = "" if done.returncode == 0 else (done.stderr.strip().splitlines() or ["?"])[-1]
    return done.returncode, seconds, size, error


def _mb(value: float | None, exact: bool = True) -> str:
    return "-" if value is None else f"{value:,.0f}" + ("" if exact else "*")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny Llama (a dry run on the CPU)")
    parser.add_argument("--tests", default="", help="the CUDA tests' summary line, for the table")
    parser.add_argument("--timeout", type=int, default=240, help="seconds for each process")
    parser.add_argument("--child", nargs=2, metavar=("SIDE", "FOLDER"), help=argparse.SUPPRESS)
    parser.add_argument("--scratch", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        side, folder = args.child
        out = args.scratch / f"{side}.safetensors"
        print(json.dumps(child(side, Path(folder), args.device, args.tiny, out)))
        return

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: skipped, torch {torch.__version__} sees no CUDA GPU")
        return
    base = Path(os.environ.get("MODELTAP_BENCH_DIR") or tempfile.gettempdir())
    scratch = Path(tempfile.mkdtemp(prefix="gpu-check-", dir=base))
    try:
        started = time.perf_counter()
        folder = scratch / "llama"
        params = build(folder, args.tiny, args.device)
        built = time.perf_counter() - started
        where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
        rows, length = shape(args.tiny)["batch"]
        print(
            f"\n{where}, torch {torch.__version__}: Llama, {params / 1e6:,.1f}M parameters, bf16, "
            f"{rows} x {length} ids (generate: 16 + {shape(args.tiny)['new_tokens']}); "
            f"built and saved in {built:.0f} s\n"
        )
        verbs = ["dump", "grads", "generate"]
        commands = {verb: command(verb, folder, args, scratch) for verb in verbs}
        order = [side for pair in SIDES.values() for side in pair]
        sides = {side: fresh(side, folder, args, scratch) for side in dict.fromkeys(order)}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    print("| figure | modeltap s | bare s | ratio | peak RSS MB (modeltap / bare) "
          "| GPU peak MiB (modeltap / bare) | file MB |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    if args.tests:
        print(f"| CUDA tests | {args.tests} | | | | | |")
    failed = False
    for verb, (code, seconds, size, error) in commands.items():
        status = "exit 0" if code == 0 else f"exit {code}: {error}"
        failed |= code != 0
        print(f"| `modeltap {verb}` (one process) | {seconds:.1f} | | {status} | | | {size:,.1f} |")
    for figure, (mine, bare) in SIDES.items():
        a, b = sides[mine], sides[bare]
        print(
            f"| {LABELS[figure]} | {a['seconds']:.3f} | {b['seconds']:.3f} "
            f"| {a['seconds'] / b['seconds']:.2f} "
            f"| {_mb(a['rss_mb'], a['rss_reset'])} / {_mb(b['rss_mb'], b['rss_reset'])} "
            f"| {_mb(a['gpu_mb'])} / {_mb(b['gpu_mb'])} | {a['file_mb']:,.1f} |"
        )
    print(f"\ngpu_check: done in {time.perf_counter() - started:.0f} s")
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
