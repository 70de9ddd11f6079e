"""`modeltap generate`: run `model.generate()` and write every decoding step's module outputs."""

from __future__ import annotations

from pathlib import Path

from modeltap.cli.app import app, handle_errors, stderr
from modeltap.cli.inputs import offered_flags
from modeltap.cli.options import LOAD, PLACEMENT, SELECT, Given, command
from modeltap.cli.printing import note, print_generation
from modeltap.config import Settings
from modeltap.errors import InputError


@app.command()
@handle_errors
@command(
    "generate",
    "model",
    "text",
    "max_new_tokens",
    "do_sample",
    "seed",
    "temperature",
    "top_k",
    "top_p",
    "num_beams",
    "chat",
    "processor",
    *SELECT,
    "ops",
    "out",
    "full",
    "steps",
    "stats_only",
    "kv",
    "formats",
    "json_out",
    *LOAD,
    "dtype",
    "device",
    *PLACEMENT,
    "config",
    "max_inflight_mb",
)
def generate(s: Settings, given: Given, *, json_out: bool) -> None:
    """Generate from a prompt and write every decoding step's module outputs (gen/stepK/...)."""
    run_generate(s, json_out=json_out, class_given=given["model_class"] is not None)


def run_generate(s: Settings, *, json_out: bool, class_given: bool) -> None:
    import torch

    from modeltap.dump import check_writable
    from modeltap.generate import generate_model, prompt_inputs
    from modeltap.generate.requested import decoding, step_plan
    from modeltap.loading.generator import load_generator
    from modeltap.loading.resolve import processed_inputs, run_metadata
    from modeltap.selection import Selection

    if not s.model:
        raise InputError("no MODEL given; pass one, or set `model` in modeltap.toml")
    if not (s.texts or s.images or s.audio):
        raise InputError('no PROMPT given; e.g. modeltap generate gpt2 "The capital of France is"')
    plan = step_plan(s)
    formats = _formats(s)
    # Files through the model's processor (--chat: its chat template), checked before the
    # weights load; prompts alone go through the tokenizer (--chat: the tokenizer's template).
    if s.processor and not (s.images or s.audio):
        raise InputError("--processor takes image or audio FILEs; give some, or drop --processor")
    media = (
        processed_inputs(s, offered=offered_flags(), note=note) if s.images or s.audio else None
    )
    options = decoding(s)
    name = Path(s.model.rstrip("/\\")).name or "model"
    path = Path(s.out) if s.out else Path(f"{name}.gen.safetensors")
    check_writable(path)
    err = stderr()
    with err.status(f"loading {s.model}"):
        loaded, tok = load_generator(s, class_given=class_given, note=note)
    inputs = media if media is not None else prompt_inputs(loaded.model, tok, s.texts, chat=s.chat)
    inputs = inputs.to(loaded.device, getattr(torch, loaded.dtype))
    with err.status(f"generating with {loaded.model_class}"):
        done = generate_model(
            loaded.model,
            inputs,
            path,
            tokenizer=tok,
            decoding=options,
            plan=plan,
            selection=Selection(s.depth, tuple(s.include), tuple(s.exclude)),
            kv=s.kv,
            metadata=run_metadata(s, loaded),
            max_inflight=s.max_inflight_mb << 20,
            ops=s.ops,
            formats=formats,
        )
    from modeltap.dump import load_dump

    assert done.path is not None
    print_generation(load_dump(done.path), step=None, json_out=json_out)
    err.print(f"wrote {done.path} ({done.path.stat().st_size / 1e6:.1f} MB)")


def _formats(s: Settings) -> tuple[str, ...]:
    """--formats as names (checked before the model loads: an unknown one lists the known)."""
    from modeltap.stats.formats import check_formats

    return tuple(check_formats(s.formats.split(","))) if s.formats else ()
