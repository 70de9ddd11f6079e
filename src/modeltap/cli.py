"""The `modeltap` command: parses options, calls the library, prints. No tensor logic here.

torch and transformers are imported inside the commands, so `modeltap --help` answers at once.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console

from modeltap.config import Settings, load_settings
from modeltap.errors import InputError, ModeltapError
from modeltap.loading import Device, DType

app = typer.Typer(
    name="modeltap",
    help="Inspect what a PyTorch / Hugging Face model computes, layer by layer.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

F = TypeVar("F", bound=Callable[..., Any])


def _stdout() -> Console:
    return Console(soft_wrap=False)


def _stderr() -> Console:
    return Console(stderr=True)


def handle_errors(command: F) -> F:
    """ModeltapError -> `error: ...` on stderr and its exit code; MODELTAP_DEBUG=1 re-raises."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except ModeltapError as exc:
            if os.environ.get("MODELTAP_DEBUG"):
                raise
            print(f"error: {exc.message}", file=sys.stderr)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            print("interrupted; nothing was written", file=sys.stderr)
            raise typer.Exit(130) from None

    return wrapper  # type: ignore[return-value]


# Options shared by several commands, defined once.
ModelArg = Annotated[
    str | None, typer.Argument(help="Hugging Face model id or local folder with config.json.")
]
ConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="TOML settings file (see configs/).", show_default=False),
]
DepthOpt = Annotated[
    int | None,
    typer.Option("--depth", "-d", help="Keep modules with at most N dotted name parts (root = 0)."),
]
IncludeOpt = Annotated[
    list[str] | None,
    typer.Option("--include", "-i", help="Glob on dotted module names; repeatable."),
]
ExcludeOpt = Annotated[
    list[str] | None, typer.Option("--exclude", "-x", help="Glob to leave out; repeatable.")
]
OutOpt = Annotated[
    Path | None,
    typer.Option("--out", "-o", help="Dump file [default: <model name>.dump.safetensors]."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON on stdout instead of a table.")]
RevisionOpt = Annotated[str | None, typer.Option(help="Hub revision: branch, tag or commit.")]
ModelClassOpt = Annotated[
    str | None,
    typer.Option(help="transformers class to load with [default: AutoModel].", show_default=False),
]
TrustOpt = Annotated[
    bool | None,
    typer.Option("--trust-remote-code/--no-trust-remote-code", help="Run the model repo's code."),
]


TextArg = Annotated[list[str] | None, typer.Argument(help="Sentences, run as one padded batch.")]
InputFileOpt = Annotated[
    Path | None, typer.Option(help="Tensors instead of text: .safetensors, .npy, .npz or .pt.")
]
StatsOnlyOpt = Annotated[
    bool | None,
    typer.Option("--stats-only/--with-tensors", help="Write statistics only, no tensors."),
]
TokenizerOpt = Annotated[
    str | None, typer.Option(help="Tokenizer id or folder [default: the model's].")
]
DTypeOpt = Annotated[DType | None, typer.Option(help="Model dtype [default: float32].")]
DeviceOpt = Annotated[Device | None, typer.Option(help="Where to run [default: cpu].")]
TrainModeOpt = Annotated[
    bool | None, typer.Option("--train-mode/--eval-mode", help="Keep dropout etc. active.")
]
TargetOpt = Annotated[
    str | None,
    typer.Option("--target", "-t", help="Module (or module:part) whose output is differentiated."),
]
WrtOpt = Annotated[
    list[str] | None,
    typer.Option("--wrt", "-w", help="Only these modules' outputs get gradients; repeatable."),
]
LossOpt = Annotated[
    str | None,
    typer.Option(help="Without --target: sum (of the main output), lm (causal LM), mlm."),
]
GradOutputOpt = Annotated[
    str | None,
    typer.Option(help="Seed of the backward: ones, randn, unit:I,J,... or a tensor file."),
]
ParamsOpt = Annotated[
    bool | None, typer.Option("--params/--no-params", help="Also store parameter gradients.")
]
JacobianOpt = Annotated[
    int | None,
    typer.Option(
        help="Estimate ||d target/d x||_F for each x from K random probes [default: off]."
    ),
]
ProbesOpt = Annotated[str | None, typer.Option(help="Probe vectors: rademacher or gaussian.")]
VanishingOpt = Annotated[
    float | None, typer.Option(help="Flag gradients with a norm below this [default: 1e-7].")
]
ExplodingOpt = Annotated[
    float | None, typer.Option(help="Flag gradients with a norm above this [default: 1e3].")
]


@app.callback(invoke_without_command=True)
def _root(
    version: Annotated[bool, typer.Option("--version", help="Print the version.")] = False,
) -> None:
    if version:
        from modeltap import __version__

        print(f"modeltap {__version__}")
        raise typer.Exit(0)


def _settings(command: str, config: Path | None, **flags: Any) -> Settings:
    return load_settings(command, config_file=config, flags=flags)


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
) -> None:
    """Run a model on text or tensors and write every selected module's output to safetensors."""
    s = _settings(
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
    )
    _run(s, json_out=json_out, grads=s.grads, activations=True)


def _run(s: Settings, *, json_out: bool, grads: bool, activations: bool) -> None:
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
    path = Path(s.out) if s.out else default_out(s.model, grads_only=not activations)
    check_writable(path)

    err = _stderr()
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
        )
    from modeltap.dump import load_dump

    _print_opened(load_dump(written), json_out=json_out)
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


