"""`modeltap dump`: run a model and write every selected module's output."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from modeltap.cli.app import app, given, handle_errors, refuse, settings, stderr
from modeltap.cli.options import (
    GRADIENTS,
    OUTPUT,
    SELECTION,
    AllowMissingWeightsOpt,
    AllowPickleOpt,
    AudioDirOpt,
    AudioOpt,
    ChatOpt,
    CompileBackendOpt,
    CompileOpt,
    ConfigOpt,
    DepthOpt,
    DeviceMapOpt,
    DeviceOpt,
    DTypeOpt,
    ExcludeOpt,
    FullgraphOpt,
    GradOutputOpt,
    HistOpt,
    ImageOpt,
    ImagesDirOpt,
    IncludeOpt,
    InputFileOpt,
    InputsArg,
    JsonOpt,
    LimitOpt,
    LossOpt,
    MaxInflightOpt,
    MaxLengthOpt,
    MaxMemoryOpt,
    ModelArg,
    ModelClassOpt,
    OffloadFolderOpt,
    OutOpt,
    ParamsOpt,
    ProcessorOpt,
    RevisionOpt,
    SeedOpt,
    StatsOnlyOpt,
    TargetOpt,
    TextOpt,
    TokenizerOpt,
    TrainModeOpt,
    TrustOpt,
)
from modeltap.config import Settings
from modeltap.errors import InputError


@app.command()
@handle_errors
def dump(
    model: ModelArg = None,
    text: InputsArg = None,
    image: ImageOpt = None,
    audio: AudioOpt = None,
    text_opt: TextOpt = None,
    images_dir: ImagesDirOpt = None,
    audio_dir: AudioDirOpt = None,
    limit: LimitOpt = None,
    processor: ProcessorOpt = None,
    chat: ChatOpt = None,
    input_file: InputFileOpt = None,
    depth: DepthOpt = None,
    include: IncludeOpt = None,
    exclude: ExcludeOpt = None,
    inputs: Annotated[
        bool | None,
        typer.Option(
            "--inputs/--no-inputs", help="Also capture module inputs.", rich_help_panel=SELECTION
        ),
    ] = None,
    out: OutOpt = None,
    stats_only: StatsOnlyOpt = None,
    hist: HistOpt = None,
    json_out: JsonOpt = False,
    revision: RevisionOpt = None,
    model_class: ModelClassOpt = None,
    tokenizer: TokenizerOpt = None,
    max_length: MaxLengthOpt = None,
    trust_remote_code: TrustOpt = None,
    allow_missing_weights: AllowMissingWeightsOpt = None,
    dtype: DTypeOpt = None,
    device: DeviceOpt = None,
    seed: SeedOpt = None,
    train_mode: TrainModeOpt = None,
    dead_threshold: Annotated[
        float | None,
        typer.Option(
            help="A unit is dead when never above this [default: 0].",
            metavar="X",
            rich_help_panel=OUTPUT,
        ),
    ] = None,
    grads: Annotated[
        bool | None,
        typer.Option(
            "--grads/--no-grads",
            help="Also store gradients (see `modeltap grads`).",
            rich_help_panel=GRADIENTS,
        ),
    ] = None,
    target: TargetOpt = None,
    loss: LossOpt = None,
    grad_output: GradOutputOpt = None,
    params: ParamsOpt = None,
    device_map: DeviceMapOpt = None,
    max_memory: MaxMemoryOpt = None,
    offload_folder: OffloadFolderOpt = None,
    compile: CompileOpt = None,
    compile_backend: CompileBackendOpt = None,
    fullgraph: FullgraphOpt = None,
    allow_pickle: AllowPickleOpt = None,
    config: ConfigOpt = None,
    max_inflight: MaxInflightOpt = None,
) -> None:
    """Run a model on text, images, audio or tensors and write every selected module's output."""
    s = settings(
        "dump",
        config,
        model=model,
        **sorted_inputs(text, image, audio, text_opt, images_dir, audio_dir, limit),
        processor=processor,
        chat=chat,
        input_file=str(input_file) if input_file else None,
        depth=depth,
        include=include or [],
        exclude=exclude or [],
        inputs=inputs,
        out=str(out) if out else None,
        stats_only=stats_only,
        hist=hist,
        revision=revision,
        model_class=model_class,
        tokenizer=tokenizer,
        max_length=max_length,
        trust_remote_code=trust_remote_code,
        allow_missing_weights=allow_missing_weights,
        dtype=dtype.value if dtype else None,
        device=device.value if device else None,
        seed=seed,
        train_mode=train_mode,
        dead_threshold=dead_threshold,
        grads=grads,
        target=target,
        loss=loss,
        grad_output=grad_output,
        params=params,
        device_map=device_map.value if device_map else None,
        max_memory=max_memory,
        offload_folder=str(offload_folder) if offload_folder else None,
        compile=compile,
        compile_backend=compile_backend,
        fullgraph=fullgraph,
        max_inflight_mb=max_inflight,
    )
    refuse_unused(
        s,
        device=device,
        device_map=device_map,
        grads=s.grads,
        revision=revision,
        model_class=model_class,
        allow_pickle=allow_pickle,
        max_length=max_length,
        tokenizer=tokenizer,
    )
    if not s.compile:
        refuse(
            given(compile_backend=compile_backend, fullgraph=fullgraph),
            "can't apply without --compile",
            "add --compile or drop {flags}",
        )
    if not s.grads:
        refuse(
            given(target=target, loss=loss, grad_output=grad_output, params=params),
            "can't apply without --grads",
            "add --grads or drop {flags}",
        )
    # a command-line flag only: no config file or environment may turn it on
    run_dump(s, json_out=json_out, grads=s.grads, activations=True, allow_pickle=bool(allow_pickle))


