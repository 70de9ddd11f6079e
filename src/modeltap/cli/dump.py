"""`modeltap dump`: run a model and write every selected module's output."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from modeltap.cli.app import app, handle_errors, settings, stderr
from modeltap.cli.options import (
    ConfigOpt,
    DepthOpt,
    DeviceOpt,
    DTypeOpt,
    ExcludeOpt,
    GradOutputOpt,
    IncludeOpt,
    InputFileOpt,
    JsonOpt,
    LossOpt,
    MaxInflightOpt,
    ModelArg,
    ModelClassOpt,
    OutOpt,
    ParamsOpt,
    RevisionOpt,
    StatsOnlyOpt,
    TargetOpt,
    TextArg,
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
    text: TextArg = None,
    input_file: InputFileOpt = None,
    depth: DepthOpt = None,
    include: IncludeOpt = None,
    exclude: ExcludeOpt = None,
    inputs: Annotated[
        bool | None, typer.Option("--inputs/--no-inputs", help="Also capture module inputs.")
    ] = None,
    out: OutOpt = None,
    stats_only: StatsOnlyOpt = None,
    json_out: JsonOpt = False,
    revision: RevisionOpt = None,
    model_class: ModelClassOpt = None,
    tokenizer: TokenizerOpt = None,
    trust_remote_code: TrustOpt = None,
    dtype: DTypeOpt = None,
    device: DeviceOpt = None,
    seed: Annotated[
        int | None, typer.Option(help="torch seed set before the run [default: 0].")
    ] = None,
    train_mode: TrainModeOpt = None,
    dead_threshold: Annotated[
        float | None,
        typer.Option(help="A unit is dead when never above this [default: 0]."),
    ] = None,
    grads: Annotated[
        bool | None,
        typer.Option("--grads/--no-grads", help="Also store gradients (see `modeltap grads`)."),
    ] = None,
    target: TargetOpt = None,
    loss: LossOpt = None,
    grad_output: GradOutputOpt = None,
    params: ParamsOpt = None,
    config: ConfigOpt = None,
    max_inflight: MaxInflightOpt = None,
) -> None:
    """Run a model on text or tensors and write every selected module's output to safetensors."""
    s = settings(
        "dump",
        config,
        model=model,
        texts=text or [],
        input_file=str(input_file) if input_file else None,
        depth=depth,
        include=include or [],
        exclude=exclude or [],
        inputs=inputs,
        out=str(out) if out else None,
        stats_only=stats_only,
        revision=revision,
        model_class=model_class,
        tokenizer=tokenizer,
        trust_remote_code=trust_remote_code,
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
        max_inflight_mb=max_inflight,
    )
    run_dump(s, json_out=json_out, grads=s.grads, activations=True)


def run_dump(s: Settings, *, json_out: bool, grads: bool, activations: bool) -> None:
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
    if s.texts and s.input_file:
        raise InputError("give TEXT or --input-file, not both")
    if not s.texts and not s.input_file:
        raise InputError("nothing to run on; give TEXT or --input-file")
    if s.max_inflight_mb < 0:
        raise InputError(f"--max-inflight is {s.max_inflight_mb}; give MiB >= 0 (0 writes inline)")
    path = Path(s.out) if s.out else default_out(s.model, grads_only=not activations)
    check_writable(path)

    err = stderr()
    with err.status(f"loading {s.model}"):
        loaded, inputs_, tok = _load_with_inputs(s, need_tokenizer=s.loss == "mlm")
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
            max_inflight=s.max_inflight_mb << 20,
        )
    from modeltap.cli.show import print_opened
    from modeltap.dump import load_dump

    print_opened(load_dump(written), json_out=json_out)
    err.print(f"wrote {written} ({written.stat().st_size / 1e6:.1f} MB)")


def _load_with_inputs(s: Settings, *, need_tokenizer: bool = False) -> tuple[Any, Any, Any]:
    import torch

    from modeltap.loading import (
        add_decoder_inputs,
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
    )
    tok = None
    if s.texts or need_tokenizer:
        where = s.tokenizer or loaded.source.path
        tok = load_tokenizer(where, trust_remote_code=s.trust_remote_code)
    inputs_ = text_inputs(tok, s.texts) if s.texts else file_inputs(s.input_file or "")
    inputs_ = add_decoder_inputs(loaded.model, inputs_)
    return loaded, inputs_.to(loaded.device, getattr(torch, loaded.dtype)), tok


def _run_metadata(s: Settings, loaded: Any) -> dict[str, str]:
    meta = {"model": s.model or "", "dtype": loaded.dtype, "device": loaded.device}
    if loaded.source.revision:
        meta["revision"] = loaded.source.revision
    return meta
