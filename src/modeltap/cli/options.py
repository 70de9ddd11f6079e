"""Options shared by several commands, each declared once (habit 4 in STYLE.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from modeltap.loading.hf import Device, DType

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
MaxInflightOpt = Annotated[
    int | None,
    typer.Option(
        "--max-inflight",
        help="MiB of tensors copied but not yet written that the writer thread may hold "
        "(pinned for CUDA); the run waits when it is full; 0 writes inline [default: 32].",
    ),
]