def refuse_unused(s: Settings, *, device: Any, device_map: Any, grads: bool, **flags: Any) -> None:
    """Options that cannot apply to this run are errors before anything loads, not ignored
    (each flag's value is the command line's, None when not given): --device with --device-map
    (a config file's device is checked with the map in `_placement`); --max-length and
    --tokenizer without TEXT; Hub options, --dtype and --device with an archive or a factory;
    gradients or --compile with an archive; --allow-pickle with anything but a .pt2."""
    if device is not None and device_map is not None:
        raise InputError(
            f"give --device {device.value} or --device-map {device_map.value}, not both"
        )
    if not s.texts:
        refuse(given(max_length=flags.get("max_length")), "can't apply without TEXT")
        if not (grads and s.loss == "mlm"):  # the tokenizer's mask token
            refuse(given(tokenizer=flags.get("tokenizer")), "can't apply without TEXT")
    if not s.model:
        return
    if _is_transformed(s.model):
        refuse(
            given(revision=flags.get("revision"), model_class=flags.get("model_class"))
            + given(device_map=device_map),
            f"can't apply to '{s.model}', an archive or a factory (they load Hugging Face models)",
        )
        if s.dtype != "float32" or s.device != "cpu":
            raise InputError("archives and factories run on cpu in float32; drop --dtype/--device")
    from modeltap.loading.archive import is_archive_path

    if is_archive_path(s.model):  # checked again once loaded; a factory may give either
        if grads:
            raise InputError(f"gradients need the eager model; dump '{s.model}' without --grads")
        if s.compile:
            raise InputError("--compile runs an nn.Module; an archive runs as it is")
    refuse_pickle_flag(s.model, flags.get("allow_pickle"))


def refuse_pickle_flag(model: str, allow_pickle: bool | None) -> None:
    """--allow-pickle (or --no-allow-pickle) only means something for a .pt2."""
    from modeltap.loading.archive import PT2_SUFFIXES

    if Path(model).suffix.lower() not in PT2_SUFFIXES:
        refuse(
            given(allow_pickle=allow_pickle),
            f"can't apply to '{model}' (only a .pt2 archive is unpickled)",
        )


def sorted_inputs(
    positionals: list[str] | None,
    images: list[Path] | None,
    audio: list[Path] | None,
    texts: list[str] | None,
    images_dir: Path | None = None,
    audio_dir: Path | None = None,
    limit: int | None = None,
) -> dict[str, Any]:
    """Positional values sorted into texts, images and audio (files by content), with the files
    of --images-dir / --audio-dir, for settings(); nothing given stays unset, so a config file's
    `texts` still applies."""
    from modeltap.loading.processors import Kind, folder_files, sort_inputs

    if limit is not None and images_dir is None and audio_dir is None:
        raise InputError(
            "--batch/--limit counts the files of --images-dir or --audio-dir; give one"
        )
    media = sort_inputs(
        positionals or [],
        images=images or [],
        audio=audio or [],
        texts=texts or [],
        offered=offered_flags(),
    )
    if images_dir is not None:
        media.images += folder_files(images_dir, Kind.image, limit=limit)
    if audio_dir is not None:
        media.audio += folder_files(audio_dir, Kind.audio, limit=limit)
    return {
        "texts": media.texts or None,
        "images": [str(p) for p in media.images] or None,
        "audio": [str(p) for p in media.audio] or None,
    }


