"""`modeltap generate`: run `model.generate()` and write every decoding step's module outputs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from modeltap.cli.app import app, handle_errors, settings, stderr
from modeltap.cli.inputs import offered_flags, sorted_inputs
from modeltap.cli.options import (
    LOADING,
    OUTPUT,
    AllowMissingWeightsOpt,
    ConfigOpt,
    DepthOpt,
    DeviceMapOpt,
    DeviceOpt,
    DoSampleOpt,
    DTypeOpt,
    ExcludeOpt,
    HfTokenizerOpt,
    IncludeOpt,
    JsonOpt,
    MaxInflightOpt,
    MaxMemoryOpt,
    MaxNewTokensOpt,
    NumBeamsOpt,
    OffloadFolderOpt,
    ProcessorOpt,
    PromptChatOpt,
    RevisionOpt,
    SeedOpt,
    StatsOnlyOpt,
    TemperatureOpt,
    TopKOpt,
    TopPOpt,
    TrustOpt,
)
from modeltap.cli.printing import note, print_generation
from modeltap.config import Settings
from modeltap.errors import InputError


@app.command()
@handle_errors
def generate(
    model: Annotated[
        str | None,
        typer.Argument(
            help="Hugging Face model id or folder with config.json, of a model that generates.",
            metavar="MODEL",
        ),
    ] = None,
    prompt: Annotated[
        list[str] | None,
        typer.Argument(
            help="Prompts, generated from as one left-padded batch; image or audio files (by "
            "content) go with them through the model's processor (a vision-language or speech "
            "model).",
            metavar="PROMPT|FILE",
        ),
    ] = None,
    max_new_tokens: MaxNewTokensOpt = None,
    do_sample: DoSampleOpt = None,
    seed: SeedOpt = None,
    temperature: TemperatureOpt = None,
    top_k: TopKOpt = None,
    top_p: TopPOpt = None,
    num_beams: NumBeamsOpt = None,
    chat: PromptChatOpt = None,
    processor: ProcessorOpt = None,
    depth: DepthOpt = None,
    include: IncludeOpt = None,
    exclude: ExcludeOpt = None,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            "-o",
            help="Dump file [default: <model name>.gen.safetensors].",
            rich_help_panel=OUTPUT,
            metavar="FILE",
        ),
    ] = None,
    full: Annotated[
        bool | None,
        typer.Option(
            "--full/--ends",
            help="Tensors of every step [default: of the prefill and the last step; statistics "
            "for the others].",
            rich_help_panel=OUTPUT,
        ),
    ] = None,
    steps: Annotated[
        str | None,
        typer.Option(
            help="Tensors of these steps only, e.g. 0,5-9 (step 0 is the prompt's forward).",
            metavar="LIST",
            rich_help_panel=OUTPUT,
        ),
    ] = None,
    stats_only: StatsOnlyOpt = None,
    kv: Annotated[
        bool | None,
        typer.Option(
            "--kv/--no-kv",
            help="Also store each step's new self-attention keys and values (cache:LAYER.key).",
            rich_help_panel=OUTPUT,
        ),
    ] = None,
    json_out: JsonOpt = False,
    revision: RevisionOpt = None,
    model_class: Annotated[
        str | None,
        typer.Option(
            help="transformers class to load with [default: AutoModelForCausalLM; "
            "AutoModelForSeq2SeqLM for an encoder-decoder, AutoModelForSpeechSeq2Seq with "
            "audio, AutoModelForImageTextToText with images].",
            show_default=False,
            rich_help_panel=LOADING,
            metavar="CLASS",
        ),
    ] = None,
    tokenizer: HfTokenizerOpt = None,
    trust_remote_code: TrustOpt = None,
    allow_missing_weights: AllowMissingWeightsOpt = None,
    dtype: DTypeOpt = None,
    device: DeviceOpt = None,
    device_map: DeviceMapOpt = None,
    max_memory: MaxMemoryOpt = None,
    offload_folder: OffloadFolderOpt = None,
    config: ConfigOpt = None,
    max_inflight: MaxInflightOpt = None,
) -> None:
    """Generate from a prompt and write every decoding step's module outputs (gen/stepK/...)."""
    s = settings(
        "generate",
        config,
        model=model,
        **sorted_inputs(prompt, None, None, None),
        processor=processor,
        max_new_tokens=max_new_tokens,
        do_sample=do_sample,
        seed=seed,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        num_beams=num_beams,
        chat=chat,
        depth=depth,
        include=include or [],
        exclude=exclude or [],
        out=str(out) if out else None,
        full=full,
        steps=steps,
        stats_only=stats_only,
        kv=kv,
        revision=revision,
        model_class=model_class,
        tokenizer=tokenizer,
        trust_remote_code=trust_remote_code,
        allow_missing_weights=allow_missing_weights,
        dtype=dtype.value if dtype else None,
        device=device.value if device else None,
        device_map=device_map.value if device_map else None,
        max_memory=max_memory,
        offload_folder=str(offload_folder) if offload_folder else None,
        max_inflight_mb=max_inflight,
    )
    run_generate(s, json_out=json_out, class_given=model_class is not None)


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
        )
    from modeltap.dump import load_dump

    assert done.path is not None
    print_generation(load_dump(done.path), step=None, json_out=json_out)
    err.print(f"wrote {done.path} ({done.path.stat().st_size / 1e6:.1f} MB)")
