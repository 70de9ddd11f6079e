"""The settings of a run, each field also the one declaration of its command-line option.

A field made with `option(...)` (declare.py) carries its flag(s), help, help panel and metavar;
`cli/options.py` builds typer parameters from them, `files.py` derives the TOML keys and
MODELTAP_* variables from the same fields, so an option is written once. Plain strings only: the
library does not need typer.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from modeltap.config.declare import (
    GRADIENTS,
    INPUTS,
    KEYS,
    LOADING,
    OUTPUT,
    RUNNING,
    SELECTION,
    TOL,
    CliOption,
    option,
)

_MODEL_HELP = (
    "Hugging Face model id or folder with config.json, a .pt2 (torch.export) or .pt "
    "(TorchScript) archive, or pkg.module:factory."
)


@dataclass
class Settings:
    model: str | None = option(
        None,
        help=_MODEL_HELP,
        metavar="MODEL",
        argument=True,
        variants={
            "export": {
                "help": "Hugging Face model id or folder with config.json, or pkg.module:factory."
            },
            "generate": {
                "help": "Hugging Face model id or folder with config.json, of a model that "
                "generates."
            },
            # compare's models are replayed module by module in Python
            "compare": {
                "help": "Hugging Face model id or folder with config.json (its modules are "
                "replayed in Python: not a .pt2 or .pt archive, nor a factory).",
                "show_default": False,
            },
            "replay": {
                "help": "The model the run trained: Hugging Face id or folder with config.json, "
                "or pkg.module:factory (its weights are not used: the step file's are).",
                "type": str,
                "required": True,
            },
        },
    )
    texts: list[str] = field(default_factory=list)
    images: list[str] = option(
        factory=list,
        flags=("--image",),
        help="Image file, any format Pillow reads; repeatable.",
        panel=INPUTS,
        metavar="FILE",
        path=True,
    )
    audio: list[str] = option(
        factory=list,
        flags=("--audio",),
        help="Audio file, any format soundfile reads; repeatable.",
        panel=INPUTS,
        metavar="FILE",
        path=True,
    )
    processor: str | None = option(
        help="Processor id or folder for images/audio [default: the model's].",
        panel=INPUTS,
        metavar="NAME",
    )
    # dump/grads: the TEXT and files as a user turn of the processor's chat template;
    # generate: each prompt through the tokenizer's chat template
    chat: bool = option(
        False,
        "--chat/--no-chat",
        help="Make the one TEXT and the files a user turn of the processor's chat template.",
        panel=INPUTS,
        variants={
            "generate": {
                "help": "Put each prompt through the tokenizer's chat template as a user message."
            }
        },
    )
    input_file: str | None = option(
        help="Tensors instead of text: .safetensors, .npy, .npz or .pt.",
        panel=INPUTS,
        metavar="FILE",
        path=True,
    )
    depth: int | None = option(
        None,
        "--depth",
        "-d",
        help="Keep modules with at most N dotted name parts (root = 0).",
        panel=SELECTION,
        metavar="N",
    )
    include: list[str] = option(
        factory=list,
        flags=("--include", "-i"),
        help="Glob on dotted module names; repeatable.",
        panel=SELECTION,
        metavar="GLOB",
        variants={
            command: {"help": "Key glob; repeatable.", "panel": KEYS}
            for command in ("diff", "report")
        },
    )
    exclude: list[str] = option(
        factory=list,
        flags=("--exclude", "-x"),
        help="Glob to leave out; repeatable.",
        panel=SELECTION,
        metavar="GLOB",
    )
    ops: bool = option(
        False,
        "--ops/--no-ops",
        help="Also capture every torch function each selected module's own code calls "
        "(keys module/opNN.name), with its source line.",
        panel=SELECTION,
        variants={
            "grads": {
                "help": "Also, inside each module that gets gradients, every torch function its "
                "own code calls: the op's output (module/opNN.name) and the gradient with "
                "respect to it (grad/module/opNN.name), with its source line."
            },
            "generate": {
                "help": "Also capture, at each decoding step, every torch function each selected "
                "module's own code calls (gen/stepK/module/opNN.name), with its source line."
            },
            "compare": {
                "help": "Inside the module that introduces the largest error, run its ops one "
                "by one in the variant from the reference's inputs and name the op (and source "
                "line) that introduces the largest error."
            }
        },
    )
    inputs: bool = option(
        False, "--inputs/--no-inputs", help="Also capture module inputs.", panel=SELECTION
    )
    out: str | None = option(
        None,
        "--out",
        "-o",
        help="Dump file [default: <model name>.dump.safetensors].",
        panel=OUTPUT,
        metavar="FILE",
        path=True,
        variants={
            "grads": {"help": "Output file [default: <model name>.grads.safetensors]."},
            "generate": {"help": "Dump file [default: <model name>.gen.safetensors]."},
            "report": {"help": "HTML file [default: <first input's name>.html]."},
            "export": {
                "help": "Archive: .pt2 (torch.export) or .pt (a TorchScript trace) "
                "[default: <model name>.pt2]."
            },
        },
    )
    stats_only: bool = option(
        False,
        "--stats-only/--with-tensors",
        help="Write statistics only, no tensors.",
        panel=OUTPUT,
        variants={
            "compare": {"help": "With --out-dir: the dumps kept there hold statistics only."}
        },
    )
    hist: bool = option(
        False,
        "--hist/--no-hist",
        help="Also store a 43-bin histogram of each tensor's values (signed, log-spaced "
        "from 1e-6 to 1e4) with its statistics, for `modeltap report`.",
        panel=OUTPUT,
    )
    formats: str | None = option(
        help="Also measure what quantizing each float tensor would cost in these formats "
        "(comma-separated: fp8_e4m3, fp8_e5m2, mxfp8, mxfp4, nvfp4, int8, int4): relative RMS "
        "error, SQNR, underflow and clipped shares, without changing the run.",
        panel=OUTPUT,
        metavar="FMT,...",
    )
    revision: str | None = option(
        help="Hub revision: branch, tag or commit.", panel=LOADING, metavar="REV"
    )
    model_class: str = option(
        "AutoModel",
        help="transformers class to load with [default: AutoModel].",
        show_default=False,
        panel=LOADING,
        metavar="CLASS",
        variants={
            "generate": {
                "help": "transformers class to load with [default: AutoModelForCausalLM; "
                "AutoModelForSeq2SeqLM for an encoder-decoder, AutoModelForSpeechSeq2Seq with "
                "audio, AutoModelForImageTextToText with images]."
            },
            "replay": {
                "help": "transformers class to build MODEL with [default: the run's, else "
                "AutoModel].",
                "panel": None,
            },
        },
    )
    tokenizer: str | None = option(
        help="Tokenizer id or folder [default: the model's; an archive or factory has none].",
        panel=INPUTS,
        metavar="NAME",
        variants={  # commands that take Hugging Face models only
            command: {
                "help": "Tokenizer id or folder [default: the model's].",
                "flags": ("--tokenizer",),
            }
            for command in ("compare", "generate")
        },
    )
    max_length: int | None = option(
        help="Truncate each text to N tokens [default: no truncation].",
        min=1,
        panel=INPUTS,
        metavar="N",
    )
    trust_remote_code: bool = option(
        False,
        "--trust-remote-code/--no-trust-remote-code",
        help="Run the model repo's code.",
        panel=LOADING,
    )
    # run a checkpoint lacking weights for some of the class's parameters (they start at random)
    allow_missing_weights: bool = option(
        False,
        "--allow-missing-weights/--no-allow-missing-weights",
        help="Run a checkpoint that lacks weights for some of the class's parameters (a head it "
        "was not saved with: randomly initialised, listed in the dump) [default: refuse].",
        panel=LOADING,
    )
    dtype: str = option(
        "float32",
        help="Model dtype: float32, bfloat16 or float16 [default: float32].",
        panel=LOADING,
        metavar="DTYPE",
        choices=("float32", "bfloat16", "float16"),
    )
    device: str = option(
        "cpu",
        help="Where to run: cpu, cuda or auto [default: cpu].",
        panel=LOADING,
        metavar="DEVICE",
        choices=("cpu", "cuda", "auto"),
    )
    seed: int = option(
        0,
        help="torch seed set before the run [default: 0].",
        panel=RUNNING,
        metavar="N",
        variants={
            "grads": {"help": "Seed of the run and of random probes [default: 0]."},
            "compare": {"help": "torch seed of both runs [default: 0]."},
        },
    )
    train_mode: bool = option(
        False, "--train-mode/--eval-mode", help="Keep dropout etc. active.", panel=RUNNING
    )
    dead_threshold: float = option(
        0.0,
        help="A unit is dead when never above this [default: 0].",
        metavar="X",
        panel=OUTPUT,
    )
    # diff
    atol: float = option(
        1e-8,
        help="Absolute tolerance; wins over --preset [default: 1e-8].",
        metavar="X",
        panel=TOL,
        variants={
            "compare": {
                "help": "Absolute tolerance; wins over the preset's [default: the preset's]."
            }
        },
    )
    rtol: float = option(
        1e-5,
        help="Relative tolerance; wins over --preset [default: 1e-5].",
        metavar="X",
        panel=TOL,
        variants={
            "compare": {
                "help": "Relative tolerance; wins over the preset's [default: the preset's]."
            }
        },
    )
    # compare's tolerance defaults to a preset chosen by the variant
    preset: str | None = option(
        help="Tolerance preset shipped with modeltap: exact, fp32, tf32, bf16, fp16, compile, "
        "cross-device, and fp8, mxfp8, nvfp4, int8-weight, int4-weight (a tolerances.toml in "
        "$MODELTAP_CONFIGS or ./configs replaces them).",
        metavar="NAME",
        panel=TOL,
        variants={
            "compare": {
                "help": "Tolerance preset (modeltap's own, or a configs/tolerances.toml of yours) "
                "[default: bf16 or fp16 for those variants, cross-device for cuda, compile for "
                "compile, a quantized variant's own (fp8 ... int4-weight), else fp32]."
            }
        },
    )
    overrides: dict[str, dict[str, float]] = field(default_factory=dict)
    map: list[str] = option(
        factory=list,
        flags=("--map",),
        help="Rename A's keys to B's: OLD=NEW globs ('bert.*=*'), or a TOML/JSON file of "
        "[keys] and [modules] renames; repeatable, the first matching rule wins.",
        metavar="OLD=NEW|FILE",
        panel=KEYS,
        param="map_",
        variants={
            "compare": {
                "help": "Rename the candidate's module names to MODEL's: OLD=NEW globs "
                "('bert.*=*'), or a TOML/JSON file of [keys] and [modules] renames; repeatable."
            }
        },
    )
    equal_nan: bool = option(
        False, "--equal-nan/--nan-differs", help="Count NaN == NaN as equal.", panel=TOL
    )
    upcast: bool = option(
        False,
        "--upcast/--no-upcast",
        help="Compare tensors of different dtypes, in float32 when both fit, else float64 "
        "[default: off; on with a preset that says upcast, as bf16 and fp16].",
        panel=TOL,
    )
    strict: bool = option(
        False, "--strict/--lenient", help="Keys on one side only fail too.", panel=KEYS
    )
    # grads (and dump --grads)
    grads: bool = option(
        False,
        "--grads/--no-grads",
        help="Also store gradients (see `modeltap grads`).",
        panel=GRADIENTS,
    )
    target: str | None = option(
        None,
        "--target",
        "-t",
        help="Module (or module:part) whose output is differentiated.",
        panel=GRADIENTS,
        metavar="MODULE",
        variants={  # compare: what --bisect aims for (compare.bisect.parse_target reads it)
            "compare": {
                "help": "What --bisect aims for instead of the preset: the output's rel_rmse "
                "(||a - b|| / ||b||) at most X, rel_rmse=X, or its SQNR at least DB decibels, "
                "sqnr=DB.",
                "metavar": "METRIC=VALUE",
                "panel": "Variant",
            }
        },
    )
    wrt: list[str] = option(
        factory=list,
        flags=("--wrt", "-w"),
        help="Only these modules' outputs, or float inputs (pixel_values), get gradients; "
        "repeatable.",
        panel=GRADIENTS,
        metavar="MODULE|INPUT",
    )
    loss: str = option(
        "sum",
        help="Without --target: sum (of the main output), lm (causal LM), mlm.",
        panel=GRADIENTS,
        metavar="LOSS",
    )
    grad_output: str = option(
        "ones",
        help="Seed of the backward: ones, randn, unit:I,J,... or a tensor file.",
        panel=GRADIENTS,
        metavar="SPEC",
    )
    params: bool = option(
        False, "--params/--no-params", help="Also store parameter gradients.", panel=GRADIENTS
    )
    jacobian_norm: int = option(
        0,
        help="Estimate ||d target/d x||_F for each x from K random probes [default: off].",
        panel=GRADIENTS,
        metavar="K",
    )
    probes: str = option(
        "rademacher", help="Probe vectors: rademacher or gaussian.", panel=GRADIENTS, metavar="KIND"
    )
    vanishing: float = option(
        1e-7,
        help="Flag gradients with a norm below this [default: 1e-7].",
        panel=GRADIENTS,
        metavar="NORM",
    )
    exploding: float = option(
        1e3,
        help="Flag gradients with a norm above this [default: 1e3].",
        panel=GRADIENTS,
        metavar="NORM",
    )
    # compare (scaled_atol and min_cosine are tolerances of diff too)
    against: str | None = option(
        None,
        "--against",
        "-a",
        help="The variant: bf16, fp16, attn:IMPL (eager, sdpa...), cuda, compile, export, or "
        "every nn.Linear quantized: fp8, mxfp8, nvfp4, int8-weight, int4-weight.",
        metavar="VARIANT",
        panel="Variant",
    )
    bisect: bool = option(
        False,
        "--bisect",
        panel="Variant",
        help="With a quantized variant: the fewest modules "
        "to keep in high precision for the output to pass.",
    )
    bisect_out: str | None = option(
        help="Write --bisect's set as TOML or JSON (by suffix): modules_to_not_convert.",
        metavar="FILE", panel="Variant", path=True,
    )  # fmt: skip
    candidate: str | None = None
    out_dir: str | None = option(
        help="Keep both dumps (candidate and reference) and report.json here.",
        metavar="DIR",
        panel=OUTPUT,
        path=True,
    )
    use_cache: bool = option(
        False,
        "--use-cache/--no-use-cache",
        help="Let the model keep a cache [default: no].",
        panel=RUNNING,
    )
    scaled_atol: float = 0.0
    min_cosine: float | None = None
    # compare only: scale-relative allowance for rounding accumulated from module to module
    accumulated_scaled_atol: float = 0.0

    # big models: placement across GPUs, CPU and disk (dump, grads, ls)
    device_map: str | None = option(
        help="Let accelerate place the model on GPUs, then CPU, then disk (not with --device): "
        "auto, balanced, balanced_low_0 or sequential.",
        metavar="MAP",
        panel=LOADING,
        choices=("auto", "balanced", "balanced_low_0", "sequential"),
    )
    max_memory: str | None = option(
        help="Memory per device for --device-map, e.g. 0=20GiB,cpu=30GiB [default: what is free].",
        metavar="LIMITS",
        panel=LOADING,
    )
    offload_folder: str | None = option(
        help="Folder for weights offloaded to disk by --device-map.",
        metavar="DIR",
        panel=LOADING,
        path=True,
    )

    # transformed models (dump --compile, .pt2 / TorchScript archives, factories; export)
    compile: bool = option(
        False, "--compile/--no-compile", help="Run the model through torch.compile.", panel=RUNNING
    )
    compile_backend: str = option(
        "inductor",
        help="torch.compile backend, e.g. aot_eager [default: inductor].",
        metavar="NAME",
        panel=RUNNING,
    )
    fullgraph: bool = option(
        False,
        "--fullgraph/--no-fullgraph",
        help="torch.compile must make one graph.",
        panel=RUNNING,
    )
    dynamic: bool = option(
        True,
        "--dynamic/--static",
        help=".pt2: dynamic batch and sequence dims (a batch of one is exported as two, "
        "so that it stays dynamic) [default: dynamic].",
        panel=OUTPUT,
    )

    # performance (#12): MiB the dump writer's thread may hold copied but not yet written
    max_inflight_mb: int = option(
        32,
        "--max-inflight",
        help="MiB of tensors copied but not yet written that the writer thread may hold "
        "(pinned for CUDA); the run waits when it is full; 0 writes inline [default: 32].",
        metavar="MIB",
        panel=OUTPUT,
        param="max_inflight",
    )

    # generate (and compare --generate N): decoding, and which steps keep tensors; None: what
    # the model's generation config says (max_new_tokens: its own, else 20)
    max_new_tokens: int | None = option(
        help="New tokens to generate at most (fewer when the model ends with EOS) [default: "
        "the model's generation config, else 20].",
        metavar="N",
        panel=RUNNING,
        variants={
            "compare": {
                "flags": ("--generate",),
                "help": "Compare N decoding steps of generate(), the candidate forced to the "
                "reference's tokens; loads the model with its LM head unless --model-class says "
                "otherwise (see `modeltap generate`).",
                "param": "generate",
            }
        },
    )
    do_sample: bool | None = option(
        None,
        "--do-sample/--greedy",
        help="Sample each token (seeded by --seed) instead of taking the likeliest [default: "
        "the model's generation config, else greedy].",
        panel=RUNNING,
    )
    num_beams: int | None = option(
        help="Beam search with N beams (1: one sequence per prompt) [default: the model's "
        "generation config].",
        metavar="N",
        panel=RUNNING,
    )
    temperature: float | None = option(
        help="Sampling temperature (with --do-sample).", metavar="T", panel=RUNNING
    )
    top_k: int | None = option(
        help="Sample among the K likeliest tokens (with --do-sample).", metavar="K", panel=RUNNING
    )
    top_p: float | None = option(
        help="Sample among the likeliest tokens holding probability P (with --do-sample).",
        metavar="P",
        panel=RUNNING,
    )
    full: bool = option(
        False,
        "--full/--ends",
        help="Tensors of every step [default: of the prefill and the last step; statistics "
        "for the others].",
        panel=OUTPUT,
    )
    steps: str | None = option(
        help="Tensors of these steps only, e.g. 0,5-9 (step 0 is the prompt's forward).",
        metavar="LIST",
        panel=OUTPUT,
    )
    kv: bool = option(
        False,
        "--kv/--no-kv",
        help="Also store each step's new self-attention keys and values (cache:LAYER.key).",
        panel=OUTPUT,
    )


FIELDS = {f.name: f for f in dataclasses.fields(Settings)}


def _scalar(annotation: Any) -> type:
    """The type a TOML value or an environment variable must have: `int | None` -> int,
    `list[str]` -> list."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return _scalar(args[0])
    return typing.get_origin(annotation) or annotation


HINTS = typing.get_type_hints(Settings)
# Scalar types of each field, for checking TOML values and parsing environment variables.
TYPES: dict[str, type] = {name: _scalar(hint) for name, hint in HINTS.items()}


def cli_option(name: str, command: str | None = None) -> CliOption | None:
    """The command-line declaration of field `name` (as `command` shows it), None if it has none."""
    declared = FIELDS[name].metadata.get("cli")
    return declared.for_command(command) if declared is not None else None