def run_dump(
    s: Settings, *, json_out: bool, grads: bool, activations: bool, allow_pickle: bool = False
) -> None:
    """dump and grads: check, load, run, write, print."""
    from modeltap.dump import check_writable
    from modeltap.run import default_out

    spec = None
    if grads:
        from modeltap.grads import GradSpec

        spec = GradSpec(
            target=s.target,
            wrt=tuple(s.wrt),
            loss=s.loss,
            grad_output=s.grad_output,
            params=s.params,
            jacobian_norm=s.jacobian_norm,
            probes=s.probes,
            vanishing=s.vanishing,
            exploding=s.exploding,
        )
        spec.check()
        if s.inputs:
            raise InputError("--inputs is for activations only; drop it with gradients")
    if not s.model:
        raise InputError("no MODEL given; pass one, or set `model` in modeltap.toml")
    if (s.texts or s.images or s.audio) and s.input_file:
        raise InputError("give TEXT or FILEs, or --input-file, not both")
    transformed = _is_transformed(s.model)
    if not (s.texts or s.images or s.audio or s.input_file or transformed):
        raise InputError("nothing to run on; give TEXT, an image or audio FILE, or --input-file")
    if s.max_inflight_mb < 0:
        raise InputError(f"--max-inflight is {s.max_inflight_mb}; give MiB >= 0 (0 writes inline)")
    path = Path(s.out) if s.out else default_out(s.model, grads_only=not activations)
    check_writable(path)
    if _placement(s) is not None:
        from modeltap.loading.placement import return_freed_memory

        return_freed_memory()
    backend = None
    if s.compile:
        from modeltap.capture.compile import CompileBackend, check_backend

        check_backend(s.compile_backend)
        backend = CompileBackend(s.compile_backend, s.fullgraph)

    file_inputs_ = None if transformed else _check_before_loading(s)

    err = stderr()
    with err.status(f"loading {s.model}"):
        if transformed:
            loaded, inputs_, tok, transformed_backend = _load_transformed(s, allow_pickle)
            if transformed_backend is not None:
                if backend is not None:
                    raise InputError("--compile runs an nn.Module; an archive runs as it is")
                if spec is not None:
                    raise InputError(
                        f"gradients need the eager model; dump '{s.model}' without --grads"
                    )
                backend = transformed_backend
        else:
            loaded, inputs_, tok = _load_with_inputs(
                s, need_tokenizer=s.loss == "mlm", file_inputs_=file_inputs_
            )
    from modeltap.run import dump_model
    from modeltap.selection import Selection

    with err.status(f"running {loaded.model_class}"):
        written = dump_model(
            loaded.model,
            inputs_,
            path,
            selection=Selection(s.depth, tuple(s.include), tuple(s.exclude)),
            capture_inputs=s.inputs,
            train_mode=s.train_mode,
            seed=s.seed,
            stats_only=s.stats_only,
            dead_threshold=s.dead_threshold,
            metadata=_run_metadata(s, loaded),
            grads=spec,
            activations=activations,
            mask_token_id=getattr(tok, "mask_token_id", None),
            special_ids=tuple(getattr(tok, "all_special_ids", ())),
            backend=backend,
            max_inflight=s.max_inflight_mb << 20,
            hist=s.hist,
        )
    from modeltap.cli.show import print_opened
    from modeltap.dump import load_dump

    opened = load_dump(written)
    print_opened(opened, json_out=json_out)
    _print_backend(err, opened.metadata)
    if getattr(loaded, "device_map", None):
        counts: dict[str, int] = {}
        for device in loaded.device_map.values():
            where = f"gpu {device}" if isinstance(device, int) else str(device)
            counts[where] = counts.get(where, 0) + 1
        placed = ", ".join(f"{n} on {d}" for d, n in counts.items())
        err.print(f"placed by accelerate: {placed} (`modeltap ls --device-map` lists them)")
    err.print(f"wrote {written} ({written.stat().st_size / 1e6:.1f} MB)")


