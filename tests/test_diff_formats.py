"""`modeltap diff` of dumps and runs written with --formats: each side's figures per paired key,
and the keys that fall below a threshold in A (the candidate) that B's are above, checked against
the figures recomputed here from the dumped tensors with test_formats' reference quantizer and
the tree's thresholds."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open
from typer.testing import CliRunner

from modeltap.cli import app
from modeltap.render.tree import FORMAT_BAD_DB, FORMAT_WARN_DB
from tests.fixtures.format_runs import FORMATS, spiked_pair, spiked_run
from tests.fixtures.quant_reference import assert_figures, reference_figures

runner = CliRunner()


def invoke(*args: object):
    return runner.invoke(app, ["diff", *[str(a) for a in args]], env={"COLUMNS": "160"})


def reference(path: Path, formats=FORMATS) -> dict[str, dict[str, dict]]:
    """key -> format -> figures, recomputed from the tensors stored in `path`."""
    with safe_open(str(path), "pt") as f:
        return {k: {n: reference_figures(f.get_tensor(k), n) for n in formats} for k in f.keys()}


def stored(path: Path) -> dict[str, dict]:
    with safe_open(str(path), "pt") as f:
        return json.loads(f.metadata()["stats"])


def rank(db: float | None) -> int:
    """0 above both thresholds (or exact), 1 below FORMAT_WARN_DB, 2 below FORMAT_BAD_DB."""
    return 0 if db is None or db >= FORMAT_WARN_DB else 1 if db >= FORMAT_BAD_DB else 2


def test_diff_carries_each_sides_figures_and_names_the_keys_that_cross(tmp_path: Path) -> None:
    b, a = spiked_pair(tmp_path)  # A, the candidate, has the spike
    result = invoke(a, b, "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    ref = {"a": reference(a), "b": reference(b)}
    meta = {"a": stored(a), "b": stored(b)}
    crossed, recovered = [], []
    for pair in report["pairs"]:
        keys = {"a": pair["key"], "b": pair.get("other", pair["key"])}
        for name in FORMATS:
            for side in ("a", "b"):
                got = pair["formats"][name][side]
                assert got == meta[side][keys[side]]["formats"][name]
                assert_figures(got, ref[side][keys[side]][name])
            dbs = [ref[side][keys[side]][name]["sqnr_db"] for side in ("a", "b")]
            if rank(dbs[0]) != rank(dbs[1]):
                (crossed if rank(dbs[0]) > rank(dbs[1]) else recovered).append(
                    (pair["key"], name, dbs)
                )
    assert ("1", "int8") in [c[:2] for c in crossed]  # the spiked module, at least
    part = report["formats"]
    assert part["names"] == list(FORMATS)
    assert part["thresholds_db"] == {"bad": FORMAT_BAD_DB, "warn": FORMAT_WARN_DB}
    assert [(c["key"], c["format"]) for c in part["crossed"]] == [c[:2] for c in crossed]
    assert [(c["key"], c["format"]) for c in part["recovered"]] == [c[:2] for c in recovered]
    # The text report lists each crossing with both sides' SQNR, and the table a column a format.
    text = invoke(a, b).stdout
    lines = text.splitlines()
    for key, name, (da, db) in crossed:
        assert any(
            line.split()[:2] == [key, name] and f"{da:.1f} vs {db:.1f}" in line for line in lines
        ), text
    header = next(line for line in lines if line.startswith("key "))
    assert header.split()[-len(FORMATS) :] == list(FORMATS)


def test_diff_of_dumps_without_formats_says_nothing_of_them(tmp_path: Path) -> None:
    import torch

    import modeltap
    from tests.fixtures.format_runs import spiked_model

    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(1))
    a = modeltap.dump(spiked_model(False), x, tmp_path / "a.safetensors")
    b = modeltap.dump(spiked_model(True), x, tmp_path / "b.safetensors")
    report = json.loads(invoke(a, b, "--json").stdout)
    assert "formats" not in report and all("formats" not in p for p in report["pairs"])
    assert "formats" not in invoke(a, b).stdout


def test_run_diff_names_the_first_step_a_key_crosses_in_b(tmp_path: Path) -> None:
    """Runs A (module `1` spiked from step 2) and B (no spike): the run diff names, per key and
    format, the first common step where A's SQNR sits below a threshold B's is above."""
    run_a = spiked_run(tmp_path / "a", 2)
    run_b = spiked_run(tmp_path / "b", None)
    result = invoke(run_a, run_b, "--json")
    report = json.loads(result.stdout)
    expected: dict[tuple[str, str], tuple[int, float, float]] = {}
    for step in range(5):
        name = f"step{step:06d}.rank0.safetensors"
        ref_a, ref_b = reference(run_a / name, ["int8"]), reference(run_b / name, ["int8"])
        for key in (k for k in ref_a if k in ref_b):
            da, db = ref_a[key]["int8"]["sqnr_db"], ref_b[key]["int8"]["sqnr_db"]
            if rank(da) > rank(db):
                expected.setdefault((key, "int8"), (step, da, db))
    assert expected[("1", "int8")][0] == 2 and min(s for s, _, _ in expected.values()) == 2
    got = {(c["key"], c["format"]): c for c in report["formats"]["crossed"]}
    assert set(got) == set(expected)
    for pair, (step, da, db) in expected.items():
        assert got[pair]["step"] == step and got[pair]["rank"] == 0
        assert abs(got[pair]["a_db"] - da) < 1e-4 and abs(got[pair]["b_db"] - db) < 1e-4
    text = invoke(run_a, run_b).stdout
    assert any(line.split()[:4] == ["2", "0", "1", "int8"] for line in text.splitlines()), text
