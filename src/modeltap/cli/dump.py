"""`modeltap dump`: run a model and write every selected module's output."""

from __future__ import annotations

from typing import Annotated

import typer

from modeltap.cli.app import app, given, handle_errors, refuse, settings
from modeltap.cli.capturing import run_dump
from modeltap.cli.checks import refuse_unused
from modeltap.cli.inputs import sorted_inputs
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