def _print_backend(err: Any, meta: dict[str, str]) -> None:
    """Compile time apart from run time, graph breaks and unmapped modules, on stderr."""
    import json

    details = json.loads(meta.get("backend_details") or "{}")
    if meta.get("backend") == "compile" and "first_call_s" in details:
        err.print(
            f"torch.compile ({details['compile_backend']}): {details['graphs']} graph(s), "
            f"first call (compile) {details['first_call_s']:.1f} s, run {details['run_s']:.3f} s"
            + (f", statistics {details['statistics']}" if "statistics" in details else "")
        )
    elif meta.get("backend") == "compile":
        err.print(f"torch.compile: {details.get('graphs')} graph(s) with gradient hooks")
    changed = details.get("changed_after_return") or []
    if changed:
        err.print(
            f"note: {len(changed)} module output(s) changed in place after a graph break, "
            "recorded as returned (copied): "
            + ", ".join(changed[:4])
            + (" ..." if len(changed) > 4 else "")
        )
    if details.get("output_record") is False and meta.get("backend") == "fx":
        err.print(
            "note: this GraphModule has no record of the modules' eager output structure: a "
            "module returning a tuple is keyed by the values that leave it (one: a bare key; "
            "several: :0, :1 in graph order); trace it with "
            "modeltap.capture.fx.trace(model, *inputs) for the eager keys"
        )
    elif details.get("output_record") is False:
        if meta.get("backend") == "export":
            what, fix = "program has modules without call signatures and", "keeps the signatures"
        else:
            what, fix = "trace has", "traces with one (-o NAME.pt)"
        err.print(
            f"note: this {what} no record of the modules' eager output structure: a module "
            "returning (tensor, None) or a ModelOutput is keyed by its bare value; "
            f"`modeltap export` {fix}"
        )
    odd = details.get("structure_unmatched", []) + details.get("parts_not_in_graph", [])
    if odd:
        err.print(
            f"note: {len(odd)} value(s) not mapped onto the eager structure (see "
            "backend_details): " + ", ".join(odd[:4]) + (" ..." if len(odd) > 4 else "")
        )
    unmapped = json.loads(meta.get("unmapped") or "[]")
    if unmapped:
        shown = ", ".join(unmapped[:4]) + (
            f" and {len(unmapped) - 4} more" if len(unmapped) > 4 else ""
        )
        err.print(
            f"no value from {len(unmapped)} selected module(s) (never called, or unmappable): "
            + shown
        )


def _check_before_loading(s: Settings) -> Any:
    """What can be checked without the weights is checked first, not after seconds of loading:
    the input file (read now, returned), and the selection globs against the module tree built
    on the meta device."""
    from modeltap.loading import file_inputs, load_meta_model
    from modeltap.selection import Selection, select_modules

    inputs_ = file_inputs(s.input_file) if s.input_file else _processed_inputs(s)
    if s.include or s.exclude or s.depth is not None:
        try:
            meta_model, _ = load_meta_model(
                s.model or "",
                revision=s.revision,
                model_class_name=s.model_class,
                trust_remote_code=s.trust_remote_code,
            )
        except Exception:  # noqa: BLE001 - the real load reports what is wrong with the model
            return inputs_
        select_modules(meta_model, Selection(s.depth, tuple(s.include), tuple(s.exclude)))
    return inputs_


