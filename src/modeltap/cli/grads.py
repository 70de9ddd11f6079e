"""`modeltap grads`: gradients w.r.t. the selected modules, in one backward."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from modeltap.cli.app import app, given, handle_errors, refuse, settings
from modeltap.cli.capturing import run_dump
from modeltap.cli.checks import refuse_unused
from modeltap.cli.inputs import sorted_inputs
from modeltap.cli.options import (
    OUTPUT,
    RUNNING,
    AllowMissingWeightsOpt,
    AudioDirOpt,
    AudioOpt,
    ChatOpt,
    ConfigOpt,
    DepthOpt,
    DeviceMapOpt,
    DeviceOpt,
    DTypeOpt,
    ExcludeOpt,
    ExplodingOpt,
    GradOutputOpt,
    ImageOpt,
    ImagesDirOpt,
    IncludeOpt,
    InputFileOpt,
    InputsArg,
    JacobianOpt,
    JsonOpt,
    LimitOpt,
    LossOpt,
    MaxLengthOpt,
    MaxMemoryOpt,
    ModelArg,
    ModelClassOpt,
    OffloadFolderOpt,
    ParamsOpt,
    ProbesOpt,
    ProcessorOpt,
    RevisionOpt,
    StatsOnlyOpt,
    TargetOpt,
    TextOpt,
    TokenizerOpt,
    TrainModeOpt,
    TrustOpt,
    VanishingOpt,
    WrtOpt,
)


@app.command()
@handle_errors
def grads(
    model: ModelArg = None,
    text: InputsArg = None,
    target: TargetOpt = None,
    wrt: WrtOpt = None,
    loss: LossOpt = None,
    grad_output: GradOutputOpt = None,
    params: ParamsOpt = None,
    jacobian_norm: JacobianOpt = None,
    probes: ProbesOpt = None,
    vanishing: VanishingOpt = None,
    exploding: ExplodingOpt = None,
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
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            "-o",
            help="Output file [default: <model name>.grads.safetensors].",
            metavar="FILE",
            rich_help_panel=OUTPUT,
        ),
    ] = None,
    stats_only: StatsOnlyOpt = None,
    json_out: JsonOpt = False,
    revision: RevisionOpt = None,
    model_class: ModelClassOpt = None,
    tokenizer: TokenizerOpt = None,
    max_length: MaxLengthOpt = None,
    trust_remote_code: TrustOpt = None,
    allow_missing_weights: AllowMissingWeightsOpt = None,
    dtype: DTypeOpt = None,
    device: DeviceOpt = None,
    seed: Annotated[
        int | None,
        typer.Option(
            help="Seed of the run and of random probes [default: 0].",
            metavar="N",
            rich_help_panel=RUNNING,
        ),
    ] = None,
    train_mode: TrainModeOpt = None,
    device_map: DeviceMapOpt = None,
    max_memory: MaxMemoryOpt = None,
    offload_folder: OffloadFolderOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Gradients of a module's output (or a loss) with respect to the selected modules' outputs,
    in one backward."""
    s = settings(
        "grads",
        config,
        model=model,
        **sorted_inputs(text, image, audio, text_opt, images_dir, audio_dir, limit),
        processor=processor,
        chat=chat,
        input_file=str(input_file) if input_file else None,
        depth=depth,
        include=include or [],
        exclude=exclude or [],
        out=str(out) if out else None,
        stats_only=stats_only,
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
        target=target,
        wrt=wrt or [],
        loss=loss,
        grad_output=grad_output,
        params=params,
        jacobian_norm=jacobian_norm,
        probes=probes,
        vanishing=vanishing,
        exploding=exploding,
        device_map=device_map.value if device_map else None,
        max_memory=max_memory,
        offload_folder=str(offload_folder) if offload_folder else None,
    )
    refuse_unused(
        s,
        device=device,
        device_map=device_map,
        grads=True,
        revision=revision,
        model_class=model_class,
        max_length=max_length,
        tokenizer=tokenizer,
    )
    if not s.jacobian_norm:
        refuse(
            given(probes=probes),
            "can't apply without --jacobian-norm",
            "add --jacobian-norm K or drop {flags}",
        )
    run_dump(s, json_out=json_out, grads=True, activations=False)