@app.command()
@handle_errors
def grads(
    model: ModelArg = None,
    text: TextArg = None,
    target: TargetOpt = None,
    wrt: WrtOpt = None,
    loss: LossOpt = None,
    grad_output: GradOutputOpt = None,
    params: ParamsOpt = None,
    jacobian_norm: JacobianOpt = None,
    probes: ProbesOpt = None,
    vanishing: VanishingOpt = None,
    exploding: ExplodingOpt = None,
    input_file: InputFileOpt = None,
    depth: DepthOpt = None,
    include: IncludeOpt = None,
    exclude: ExcludeOpt = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="Output file [default: <model name>.grads.safetensors]."),
    ] = None,
    stats_only: StatsOnlyOpt = None,
    json_out: JsonOpt = False,
    revision: RevisionOpt = None,
    model_class: ModelClassOpt = None,
    tokenizer: TokenizerOpt = None,
    trust_remote_code: TrustOpt = None,
    dtype: DTypeOpt = None,
    device: DeviceOpt = None,
    seed: Annotated[
        int | None, typer.Option(help="Seed of the run and of random probes [default: 0].")
    ] = None,
    train_mode: TrainModeOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Gradients of a module's output (or a loss) w.r.t. the selected modules, in one backward."""
    s = _settings(
        "grads",
        config,
        model=model,
        texts=text or [],
        input_file=str(input_file) if input_file else None,
        depth=depth,
        include=include or [],
        exclude=exclude or [],
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
        target=target,
        wrt=wrt or [],
        loss=loss,
        grad_output=grad_output,
        params=params,
        jacobian_norm=jacobian_norm,
        probes=probes,
        vanishing=vanishing,
        exploding=exploding,
    )
    _run(s, json_out=json_out, grads=True, activations=False)


@app.command()
@handle_errors
def show(
    file: Annotated[Path, typer.Argument(help="A dump written by modeltap (or any safetensors).")],
    json_out: JsonOpt = False,
) -> None:
    """Print a dump's tree of statistics again, from the file alone."""
    from modeltap.dump import load_dump

    opened = load_dump(file)
    if not opened.is_modeltap:
        _stderr().print("no modeltap metadata: computing statistics from the tensors")
        from modeltap.stats import tensor_stats

        opened.stats = {k: tensor_stats(opened[k]) for k in opened.stored}
    _print_opened(opened, json_out=json_out)


def _print_opened(opened: Any, *, json_out: bool) -> None:
    from modeltap.render import (
        activation_keys,
        dump_heading,
        dump_json,
        dump_table,
        grad_meta,
        grads_heading,
        grads_table,
    )

    if json_out:
        print(json.dumps(dump_json(opened), indent=1))
        return
    console = _stdout()
    console.print(dump_heading(opened))
    if activation_keys(opened):
        console.print(dump_table(opened, width=console.width))
    if grad_meta(opened) is not None:
        console.print(grads_heading(opened))
        console.print(grads_table(opened, width=console.width))


