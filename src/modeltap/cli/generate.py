"""`modeltap generate`: run `model.generate()` and write every decoding step's module outputs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from modeltap.cli.app import app, handle_errors, settings, stderr
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
from modeltap.config import Settings
from modeltap.errors import InputError, MissingWeightsError


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
    from modeltap.cli.dump import sorted_inputs

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


def step_plan(s: Settings) -> Any:
    """--full, --steps and --stats-only: at most one of them."""
    from modeltap.generate import StepPlan

    given = [name for name, on in (("--full", s.full), ("--steps", s.steps)) if on]
    given += ["--stats-only"] if s.stats_only else []
    if len(given) > 1:
        raise InputError(f"give one of {' and '.join(given)}: each says which steps keep tensors")
    if s.full:
        return StepPlan("all")
    if s.stats_only:
        return StepPlan("none")
    if s.steps:
        return StepPlan.parse(s.steps)
    return StepPlan()


def decoding(s: Settings) -> Any:
    from modeltap.generate import Decoding

    d = Decoding(
        s.max_new_tokens, s.do_sample, s.seed, s.temperature, s.top_k, s.top_p, s.num_beams
    )
    d.check()
    return d


def load_generator(s: Settings, *, class_given: bool) -> tuple[Any, Any]:
    """(loaded model, tokenizer): a model with its LM head unless --model-class says otherwise."""
    from modeltap.cli.dump import _placement, note_missing_weights
    from modeltap.loading import load_model, load_tokenizer

    name = s.model or ""
    model_class_name = s.model_class if class_given or s.model_class != "AutoModel" else None
    if model_class_name is None:
        model_class_name = _generative_class(s)
        _check_covered(s, model_class_name)
    if _placement(s) is not None:
        from modeltap.loading.placement import return_freed_memory

        return_freed_memory()
    try:
        loaded = load_model(
            name,
            revision=s.revision,
            model_class_name=model_class_name,
            dtype=s.dtype,
            device=s.device,
            trust_remote_code=s.trust_remote_code,
            device_map=s.device_map,
            max_memory=s.max_memory,
            offload_folder=s.offload_folder,
            allow_missing_weights=s.allow_missing_weights,
        )
    except MissingWeightsError as exc:
        from modeltap.loading.hf import describe_names

        raise MissingWeightsError(
            f"'{name}' has no weights for the head {exc.model_class} generates with "
            f"({len(exc.missing)} parameter(s): {describe_names(exc.missing)}), so its tokens "
            "would come from random weights; give a checkpoint saved with a language-modelling "
            "head, --model-class CLASS for one it has, or --allow-missing-weights to run it anyway",
            model_class=exc.model_class,
            missing=exc.missing,
        ) from exc
    note_missing_weights(loaded)
    from modeltap.generate import check_can_generate

    check_can_generate(loaded.model)
    where = s.tokenizer or loaded.source.path
    try:
        tok = load_tokenizer(where, trust_remote_code=s.trust_remote_code)
    except InputError as exc:  # its hint names --input-file, which generate does not take
        raise InputError(
            f"no tokenizer at '{where}' to read the prompt and the new tokens; pass --tokenizer"
        ) from exc
    return loaded, tok


def _generative_class(s: Settings) -> str:
    """AutoModelForImageTextToText with images, AutoModelForSpeechSeq2Seq with audio,
    AutoModelForSeq2SeqLM for an encoder-decoder, else AutoModelForCausalLM."""
    if s.images:
        return "AutoModelForImageTextToText"
    if s.audio:
        return "AutoModelForSpeechSeq2Seq"
    from modeltap.loading import resolve_model

    source = resolve_model(
        s.model or "", revision=s.revision, trust_remote_code=s.trust_remote_code
    )
    import transformers

    config = transformers.AutoConfig.from_pretrained(
        str(source.path), trust_remote_code=s.trust_remote_code
    )
    return "AutoModelForSeq2SeqLM" if config.is_encoder_decoder else "AutoModelForCausalLM"


def _check_covered(s: Settings, auto: str) -> None:
    """A model type the auto class has no generating class for (ViT, a classifier...) is one
    line naming the fix, not transformers' 'Unrecognized configuration class'."""
    import transformers

    from modeltap.loading import resolve_model

    mapping = getattr(getattr(transformers, auto, None), "_model_mapping", None)
    if mapping is None or s.trust_remote_code:
        return
    source = resolve_model(s.model or "", revision=s.revision)
    try:
        config = transformers.AutoConfig.from_pretrained(str(source.path))
    except (OSError, ValueError, KeyError):
        return  # load_model says what is wrong with it
    if type(config) in mapping:
        return
    name = s.model or ""
    saved = ", ".join(getattr(config, "architectures", None) or []) or config.model_type
    raise InputError(
        f"'{name}' ({saved}) can't generate text: {auto} has no class for "
        f"{config.model_type} models; give a model that generates (a causal LM, an "
        "encoder-decoder, a vision-language or speech model), or --model-class CLASS"
    )