def _processed_inputs(s: Settings, where: str | None = None) -> Any:
    """Images and audio (with any texts) through the model's processor, or None without files,
    --processor or --chat: a bad file or a processor that can't take them is found before the
    weights load."""
    if not (s.images or s.audio or s.processor or s.chat):
        return None
    from modeltap.loading.processors import Media, load_processor, processor_inputs

    offered = offered_flags()
    processor = load_processor(
        s.processor or where or s.model or "",
        revision=None if s.processor else s.revision,
        trust_remote_code=s.trust_remote_code,
        offered=offered,
    )
    media = Media(list(s.texts), [Path(p) for p in s.images], [Path(p) for p in s.audio])
    inputs_ = processor_inputs(
        processor, media, max_length=s.max_length, chat=s.chat, offered=offered
    )
    for entry in inputs_.description.get("files", []):
        if "window_s" in entry:
            stderr().print(
                f"note: {entry['file']} is {entry['seconds']:g} s long and the feature "
                f"extractor takes its first {entry['window_s']:g} s only (its window; recorded "
                "in the dump's inputs)",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
    return inputs_


def _placement(s: Settings) -> Any:
    """Placement options checked together, before any work (load_model checks them again)."""
    from modeltap.loading.placement import placement

    if s.device_map and s.device != "cpu":
        raise InputError(f"give --device {s.device} or --device-map {s.device_map}, not both")
    return placement(s.device_map, s.max_memory, s.offload_folder)


def _load_with_inputs(
    s: Settings, *, need_tokenizer: bool = False, file_inputs_: Any = None
) -> tuple[Any, Any, Any]:
    import torch

    from modeltap.loading import (
        add_decoder_inputs,
        check_length,
        check_paired_inputs,
        file_inputs,
        load_model,
        load_tokenizer,
        text_inputs,
    )

    loaded = load_model(
        s.model or "",
        revision=s.revision,
        model_class_name=s.model_class,
        dtype=s.dtype,
        device=s.device,
        trust_remote_code=s.trust_remote_code,
        device_map=s.device_map,
        max_memory=s.max_memory,
        offload_folder=s.offload_folder,
        allow_missing_weights=s.allow_missing_weights,
    )
    note_missing_weights(loaded)
    if file_inputs_ is None and not s.input_file:
        file_inputs_ = _processed_inputs(s, str(loaded.source.path))
    tok = None
    if (s.texts and file_inputs_ is None) or need_tokenizer:
        where = s.tokenizer or loaded.source.path
        tok = load_tokenizer(where, trust_remote_code=s.trust_remote_code)
    if file_inputs_ is not None:
        inputs_ = file_inputs_
    elif s.texts:
        inputs_ = text_inputs(tok, s.texts, max_length=s.max_length)
    else:
        inputs_ = file_inputs(s.input_file or "")
    check_length(loaded.model, inputs_)
    check_paired_inputs(loaded.model, inputs_, command=f"modeltap {command_name()}")
    inputs_ = add_decoder_inputs(loaded.model, inputs_)
    return loaded, inputs_.to(loaded.device, getattr(torch, loaded.dtype)), tok


def _current_context() -> Any:
    """The click context of the command being run, or None outside one."""
    try:  # typer 0.2x runs on its own copy of click
        from typer._click.globals import get_current_context
    except ImportError:
        from click import get_current_context
    return get_current_context(silent=True)


def command_name() -> str:
    """The command being run (dump, grads, compare...), for messages that show one."""
    ctx = _current_context()
    return (ctx.info_name if ctx is not None else None) or "dump"


def offered_flags() -> frozenset[str] | None:
    """Every flag of the command being run, so that a hint names only options it has; None
    outside a command (every hint)."""
    ctx = _current_context()
    if ctx is None:
        return None
    return frozenset(
        opt
        for param in ctx.command.params
        if param.param_type_name == "option"
        for opt in (*param.opts, *param.secondary_opts)
    )


def note_missing_weights(loaded: Any) -> None:
    """One line on stderr for a model loaded with --allow-missing-weights that lacked some."""
    missing = getattr(loaded, "missing_weights", None)
    if missing:
        from modeltap.loading.hf import describe_names

        stderr().print(
            f"note: {loaded.source.name} has no weights for {len(missing)} parameter(s) "
            f"of {loaded.model_class} ({describe_names(missing)}): they run randomly "
            "initialised (--allow-missing-weights; listed as missing_weights in the metadata)",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )


def _is_transformed(model: str) -> bool:
    """A .pt2 / TorchScript archive or a `pkg.module:factory`, rather than a Hub id or folder."""
    from modeltap.loading.archive import is_archive_path
    from modeltap.loading.factory import is_factory

    return is_archive_path(model) or is_factory(model)


def _load_transformed(s: Settings, allow_pickle: bool = False) -> tuple[Any, Any, Any, Any]:
    """(loaded, inputs, tokenizer, backend or None) for an archive or a factory."""
    import torch

    from modeltap.loading import ModelSource, file_inputs, load_tokenizer, text_inputs
    from modeltap.loading.archive import ArchiveKind, archive_kind, is_archive_path
    from modeltap.loading.hf import Loaded
    from modeltap.loading.inputs import Inputs

    model_name = s.model or ""
    example: Inputs | None = None
    backend: Any = None
    if is_archive_path(model_name):
        path = Path(model_name)
        kind = archive_kind(path)
        if kind is ArchiveKind.export:
            from modeltap.capture.export import ExportBackend, module_names, skeleton
            from modeltap.loading.archive import example_inputs, load_pt2

            program = load_pt2(path, allow_pickle=allow_pickle)
            model = skeleton(module_names(program))
            backend = ExportBackend(program, source=path.name)
            example = example_inputs(program)
            model_class = f"ExportedProgram({_root_class(program)})"
        else:
            from modeltap.capture.torchscript import TorchScriptBackend, script_skeleton
            from modeltap.loading.archive import load_torchscript, torchscript_outputs

            script = load_torchscript(path)
            backend = TorchScriptBackend(
                script, source=path.name, outputs=torchscript_outputs(path)
            )
            model = script_skeleton(script)
            model_class = f"TorchScript({script.original_name})"
        source = ModelSource(model_name, path.parent)
    else:
        from modeltap.loading.factory import load_factory

        made = load_factory(model_name)
        model, example = made.module, made.example
        if made.graph_module:
            from modeltap.capture.fx import FxBackend

            backend = FxBackend()
        model_class = type(model).__name__
        source = ModelSource(model_name, Path.cwd())
    loaded = Loaded(model, source, model_class=model_class)
    tok = None
    if s.images or s.audio:
        if not s.processor:
            raise InputError(
                f"'{model_name}' holds no processor for images or audio; pass --processor "
                "(e.g. the model's folder) or give tensors with --input-file"
            )
        inputs_ = _processed_inputs(s)
    elif s.texts:
        if not s.tokenizer:
            raise InputError(
                f"'{model_name}' holds no tokenizer; pass --tokenizer (e.g. the model's folder) "
                "or give tensors with --input-file"
            )
        tok = load_tokenizer(s.tokenizer, trust_remote_code=s.trust_remote_code)
        inputs_ = text_inputs(tok, s.texts, max_length=s.max_length)
    elif s.input_file:
        inputs_ = file_inputs(s.input_file)
    elif example is not None:
        inputs_ = example
    else:
        raise InputError(f"'{model_name}' has no example inputs; give TEXT or --input-file")
    if s.dtype != "float32" or s.device != "cpu":
        raise InputError("archives and factories run on cpu in float32; drop --dtype/--device")
    return loaded, inputs_.to("cpu", torch.float32), tok, backend


def _module_tree(model_name: str, allow_pickle: bool = False) -> Any:
    """The module tree of an archive or a factory's module, for `ls` (an archive's only
    pickle-free parts are read: a .pt2 that needs pickle is refused as for dump)."""
    from modeltap.loading.archive import ArchiveKind, archive_kind, is_archive_path

    if is_archive_path(model_name):
        path = Path(model_name)
        if archive_kind(path) is ArchiveKind.export:
            from modeltap.capture.export import module_names, parameter_shapes, skeleton
            from modeltap.loading.archive import load_pt2, pt2_module_classes

            program = load_pt2(path, allow_pickle=allow_pickle)
            names = module_names(program, pt2_module_classes(path))
            return skeleton(names, parameter_shapes(program))
        from modeltap.capture.torchscript import script_skeleton
        from modeltap.loading.archive import load_torchscript

        return script_skeleton(load_torchscript(path), parameters=True)
    from modeltap.loading.factory import load_factory

    return load_factory(model_name).module


def _root_class(program: Any) -> str:
    from modeltap.capture.export import module_names

    return module_names(program).get("__root__", "Module")


def _run_metadata(s: Settings, loaded: Any) -> dict[str, str]:
    import json

    meta = {"model": s.model or "", "dtype": loaded.dtype, "device": loaded.device}
    if loaded.device_map is not None:
        meta["device_map"] = json.dumps({k: str(v) for k, v in loaded.device_map.items()})
    if loaded.source.revision:
        meta["revision"] = loaded.source.revision
    if getattr(loaded, "missing_weights", None):
        meta["missing_weights"] = json.dumps(loaded.missing_weights)
    return meta
