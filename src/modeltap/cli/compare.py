"""`modeltap compare`: run a model and a variant of it; say which module introduced the error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from modeltap.cli.app import app, handle_errors, refuse, stderr, stdout, write_atomically
from modeltap.cli.inputs import command_name, offered_flags, sorted_inputs
from modeltap.cli.options import LOAD, SELECT, Given, command
from modeltap.cli.printing import note, print_report, write_html
from modeltap.config import Settings
from modeltap.config.declare import CliOption
from modeltap.errors import InputError

REPORT_FILE = "report.json"

REST = CliOption(
    argument=True,
    help="[CANDIDATE] TEXT...: a second checkpoint to compare with (without --against, or a "
    "folder holding config.json), then the sentences or image / audio files.",
    show_default=False,
    metavar="TEXT",
    type=list[str] | None,
)


@app.command("compare")
@handle_errors
@command(
    "compare",
    "model",
    ("rest", REST),
    "against",
    "bisect",
    "bisect_out",
    "target",
    "ops",
    "input_file",
    *SELECT,
    "preset",
    "atol",
    "rtol",
    "map",
    "equal_nan",
    "out_dir",
    "stats_only",
    "json_out",
    "junit",
    "html",
    "show_all",
    *LOAD,
    "dtype",
    "device",
    "seed",
    "train_mode",
    "use_cache",
    "max_new_tokens",
    "do_sample",
    "num_beams",
    "config",
    apart=("atol", "rtol"),  # over the preset, which the variant picks
)
def compare_command(
    s: Settings,
    given: Given,
    *,
    rest: list[str] | None,
    json_out: bool,
    junit: Path | None,
    html: Path | None,
    show_all: bool,
) -> None:
    """Compare a model with a variant (bf16, attn:eager, a checkpoint...): where they part ways,
    and which module introduced the error; exit 0 within tolerance, 1 when not."""
    from modeltap.compare import DEFAULT_PRESET, parse_against

    _split_positionals(s, list(rest or []))
    generate = given["generate"]
    if generate is None:
        refuse(
            given.flags("do_sample", "num_beams"),
            "can't apply without --generate",
            "add --generate N or drop {flags}",
        )
    variant = parse_against(s.against)
    _check_bisect(s, variant, generate)
    if s.ops and (generate is not None or variant.backend):
        raise InputError(
            "--ops runs the eager variant's ops on one forward; drop --ops, or --generate and "
            "--against compile/export"
        )
    if variant.backend:  # before the weights load
        from modeltap.compare.backends import check_depth

        check_depth(variant.backend, s.depth)
    _check_models_and_inputs(s, given)
    preset_name = s.preset or _default_preset(DEFAULT_PRESET[variant.kind])
    options = _options(s, preset_name, atol=given["atol"], rtol=given["rtol"])
    if junit is not None:
        from modeltap.dump import check_writable

        check_writable(junit, "--junit")
    if html is not None:
        from modeltap.render.report.write import check_html_target

        check_html_target(html)
    work = _out_dir(s.out_dir)
    if generate is not None:
        passed = _compare_generation(
            s, variant, options, work, seed_given=given["seed"] is not None,
            class_given=given["model_class"] is not None, json_out=json_out, show_all=show_all,
            refused={
                "--junit": junit, "--html": html, "--stats-only": s.stats_only,
                "--use-cache": s.use_cache,
            },
        )  # fmt: skip
        raise typer.Exit(0 if passed else 1)

    from modeltap.compare.forward_run import compare_forward_run

    report = compare_forward_run(
        s, variant, options, work, command=f"modeltap {command_name()}",
        offered=offered_flags(), note=note, status=stderr().status,
    )  # fmt: skip
    report.preset = preset_name
    _check_bisected(report.bisection, preset_name)
    _write_report(report, work, junit=junit, html=html, json_out=json_out, show_all=show_all)
    if report.bisection is not None:
        raise typer.Exit(_write_bisection(report.bisection, s.bisect_out, json_out=json_out))
    raise typer.Exit(0 if report.passed else 1)


def _check_bisect(s: Settings, variant: Any, generate: int | None) -> None:
    """--bisect needs a quantized variant and one forward; --bisect-out and --target need
    --bisect, and --target one of its two forms."""
    if s.bisect_out is not None and not s.bisect:
        raise InputError("--bisect-out writes what --bisect finds; add --bisect")
    if s.target is not None:
        from modeltap.compare.bisect import parse_target

        parse_target(s.target)
        if not s.bisect:
            raise InputError("--target sets what --bisect aims for; add --bisect")
    if not s.bisect:
        return
    if not variant.quant:
        raise InputError(
            "--bisect keeps modules out of a quantized variant; give --against fp8, mxfp8, "
            "nvfp4, int8-weight or int4-weight"
        )
    if generate is not None:
        raise InputError("--bisect runs one forward; drop --generate")
    if s.bisect_out is not None:
        from modeltap.compare.bisect import check_bisect_out

        check_bisect_out(Path(s.bisect_out))


def _check_bisected(result: Any, preset: str) -> None:
    """A compare that passes with every Linear quantized leaves --bisect nothing to find: one
    line, exit 2, before any file is written."""
    if result is None or not result.curve or not result.curve[0].passed:
        return
    goal = result.goal if result.target else f"the {preset} preset"
    raise InputError(
        f"--bisect: nothing needs keeping: with every Linear {result.variant} "
        f"({result.engine}) the output is within {goal} (error {result.error:.3g}); drop "
        "--bisect, or ask for more with --target sqnr=DB"
    )


def _write_bisection(result: Any, out: str | None, *, json_out: bool) -> int:
    """The set to --bisect-out and (without --json) as text; 0 when the output passes with it."""
    if out is not None:
        from modeltap.compare.bisect import bisect_file

        write_atomically(Path(out), bisect_file(result, Path(out)))
        stderr().print(f"wrote {out}: modules_to_not_convert ({len(result.kept)})")
    if not json_out:
        from modeltap.render.bisect import bisect_text

        stdout().print(bisect_text(result))
    return 0 if result.passed else 1


def _options(s: Settings, preset_name: str, *, atol: float | None, rtol: float | None) -> Any:
    """compare's tolerances (preset < settings < flags) and run options."""
    from modeltap.compare import Options
    from modeltap.config import accumulated_allowance, tolerance_values
    from modeltap.diff import Tolerance

    values = tolerance_values(s, atol=atol, rtol=rtol, preset=preset_name)
    return Options(
        tolerance=Tolerance(**values),
        overrides=[(glob, Tolerance(**{**values, **tol})) for glob, tol in s.overrides.items()],
        accumulated_scaled_atol=accumulated_allowance(s, preset_name),
        equal_nan=s.equal_nan,
        train_mode=s.train_mode,
        seed=s.seed,
    )


