"""Options shared by several commands, each declared once (habit 4 in STYLE.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from modeltap.loading.hf import Device, DType
from modeltap.loading.placement import DeviceMap

# Help panels: `--help` groups each command's options under these headings.
INPUTS = "Inputs"
SELECTION = "Selection"
LOADING = "Loading"
RUNNING = "Running"
OUTPUT = "Output"
GRADIENTS = "Gradients"
TOL = "Tolerance"
KEYS = "Keys"

# Options shared by several commands, defined once.
ModelArg = Annotated[
    str | None,
    typer.Argument(
        help="Hugging Face model id or folder with config.json, a .pt2 (torch.export) or .pt "
        "(TorchScript) archive, or pkg.module:factory.",
        metavar="MODEL",
    ),
]
ExportModelArg = Annotated[
    str | None,
    typer.Argument(
        help="Hugging Face model id or folder with config.json, or pkg.module:factory.",
        metavar="MODEL",
    ),
]
ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config",
        "-c",
        help="TOML settings file (see configs/).",
        show_default=False,
        rich_help_panel=OUTPUT,
        metavar="FILE",
    ),
]
DepthOpt = Annotated[
    int | None,
    typer.Option(
        "--depth",
        "-d",
        help="Keep modules with at most N dotted name parts (root = 0).",
        rich_help_panel=SELECTION,
        metavar="N",
    ),
]
IncludeOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--include",
        "-i",
        help="Glob on dotted module names; repeatable.",
        rich_help_panel=SELECTION,
        metavar="GLOB",
    ),
]
ExcludeOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--exclude",
        "-x",
        help="Glob to leave out; repeatable.",
        rich_help_panel=SELECTION,
        metavar="GLOB",
    ),
]
OutOpt = Annotated[
    Path | None,
    typer.Option(
        "--out",
        "-o",
        help="Dump file [default: <model name>.dump.safetensors].",
        rich_help_panel=OUTPUT,
        metavar="FILE",
    ),
]
JsonOpt = Annotated[
    bool,
    typer.Option("--json", help="Print JSON on stdout instead of a table.", rich_help_panel=OUTPUT),
]
RevisionOpt = Annotated[
    str | None,
    typer.Option(
        help="Hub revision: branch, tag or commit.", rich_help_panel=LOADING, metavar="REV"
    ),
]
ModelClassOpt = Annotated[
    str | None,
    typer.Option(
        help="transformers class to load with [default: AutoModel].",
        show_default=False,
        rich_help_panel=LOADING,
        metavar="CLASS",
    ),
]
TrustOpt = Annotated[
    bool | None,
    typer.Option(
        "--trust-remote-code/--no-trust-remote-code",
        help="Run the model repo's code.",
        rich_help_panel=LOADING,
    ),
]
AllowMissingWeightsOpt = Annotated[
    bool | None,
    typer.Option(
        "--allow-missing-weights/--no-allow-missing-weights",
        help="Run a checkpoint that lacks weights for some of the class's parameters (a head it "
        "was not saved with: randomly initialised, listed in the dump) [default: refuse].",
        rich_help_panel=LOADING,
    ),
]


TextArg = Annotated[
    list[str] | None, typer.Argument(help="Sentences, run as one padded batch.", metavar="TEXT")
]
InputsArg = Annotated[
    list[str] | None,
    typer.Argument(
        help="Text, or image / audio files (told apart by content), run as one batch.",
        metavar="TEXT|FILE",
    ),
]
ImageOpt = Annotated[
    list[Path] | None,
    typer.Option(
        "--image",
        help="Image file, any format Pillow reads; repeatable.",
        rich_help_panel=INPUTS,
        metavar="FILE",
    ),
]
AudioOpt = Annotated[
    list[Path] | None,
    typer.Option(
        "--audio",
        help="Audio file, any format soundfile reads; repeatable.",
        rich_help_panel=INPUTS,
        metavar="FILE",
    ),
]
ImagesDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--images-dir",
        help="Every image file in this folder, by name, added to the batch.",
        rich_help_panel=INPUTS,
        metavar="DIR",
    ),
]
AudioDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--audio-dir",
        help="Every audio file in this folder, by name, added to the batch.",
        rich_help_panel=INPUTS,
        metavar="DIR",
    ),
]
LimitOpt = Annotated[
    int | None,
    typer.Option(
        "--batch",
        "--limit",
        help="Only the first N files of --images-dir / --audio-dir, by name: the batch they make.",
        min=1,
        rich_help_panel=INPUTS,
        metavar="N",
    ),
]
TextOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--text",
        help="Text, even where a file of that name exists; repeatable.",
        rich_help_panel=INPUTS,
        metavar="TEXT",
    ),
]
ProcessorOpt = Annotated[
    str | None,
    typer.Option(
        help="Processor id or folder for images/audio [default: the model's].",
        rich_help_panel=INPUTS,
        metavar="NAME",
    ),
]
ChatOpt = Annotated[
    bool | None,
    typer.Option(
        "--chat/--no-chat",
        help="Make the one TEXT and the files a user turn of the processor's chat template.",
        rich_help_panel=INPUTS,
    ),
]
InputFileOpt = Annotated[
    Path | None,
    typer.Option(
        help="Tensors instead of text: .safetensors, .npy, .npz or .pt.",
        rich_help_panel=INPUTS,
        metavar="FILE",
    ),
]
StatsOnlyOpt = Annotated[
    bool | None,
    typer.Option(
        "--stats-only/--with-tensors",
        help="Write statistics only, no tensors.",
        rich_help_panel=OUTPUT,
    ),
]
HistOpt = Annotated[
    bool | None,
    typer.Option(
        "--hist/--no-hist",
        help="Also store a 43-bin histogram of each tensor's values (signed, log-spaced "
        "from 1e-6 to 1e4) with its statistics, for `modeltap report`.",
        rich_help_panel=OUTPUT,
    ),
]
TokenizerOpt = Annotated[
    str | None,
    typer.Option(
        help="Tokenizer id or folder [default: the model's; an archive or factory has none].",
        rich_help_panel=INPUTS,
        metavar="NAME",
    ),
]
# For commands that take Hugging Face models only (compare, generate).
HfTokenizerOpt = Annotated[
    str | None,
    typer.Option(
        "--tokenizer",
        help="Tokenizer id or folder [default: the model's].",
        rich_help_panel=INPUTS,
        metavar="NAME",
    ),
]
DTypeOpt = Annotated[
    DType | None,
    typer.Option(
        help="Model dtype: float32, bfloat16 or float16 [default: float32].",
        rich_help_panel=LOADING,
        metavar="DTYPE",
    ),
]
DeviceOpt = Annotated[
    Device | None,
    typer.Option(
        help="Where to run: cpu, cuda or auto [default: cpu].",
        rich_help_panel=LOADING,
        metavar="DEVICE",
    ),
]
TrainModeOpt = Annotated[
    bool | None,
    typer.Option(
        "--train-mode/--eval-mode", help="Keep dropout etc. active.", rich_help_panel=RUNNING
    ),
]
TargetOpt = Annotated[
    str | None,
    typer.Option(
        "--target",
        "-t",
        help="Module (or module:part) whose output is differentiated.",
        rich_help_panel=GRADIENTS,
        metavar="MODULE",
    ),
]
WrtOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--wrt",
        "-w",
        help="Only these modules' outputs, or float inputs (pixel_values), get gradients; "
        "repeatable.",
        rich_help_panel=GRADIENTS,
        metavar="MODULE|INPUT",
    ),
]
LossOpt = Annotated[
    str | None,
    typer.Option(
        help="Without --target: sum (of the main output), lm (causal LM), mlm.",
        rich_help_panel=GRADIENTS,
        metavar="LOSS",
    ),
]
GradOutputOpt = Annotated[
    str | None,
    typer.Option(
        help="Seed of the backward: ones, randn, unit:I,J,... or a tensor file.",
        rich_help_panel=GRADIENTS,
        metavar="SPEC",
    ),
]
ParamsOpt = Annotated[
    bool | None,
    typer.Option(
        "--params/--no-params", help="Also store parameter gradients.", rich_help_panel=GRADIENTS
    ),
]
JacobianOpt = Annotated[
    int | None,
    typer.Option(
        help="Estimate ||d target/d x||_F for each x from K random probes [default: off].",
        rich_help_panel=GRADIENTS,
        metavar="K",
    ),
]
ProbesOpt = Annotated[
    str | None,
    typer.Option(
        help="Probe vectors: rademacher or gaussian.", rich_help_panel=GRADIENTS, metavar="KIND"
    ),
]
VanishingOpt = Annotated[
    float | None,
    typer.Option(
        help="Flag gradients with a norm below this [default: 1e-7].",
        rich_help_panel=GRADIENTS,
        metavar="NORM",
    ),
]
ExplodingOpt = Annotated[
    float | None,
    typer.Option(
        help="Flag gradients with a norm above this [default: 1e3].",
        rich_help_panel=GRADIENTS,
        metavar="NORM",
    ),
]
MaxLengthOpt = Annotated[
    int | None,
    typer.Option(
        help="Truncate each text to N tokens [default: no truncation].",
        min=1,
        rich_help_panel=INPUTS,
        metavar="N",
    ),
]
SeedOpt = Annotated[
    int | None,
    typer.Option(
        help="torch seed set before the run [default: 0].", rich_help_panel=RUNNING, metavar="N"
    ),
]

# Tolerances and key renames, shared by diff and compare.
PresetOpt = Annotated[
    str | None,
    typer.Option(
        help="Tolerance preset shipped with modeltap: exact, fp32, tf32, bf16, fp16, compile, "
        "cross-device (a tolerances.toml in $MODELTAP_CONFIGS or ./configs replaces them).",
        metavar="NAME",
        rich_help_panel=TOL,
    ),
]
AtolOpt = Annotated[
    float | None,
    typer.Option(
        help="Absolute tolerance; wins over --preset [default: 1e-8].",
        metavar="X",
        rich_help_panel=TOL,
    ),
]
RtolOpt = Annotated[
    float | None,
    typer.Option(
        help="Relative tolerance; wins over --preset [default: 1e-5].",
        metavar="X",
        rich_help_panel=TOL,
    ),
]
MapOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--map",
        help="Rename A's keys to B's: OLD=NEW globs ('bert.*=*'), or a TOML/JSON file of "
        "[keys] and [modules] renames; repeatable, the first matching rule wins.",
        metavar="OLD=NEW|FILE",
        rich_help_panel=KEYS,
    ),
]
KeyIncludeOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--include", "-i", help="Key glob; repeatable.", metavar="GLOB", rich_help_panel=KEYS
    ),
]
StrictOpt = Annotated[
    bool | None,
    typer.Option(
        "--strict/--lenient", help="Keys on one side only fail too.", rich_help_panel=KEYS
    ),
]
UpcastOpt = Annotated[
    bool | None,
    typer.Option(
        "--upcast/--no-upcast",
        help="Compare tensors of different dtypes, in float32 when both fit, else float64 "
        "[default: off; on with a preset that says upcast, as bf16 and fp16].",
        rich_help_panel=TOL,
    ),
]
EqualNanOpt = Annotated[
    bool | None,
    typer.Option(
        "--equal-nan/--nan-differs", help="Count NaN == NaN as equal.", rich_help_panel=TOL
    ),
]
JunitOpt = Annotated[
    Path | None,
    typer.Option(
        help="Also write JUnit XML, one test case per tensor.",
        metavar="FILE",
        rich_help_panel=OUTPUT,
    ),
]
HtmlOpt = Annotated[
    Path | None,
    typer.Option(
        "--html",
        help="Also write the report as one self-contained HTML page (see `modeltap report`).",
        metavar="FILE",
        rich_help_panel=OUTPUT,
    ),
]

# Big models: placement by transformers/accelerate across GPUs, CPU and disk.
DeviceMapOpt = Annotated[
    DeviceMap | None,
    typer.Option(
        help="Let accelerate place the model on GPUs, then CPU, then disk (not with --device): "
        "auto, balanced, balanced_low_0 or sequential.",
        metavar="MAP",
        rich_help_panel=LOADING,
    ),
]
MaxMemoryOpt = Annotated[
    str | None,
    typer.Option(
        help="Memory per device for --device-map, e.g. 0=20GiB,cpu=30GiB [default: what is free].",
        metavar="LIMITS",
        rich_help_panel=LOADING,
    ),
]
OffloadFolderOpt = Annotated[
    Path | None,
    typer.Option(
        help="Folder for weights offloaded to disk by --device-map.",
        metavar="DIR",
        rich_help_panel=LOADING,
    ),
]

# transformed models
CompileOpt = Annotated[
    bool | None,
    typer.Option(
        "--compile/--no-compile",
        help="Run the model through torch.compile.",
        rich_help_panel=RUNNING,
    ),
]
CompileBackendOpt = Annotated[
    str | None,
    typer.Option(
        help="torch.compile backend, e.g. aot_eager [default: inductor].",
        metavar="NAME",
        rich_help_panel=RUNNING,
    ),
]
FullgraphOpt = Annotated[
    bool | None,
    typer.Option(
        "--fullgraph/--no-fullgraph",
        help="torch.compile must make one graph.",
        rich_help_panel=RUNNING,
    ),
]
AllowPickleOpt = Annotated[
    bool | None,
    typer.Option(
        "--allow-pickle/--no-allow-pickle",
        help="Load a .pt2 archive that needs a full unpickle (runs its code; trusted files only).",
        rich_help_panel=LOADING,
    ),
]
MaxInflightOpt = Annotated[
    int | None,
    typer.Option(
        "--max-inflight",
        help="MiB of tensors copied but not yet written that the writer thread may hold "
        "(pinned for CUDA); the run waits when it is full; 0 writes inline [default: 32].",
        metavar="MIB",
        rich_help_panel=OUTPUT,
    ),
]

# generation: generate, and compare --generate N
MaxNewTokensOpt = Annotated[
    int | None,
    typer.Option(
        help="New tokens to generate at most (fewer when the model ends with EOS) [default: "
        "the model's generation config, else 20].",
        metavar="N",
        rich_help_panel=RUNNING,
    ),
]
DoSampleOpt = Annotated[
    bool | None,
    typer.Option(
        "--do-sample/--greedy",
        help="Sample each token (seeded by --seed) instead of taking the likeliest [default: "
        "the model's generation config, else greedy].",
        rich_help_panel=RUNNING,
    ),
]
TemperatureOpt = Annotated[
    float | None,
    typer.Option(
        help="Sampling temperature (with --do-sample).", metavar="T", rich_help_panel=RUNNING
    ),
]
TopKOpt = Annotated[
    int | None,
    typer.Option(
        help="Sample among the K likeliest tokens (with --do-sample).",
        metavar="K",
        rich_help_panel=RUNNING,
    ),
]
TopPOpt = Annotated[
    float | None,
    typer.Option(
        help="Sample among the likeliest tokens holding probability P (with --do-sample).",
        metavar="P",
        rich_help_panel=RUNNING,
    ),
]
NumBeamsOpt = Annotated[
    int | None,
    typer.Option(
        help="Beam search with N beams (1: one sequence per prompt) [default: the model's "
        "generation config].",
        metavar="N",
        rich_help_panel=RUNNING,
    ),
]
PromptChatOpt = Annotated[
    bool | None,
    typer.Option(
        "--chat/--no-chat",
        help="Put each prompt through the tokenizer's chat template as a user message.",
        rich_help_panel=INPUTS,
    ),
]