def run_generate(s: Settings, *, json_out: bool, class_given: bool) -> None:
    import torch

    from modeltap.cli.dump import _processed_inputs, _run_metadata
    from modeltap.dump import check_writable
    from modeltap.generate import generate_model, prompt_inputs
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
    media = _processed_inputs(s) if s.images or s.audio else None
    options = decoding(s)
    name = Path(s.model.rstrip("/\\")).name or "model"
    path = Path(s.out) if s.out else Path(f"{name}.gen.safetensors")
    check_writable(path)
    err = stderr()
    with err.status(f"loading {s.model}"):
        loaded, tok = load_generator(s, class_given=class_given)
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
            metadata=_run_metadata(s, loaded),
            max_inflight=s.max_inflight_mb << 20,
        )
    from modeltap.cli.show import print_generation
    from modeltap.dump import load_dump

    assert done.path is not None
    print_generation(load_dump(done.path), step=None, json_out=json_out)
    err.print(f"wrote {done.path} ({done.path.stat().st_size / 1e6:.1f} MB)")


def print_generation_diff(
    a: Path,
    b: Path,
    s: Settings,
    tolerance: Any,
    overrides: Any,
    *,
    json_out: bool,
    show_all: bool,
    junit: Path | None,
    html: Path | None = None,
) -> bool:
    """`modeltap diff` of two generation dumps: the token split and each common step."""
    import json

    from modeltap.generation_diff import diff_generations

    unsupported = [
        flag
        for flag, given in (
            ("--map", s.map), ("--include", s.include), ("--exclude", s.exclude),
            ("--strict", s.strict), ("--junit", junit), ("--html", html),
        )
        if given
    ]  # fmt: skip
    if unsupported:
        raise InputError(
            f"{unsupported[0]} is for one-forward dumps; diff generation dumps without it, or "
            "one step of each with `modeltap show FILE --step K`"
        )
    report = diff_generations(
        a, b, tolerance=tolerance, overrides=overrides, equal_nan=s.equal_nan, upcast=s.upcast
    )
    if json_out:
        print(json.dumps(report.to_json(), indent=1))
        return report.passed
    from modeltap.cli.app import stdout
    from modeltap.render.generation import generation_diff_heading, generation_diff_table

    console = stdout()
    console.print(generation_diff_heading(report))
    console.print(generation_diff_table(report, show_all=show_all))
    return report.passed