def _write_report(
    report: Any,
    work: Path | None,
    *,
    junit: Path | None,
    html: Path | None,
    json_out: bool,
    show_all: bool,
) -> None:
    """report.json in --out-dir, the JUnit XML, the HTML page, then the report on stdout."""
    if work is not None:
        write_atomically(work / REPORT_FILE, json.dumps(report.to_json(), indent=1))
    if junit is not None:
        from modeltap.diff import junit_xml

        notes = {
            p.key: f"module {m.name}: {m.verdict.replace('_', ' ')}"
            for m in report.modules
            for p in m.cumulative
            if report.module_of(p) == m.name
        }
        write_atomically(junit, junit_xml(report.cumulative, name="modeltap compare", notes=notes))
    if html is not None:
        from modeltap.render.report import compare_page
        from modeltap.render.report.write import invocation

        command = invocation("compare", ["--html", str(html)])
        write_html(html, compare_page(report.to_json(), command=command))
    from modeltap.render import compare_heading, compare_table

    print_report(report, compare_heading, compare_table, json_out=json_out, show_all=show_all)
    if work is not None:
        stderr().print(
            f"wrote {work}/: candidate.safetensors, reference.safetensors, {REPORT_FILE}"
        )


def _compare_generation(
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
    """`compare --generate N`: check, run `compare_generation_run`, print; True when it passed."""
    from modeltap.compare.generation_run import check_generation_request, compare_generation_run

    check_generation_request(s, refused, seed_given=seed_given)
    result = compare_generation_run(
        s, variant, options, work, class_given=class_given, offered=offered_flags(), note=note,
        status=stderr().status,
    )  # fmt: skip
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
        stderr().print(
            f"wrote {work}/: candidate.gen.safetensors, reference.gen.safetensors, report.json"
        )
    return result.passed


def _check_replayable(model: str, what: str) -> None:
    from modeltap.loading.transformed import is_transformed

    if is_transformed(model):
        raise InputError(
            f"{what} '{model}' is an archive or a factory; compare replays a transformers "
            "model's modules, so give a Hugging Face id or a folder with config.json (or dump "
            "each model and `modeltap diff` the dumps)"
        )


def _check_models_and_inputs(s: Settings, given: Given) -> None:
    """A MODEL, something to compare it with and something to run on, each given once."""
    if not s.model:
        raise InputError("no MODEL given; pass one, or set `model` in modeltap.toml")
    _check_replayable(s.model, "MODEL")
    if s.candidate is not None:
        _check_replayable(s.candidate, "CANDIDATE")
    if given["stats_only"] and not s.out_dir:
        raise InputError("--stats-only applies to the dumps --out-dir keeps; give --out-dir DIR")
    if s.candidate is None and s.against is None:
        raise InputError("nothing to compare with; give a CANDIDATE model or --against bf16, ...")
    run_on = s.texts or s.images or s.audio
    if run_on and s.input_file:
        raise InputError("give TEXT or FILEs, or --input-file, not both")
    if not run_on and not s.input_file:
        if s.against is None:
            raise InputError(
                f"nothing to run on, or nothing to compare with: '{s.candidate}' was taken for "
                "the CANDIDATE model; give TEXT after it, or --against bf16, ... for a variant"
            )
        raise InputError("nothing to run on; give TEXT or --input-file")


def _split_positionals(s: Settings, rest: list[str]) -> None:
    """MODEL [CANDIDATE] TEXT...: the first of `rest` is the candidate without --against, or with
    it when it is a folder holding config.json; the others are sentences."""
    if rest and s.candidate is None:
        first = Path(rest[0]).expanduser()
        if s.against is None or (first / "config.json").is_file():
            s.candidate, rest = rest[0], rest[1:]
    if rest:
        for name, values in sorted_inputs(rest, None, None, None).items():
            if values:
                setattr(s, name, values)


def _out_dir(path: str | None) -> Path | None:
    if path is None:
        return None
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise InputError(f"--out-dir '{folder}' is a file; give a folder")
    if not folder.parent.is_dir():
        raise InputError(f"--out-dir: folder '{folder.parent}' does not exist; create it first")
    from modeltap.dump import check_writable

    check_writable(folder / REPORT_FILE, "--out-dir")
    folder.mkdir(exist_ok=True)
    return folder


def _default_preset(name: str) -> str:
    """`name`, or fp32 when the tolerance presets have no such preset (a user's own
    tolerances.toml may leave it out); a preset that is there but wrong is an error."""
    from modeltap.config import preset_names

    return name if name in preset_names() else "fp32"