@app.command("ls")
@handle_errors
def list_modules(
    model: ModelArg = None,
    depth: DepthOpt = None,
    include: IncludeOpt = None,
    exclude: ExcludeOpt = None,
    revision: RevisionOpt = None,
    model_class: ModelClassOpt = None,
    trust_remote_code: TrustOpt = None,
    config: ConfigOpt = None,
) -> None:
    """List a model's modules as a tree, without loading weights or running it."""
    s = _settings(
        "ls",
        config,
        model=model,
        depth=depth,
        include=include or [],
        exclude=exclude or [],
        revision=revision,
        model_class=model_class,
        trust_remote_code=trust_remote_code,
    )
    if not s.model:
        raise InputError("no MODEL given; pass one, or set `model` in modeltap.toml")
    from modeltap.loading import load_meta_model
    from modeltap.render import module_table
    from modeltap.selection import Selection, select_modules

    meta_model, _ = load_meta_model(
        s.model,
        revision=s.revision,
        model_class_name=s.model_class,
        trust_remote_code=s.trust_remote_code,
    )
    names = select_modules(meta_model, Selection(s.depth, tuple(s.include), tuple(s.exclude)))
    _stdout().print(module_table(meta_model, names))


@app.command("diff")
@handle_errors
def diff_command(
    a: Annotated[Path, typer.Argument(help="First dump, e.g. the candidate.")],
    b: Annotated[
        Path, typer.Argument(help="Second dump; rtol is relative to |B|, as torch.allclose(A, B).")
    ],
    atol: Annotated[float | None, typer.Option(help="Absolute tolerance [default: 1e-8].")] = None,
    rtol: Annotated[float | None, typer.Option(help="Relative tolerance [default: 1e-5].")] = None,
    preset: Annotated[
        str | None,
        typer.Option(help="Tolerances from configs/tolerances.toml: exact, fp32, tf32, bf16..."),
    ] = None,
    map_: Annotated[
        list[str] | None,
        typer.Option("--map", help="Rename A's keys to B's: OLD=NEW globs ('bert.*=*')."),
    ] = None,
    include: Annotated[list[str] | None, typer.Option("--include", "-i", help="Key glob.")] = None,
    exclude: ExcludeOpt = None,
    equal_nan: Annotated[
        bool | None, typer.Option("--equal-nan/--nan-differs", help="Count NaN == NaN as equal.")
    ] = None,
    upcast: Annotated[
        bool | None,
        typer.Option(
            "--upcast/--no-upcast", help="Compare tensors of different dtypes in float64."
        ),
    ] = None,
    strict: Annotated[
        bool | None, typer.Option("--strict/--lenient", help="Keys on one side only fail too.")
    ] = None,
    show_all: Annotated[bool, typer.Option("--all", help="List every pair, in order.")] = False,
    json_out: JsonOpt = False,
    junit: Annotated[
        Path | None, typer.Option(help="Also write JUnit XML, one test case per tensor.")
    ] = None,
    config: ConfigOpt = None,
) -> None:
    """Compare two dumps; exit 0 when every tensor is within tolerance, 1 when not."""
    from modeltap.config import tolerance_preset
    from modeltap.diff import Tolerance, diff_dumps, junit_xml
    from modeltap.dump import check_writable

    s = _settings(
        "diff",
        config,
        preset=preset,
        map=map_ or [],
        include=include or [],
        exclude=exclude or [],
        equal_nan=equal_nan,
        upcast=upcast,
        strict=strict,
    )
    # Precedence for tolerances: settings files and env < preset < --atol/--rtol.
    values = {"atol": s.atol, "rtol": s.rtol}
    if s.preset:
        values.update(tolerance_preset(s.preset))
    values.update({k: v for k, v in {"atol": atol, "rtol": rtol}.items() if v is not None})
    if values["atol"] < 0 or values["rtol"] < 0:
        raise InputError("--atol and --rtol must be 0 or more")
    if junit is not None:
        check_writable(junit)
    overrides = [(glob, Tolerance(**{**values, **tol})) for glob, tol in s.overrides.items()]
    report = diff_dumps(
        a,
        b,
        tolerance=Tolerance(**values),
        overrides=overrides,
        rename=s.map,
        include=s.include,
        exclude=s.exclude,
        equal_nan=s.equal_nan,
        upcast=s.upcast,
        strict=s.strict,
    )
    if junit is not None:
        _write_atomically(junit, junit_xml(report))
    if json_out:
        print(json.dumps(report.to_json(), indent=1))
    else:
        from modeltap.render import diff_heading, diff_table

        console = _stdout()
        console.print(diff_heading(report))
        table = diff_table(report, show_all=show_all, width=console.width)
        if table.row_count:
            console.print(table)
    raise typer.Exit(0 if report.passed else 1)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def main() -> None:
    app()