def run_compare_generate(
    s: Settings,
    variant: Any,
    options: Any,
    work: Path | None,
    *,
    seed_given: bool,
    class_given: bool,
    json_out: bool,
    show_all: bool,
    refused: dict[str, Any],
) -> bool:
    """`compare --generate N`: load, run `compare_generation`, print; True when it passed.
    `options` are compare's (tolerance, overrides, the accumulated-rounding allowance...)."""
    import dataclasses
    import json
    import tempfile

    import torch

    from modeltap.cli.app import stdout, write_atomically
    from modeltap.cli.dump import _processed_inputs
    from modeltap.compare import make_candidate
    from modeltap.compare.generate import compare_generation
    from modeltap.compare.variants import compute_dtype, model_device
    from modeltap.generate import prompt_inputs
    from modeltap.loading import load_model
    from modeltap.selection import Selection

    refused = {
        **refused,
        "--input-file": s.input_file,
        "--train-mode": s.train_mode,
        "an image FILE": s.images,
    }
    given = [flag for flag, value in refused.items() if value]
    if given:
        raise InputError(f"{given[0]} is for one-forward comparisons; drop it with --generate")
    if s.do_sample and not seed_given:
        raise InputError(
            "--do-sample in compare needs --seed N: the candidate is forced to the tokens the "
            "reference sampled, and only a seeded reference run can be made again"
        )
    options_ = decoding(s)
    media = _processed_inputs(s) if s.audio else None  # before the weights load
    err = stderr()
    with err.status(f"loading {s.model}"):
        loaded, tok = load_generator(s, class_given=class_given)
        base = loaded.model
        if s.candidate is not None:
            other = load_model(
                s.candidate,
                revision=s.revision,
                model_class_name=type(loaded.model).__name__,
                dtype=s.dtype,
                device=s.device,
                trust_remote_code=s.trust_remote_code,
                allow_missing_weights=s.allow_missing_weights,
            )
            from modeltap.cli.dump import note_missing_weights

            note_missing_weights(other)
            from modeltap.compare.variants import check_same_architecture

            check_same_architecture(loaded.model, other.model, s.map, (s.model, s.candidate))
            base = other.model
        candidate = make_candidate(base, variant, shared=s.candidate is None)
    inputs = media if media is not None else prompt_inputs(loaded.model, tok, s.texts, chat=s.chat)
    inputs = inputs.to(loaded.device, getattr(torch, loaded.dtype))
    options = dataclasses.replace(options, rename=s.map)
    note = ""
    if variant.backend:
        from modeltap.compare.backends import COMPILED_RENAME, transform_for_generation
        from modeltap.loading import Inputs

        with err.status(f"{variant.backend} of the modules at --depth {s.depth}"):
            note = transform_for_generation(variant.backend, candidate, s.depth)
        # export can't carry the KV cache object: both sides decode without it (the note says so)
        inputs = Inputs(inputs.args, {**inputs.kwargs, "use_cache": False}, inputs.description)
        rename = list(s.map) + list(COMPILED_RENAME if variant.backend == "compile" else ())
        options = dataclasses.replace(options, rename=rename, replay_depth=s.depth)
    with tempfile.TemporaryDirectory(prefix="modeltap-compare-") as tmp:
        with err.status(f"generating with {loaded.model_class} and {variant.label}"):
            result = compare_generation(
                loaded.model,
                candidate,
                inputs,
                work or tmp,
                decoding=options_,
                selection=Selection(s.depth, tuple(s.include), tuple(s.exclude)),
                options=options,
                tokenizer=tok,
            )
    result.meta = {
        **({"note": note} if note else {}),
        "reference": {"model": s.model, "model_class": loaded.model_class, "dtype": loaded.dtype},
        "candidate": {
            "model": s.candidate or s.model,
            "variant": variant.label,
            "dtype": str(compute_dtype(candidate)).removeprefix("torch."),
            "device": str(model_device(candidate)),
        },
    }
    if work is not None:
        write_atomically(work / "report.json", json.dumps(result.to_json(), indent=1))
    if json_out:
        print(json.dumps(result.to_json(), indent=1))
    else:
        from modeltap.render.generation import compare_generation_heading, generation_diff_table

        console = stdout()
        console.print(compare_generation_heading(result))
        console.print(generation_diff_table(result.steps, show_all=show_all))
    if work is not None:
        err.print(
            f"wrote {work}/: candidate.gen.safetensors, reference.gen.safetensors, report.json"
        )
    return result.passed
