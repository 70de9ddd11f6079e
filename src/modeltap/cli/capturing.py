"""What `dump` and `grads` share: check the request, resolve the model and inputs, run
`dump_model`, print the dump and what the backend noted."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from modeltap.cli.app import stderr
from modeltap.cli.inputs import command_name, offered_flags
from modeltap.cli.printing import note, print_opened
from modeltap.errors import InputError

if TYPE_CHECKING:
    from modeltap.config import Settings


def run_dump(
    s: Settings, *, json_out: bool, grads: bool, activations: bool, allow_pickle: bool = False
) -> None:
    """dump and grads: check, load, run, write, print."""
    from modeltap.loading.resolve import prepare_inputs, resolve
    from modeltap.loading.transformed import is_transformed

    spec = _grad_spec(s) if grads else None
    path, backend = _checked_request(s, activations)
    prepared = None if is_transformed(s.model or "") else prepare_inputs(
        s, offered=offered_flags(), note=note
    )
    err = stderr()
    with err.status(f"loading {s.model}"):
        resolved = resolve(
            s,
            command=f"modeltap {command_name()}",
            allow_pickle=allow_pickle,
            need_tokenizer=s.loss == "mlm",
            prepared=prepared,
            offered=offered_flags(),
            note=note,
        )
    if resolved.backend is not None:
        if backend is not None:
            raise InputError("--compile runs an nn.Module; an archive runs as it is")
        if spec is not None:
            raise InputError(f"gradients need the eager model; dump '{s.model}' without --grads")
        backend = resolved.backend
    written = _dump(s, resolved, path, spec=spec, activations=activations, backend=backend)
    _print_written(written, resolved.loaded, json_out=json_out)


def _grad_spec(s: Settings) -> Any:
    from modeltap.grads import GradSpec

    spec = GradSpec.from_settings(s)
    spec.check()
    if s.inputs:
        raise InputError("--inputs is for activations only; drop it with gradients")
    return spec


def _checked_request(s: Settings, activations: bool) -> tuple[Path, Any]:
    """Before anything loads: a model and inputs given, the output writable, the placement and
    the compile backend valid. (the dump's path, the compile backend or None)"""
    from modeltap.dump import check_writable
    from modeltap.dumping import default_out
    from modeltap.loading.resolve import check_placement
    from modeltap.loading.transformed import is_transformed

    if not s.model:
        raise InputError("no MODEL given; pass one, or set `model` in modeltap.toml")
    if (s.texts or s.images or s.audio) and s.input_file:
        raise InputError("give TEXT or FILEs, or --input-file, not both")
    if not (s.texts or s.images or s.audio or s.input_file or is_transformed(s.model)):
        raise InputError("nothing to run on; give TEXT, an image or audio FILE, or --input-file")
    if s.max_inflight_mb < 0:
        raise InputError(f"--max-inflight is {s.max_inflight_mb}; give MiB >= 0 (0 writes inline)")
    _formats(s)
    path = Path(s.out) if s.out else default_out(s.model, grads_only=not activations)
    check_writable(path)
    if check_placement(s) is not None:
        from modeltap.loading.placement import return_freed_memory

        return_freed_memory()
    backend = None
    if s.compile:
        from modeltap.capture.compile import CompileBackend, check_backend

        check_backend(s.compile_backend)
        backend = CompileBackend(s.compile_backend, s.fullgraph)
    return path, backend


def _dump(
    s: Settings, resolved: Any, path: Path, *, spec: Any, activations: bool, backend: Any
) -> Path:
    from modeltap.dumping import dump_model
    from modeltap.loading.resolve import run_metadata
    from modeltap.selection import Selection

    loaded, tok = resolved.loaded, resolved.tokenizer
    with stderr().status(f"running {loaded.model_class}"):
        return dump_model(
            loaded.model,
            resolved.inputs,
            path,
            selection=Selection(s.depth, tuple(s.include), tuple(s.exclude)),
            capture_inputs=s.inputs,
            ops=s.ops,
            train_mode=s.train_mode,
            seed=s.seed,
            stats_only=s.stats_only,
            dead_threshold=s.dead_threshold,
            metadata=run_metadata(s, loaded),
            grads=spec,
            activations=activations,
            mask_token_id=getattr(tok, "mask_token_id", None),
            special_ids=tuple(getattr(tok, "all_special_ids", ())),
            backend=backend,
            max_inflight=s.max_inflight_mb << 20,
            hist=s.hist,
            formats=_formats(s),
        )


def _formats(s: Settings) -> tuple[str, ...]:
    """--formats as names, or an InputError that lists the known ones."""
    from modeltap.stats.formats import check_formats

    return tuple(check_formats(s.formats.split(","))) if s.formats else ()


def _print_written(written: Path, loaded: Any, *, json_out: bool) -> None:
    from modeltap.dump import load_dump

    err = stderr()
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

