"""modeltap.record: checked against tensors captured with plain hooks and autograd in the test."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import modeltap
from modeltap.cli import app
from modeltap.dump import load_dump
from modeltap.errors import InputError
from modeltap.record import (
    DeadUnits,
    NonFiniteError,
    Saturation,
    UpdateRatio,
    VanishingGradient,
    read_run,
)
from tests.fixtures.poison import Tiny, batch

ROOT = Path(__file__).resolve().parent.parent


def run_steps(
    model: nn.Module, out: Path, steps: int, *, lr: float = 1e-3, before=None, **options
) -> tuple[modeltap.record.Recording, list]:
    """Train `steps` steps under record(); `before(step)` runs first each step. Returns hits."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    hits = []
    with modeltap.record(model, out, **options) as rec:
        for step in range(steps):
            if before is not None:
                before(step)
            model(batch(step)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            hits += rec.step()
    return rec, hits


def test_recorded_statistics_equal_plain_hooks(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Tiny()
    acts: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():

        def hook(m, a, out, name=name or "__root__"):
            acts[name] = out.detach().clone()
            out.register_hook(lambda g: grads.__setitem__(name, g.clone()))

        module.register_forward_hook(hook)
    seen = {}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with modeltap.record(model, tmp_path / "run", every=2) as rec:
        for step in range(5):
            acts.clear()
            grads.clear()
            model(batch(step)).square().mean().backward()
            params = {n: p.grad.clone() for n, p in model.named_parameters()}
            opt.step()
            opt.zero_grad()
            rec.step()
            seen[step] = (dict(acts), dict(grads), params)
    files = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert files == [
        "index.rank0.jsonl",
        "step000000.rank0.safetensors",
        "step000002.rank0.safetensors",
        "step000004.rank0.safetensors",
    ]
    for step in (0, 2, 4):
        dump = load_dump(tmp_path / "run" / f"step{step:06d}.rank0.safetensors")
        meta = dump.metadata
        assert (meta["step"], meta["rank"], meta["world_size"], meta["dist_backend"]) == (
            str(step),
            "0",
            "1",
            "none",
        )
        assert dump.stats_only
        acts, grads, params = seen[step]
        assert set(acts) == {k for k in dump.keys() if not k.startswith("grad/")}
        for key, t in acts.items():
            s = dump.stats_for(key)
            assert s.norm == pytest.approx(float(t.double().norm()), rel=1e-6)
            assert s.mean == pytest.approx(float(t.double().mean()), rel=1e-6, abs=1e-9)
            assert (s.min, s.max) == (float(t.min()), float(t.max()))
            assert s.dead == int((t <= 0).all(dim=0).sum())
        for key, g in grads.items():
            s = dump.stats_for("grad/" + key)
            assert s.norm == pytest.approx(float(g.double().norm()), rel=1e-6)
        for name, g in params.items():
            s = dump.stats_for("grad/" + name)
            assert s.norm == pytest.approx(float(g.double().norm()), rel=1e-6)
            assert s.zeros == int((g == 0).sum())
        updates = json.loads(meta["updates"])
        assert set(updates) == set(params)


def test_steps_not_recorded_touch_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from modeltap.dump import DumpWriter

    calls: list[int] = []
    step_now = [0]
    real_tensor = DumpWriter.tensor
    real_register = torch.Tensor.register_hook

    def counting_tensor(self, key, tensor, **kw):
        calls.append(step_now[0])
        return real_tensor(self, key, tensor, **kw)

    def counting_register(self, hook):
        calls.append(step_now[0])
        return real_register(self, hook)

    monkeypatch.setattr(DumpWriter, "tensor", counting_tensor)
    monkeypatch.setattr(torch.Tensor, "register_hook", counting_register)
    torch.manual_seed(0)
    run_steps(
        Tiny(),
        tmp_path / "run",
        4,
        every=3,
        on_nonfinite="off",
        before=lambda s: step_now.__setitem__(0, s),
    )
    assert set(calls) == {0, 3}
    assert sorted(p.name for p in (tmp_path / "run").glob("step*")) == [
        "step000000.rank0.safetensors",
        "step000003.rank0.safetensors",
    ]


def test_everything_comes_off_also_on_errors(tmp_path: Path) -> None:
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    torch.manual_seed(0)
    model = Tiny()
    pre, post = len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks)
    with pytest.raises(KeyError):
        with modeltap.record(model, tmp_path / "run", every=1):
            model(batch(0)).sum().backward()
            raise KeyError("the user's loop failed")
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
    assert (len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks)) == (pre, post)
    left = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert left == ["index.rank0.jsonl"]  # the unfinished step left no file, not even a temporary


@pytest.mark.parametrize("mode", ["raise", "dump"])
def test_tripwire_names_the_module_that_made_the_nan(tmp_path: Path, mode: str) -> None:
    torch.manual_seed(0)
    model = Tiny()

    def poison(step: int) -> None:
        model.fc2.on = step == 3

    with pytest.raises(NonFiniteError) as caught:
        run_steps(model, tmp_path / "run", 6, every=100, on_nonfinite=mode, before=poison)
    trip = caught.value.trip
    assert (trip.step, trip.phase, trip.module, trip.key) == (3, "forward", "fc2", "fc2")
    assert not trip.propagated
    assert trip.stats["nan"] == 1
    assert set(trip.inputs) == {"fc2:in.0"}
    assert trip.inputs["fc2:in.0"]["nan"] == 0
    assert "module 'fc2' (Poison)" in str(caught.value)
    index = read_run(tmp_path / "run")
    assert [t["step"] for t in index.ranks[0].trips] == [3]
    path = tmp_path / "run" / "step000003.rank0.safetensors"
    if mode == "raise":
        assert not path.exists()
        return
    dump = load_dump(path)
    assert not dump.stats_only
    assert json.loads(dump.metadata["tripwire"])["module"] == "fc2"
    x = dump["fc2:in.0"]
    expected = x @ model.fc2.weight.detach().T + model.fc2.bias.detach()
    expected[0, 0] = float("nan")
    torch.testing.assert_close(dump["fc2"], expected, equal_nan=True)
    assert torch.isnan(dump["tanh"][0, 0]) and torch.isfinite(dump["fc1"]).all()


@pytest.mark.parametrize("mode", ["raise", "dump"])
def test_tripwire_in_the_backward(tmp_path: Path, mode: str) -> None:
    torch.manual_seed(0)
    model = Tiny()

    def poison(step: int) -> None:
        model.gate.on = step == 3

    with pytest.raises(NonFiniteError) as caught:
        run_steps(model, tmp_path / "run", 6, every=100, on_nonfinite=mode, before=poison)
    trip = caught.value.trip
    # The NaN appears in the gradient w.r.t. gate's input (fc2's output), made by gate's backward.
    assert (trip.step, trip.phase, trip.module, trip.key) == (3, "backward", "gate", "grad/fc2")
    assert set(trip.inputs) == {"grad/gate"}
    # Raised at the end of the backward: the weights never saw the NaN.
    assert all(torch.isfinite(p).all() for p in model.parameters())
    if mode == "dump":
        dump = load_dump(tmp_path / "run" / "step000003.rank0.safetensors")
        assert torch.isnan(dump["grad/fc2"]).sum() == 1
        assert torch.isfinite(dump["grad/gate"]).all() and torch.isfinite(dump["grad/head"]).all()
        assert torch.isnan(dump["grad/fc1"]).any()  # passed on, not produced, by fc2 and act


def test_tripwire_warn_goes_on_and_reports_propagation(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with caplog.at_level(logging.WARNING, logger="modeltap.record"):
        with modeltap.record(model, tmp_path / "run", every=100, on_nonfinite="warn") as rec:
            x = batch(0)
            x[1, 2] = float("inf")  # non-finite data: no module is to blame
            model(x).sum().backward()
            opt.step()
            rec.step()
    forward = [t for t in rec.trips if t.phase == "forward"]
    assert forward[0].module == "fc1" and forward[0].propagated
    assert "inputs were already non-finite" in caplog.text


def _hits(rules, model: nn.Module, tmp_path: Path, name: str, **options):
    _, hits = run_steps(model, tmp_path / name, 1, every=1, rules=rules, **options)
    lines = (tmp_path / name / "index.rank0.jsonl").read_text().splitlines()
    indexed = [h for line in lines for h in json.loads(line).get("hits", [])]
    assert [h.to_json() for h in hits] == indexed
    return {(h.rule, h.key) for h in hits}


def test_rules_fire_on_constructed_cases(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    rules = [VanishingGradient(1e-6), DeadUnits(0.5), Saturation(0.9), UpdateRatio(1e-9, 1e-1)]
    healthy = _hits(rules, Tiny(), tmp_path, "healthy")
    assert healthy == set()

    torch.manual_seed(0)
    model = Tiny()
    with torch.no_grad():
        model.fc2.weight.mul_(1e-6)  # gradients upstream of fc2 shrink a millionfold
    hits = _hits(rules, model, tmp_path, "vanishing")
    assert {k for r, k in hits if r == "vanishing_gradient"} == {
        "grad/act",
        "grad/fc1",
        "grad/fc1.weight",
        "grad/fc1.bias",
    }  # not fc2's own gradients, nor anything downstream of it

    torch.manual_seed(0)
    model = Tiny()
    with torch.no_grad():
        model.fc1.bias.fill_(-100.0)  # every ReLU unit dead
    with caplog.at_level(logging.WARNING, logger="modeltap.record"):
        hits = _hits(rules, model, tmp_path, "dead")
    assert ("dead_units", "act") in hits and ("dead_units", "fc1") in hits
    assert "dead_units: act: 16/16 units dead" in caplog.text

    torch.manual_seed(0)
    model = Tiny()
    with torch.no_grad():
        model.fc2.weight.mul_(1000.0)  # tanh's input is huge: outputs sit at +-1
    assert ("saturation", "tanh") in _hits(rules, model, tmp_path, "saturated")

    torch.manual_seed(0)
    hits = _hits(rules, Tiny(), tmp_path, "big-steps", lr=10.0)
    assert ("update_ratio", "head.weight") in hits


def test_show_run_folder_and_one_step(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Tiny()

    def poison(step: int) -> None:
        model.fc2.on = step == 3

    with pytest.raises(NonFiniteError):
        run_steps(model, tmp_path / "run", 5, every=1, on_nonfinite="dump", before=poison)
    runner = CliRunner()
    result = runner.invoke(app, ["show", str(tmp_path / "run")], env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    assert "3 recorded steps (0..2, every 1)" in result.output
    assert "tripwire: step 3 forward: module 'fc2' (Poison)" in result.output
    assert "NaN@3 forward" in result.output
    assert "head.weight" in result.output
    result = runner.invoke(app, ["show", str(tmp_path / "run"), "--step", "3"])
    assert result.exit_code == 0, result.output
    assert "step 3, rank 0 of 1" in result.output and "fc2" in result.output
    result = runner.invoke(app, ["show", str(tmp_path / "run"), "--json"])
    assert [s["step"] for s in json.loads(result.output)["ranks"]["0"]["steps"]] == [0, 1, 2]
    result = runner.invoke(app, ["show", str(tmp_path / "run"), "--step", "7"])
    assert result.exit_code == 2
    assert "step 7 was not recorded on rank 0; recorded: 0, 1, 2, 3" in result.output
    result = runner.invoke(app, ["show", str(tmp_path / "run"), "--rank", "1"])
    assert result.exit_code == 2 and "no rank 1" in result.output
    step_file = str(tmp_path / "run" / "step000000.rank0.safetensors")
    assert runner.invoke(app, ["show", step_file]).exit_code == 0
    result = runner.invoke(app, ["show", step_file, "--step", "0"])
    assert result.exit_code == 2 and "for a run folder" in result.output
    result = runner.invoke(app, ["show", str(tmp_path)])
    assert result.exit_code == 2 and "no index.rank*.jsonl" in result.output


def test_bad_arguments(tmp_path: Path) -> None:
    model = Tiny()
    with pytest.raises(InputError, match="every"):
        modeltap.record(model, tmp_path, every=0)
    with pytest.raises(InputError, match="on_nonfinite"):
        modeltap.record(model, tmp_path, on_nonfinite="stop")
    (tmp_path / "file").write_text("")
    with pytest.raises(InputError, match="is a file"):
        modeltap.record(model, tmp_path / "file")


def test_a_step_left_without_step_is_written_at_the_end(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Tiny()
    with modeltap.record(model, tmp_path / "run", every=2) as rec:
        model(batch(0)).sum().backward()
        rec.step()
        model(batch(1)).sum().backward()
        rec.step()
        model(batch(2)).sum().backward()  # step 2, recorded, ends with the block
    with modeltap.record(model, tmp_path / "idle", every=1) as rec:
        rec.step()  # a step that never ran the model writes nothing
    assert sorted(p.name for p in (tmp_path / "run").glob("step*")) == [
        "step000000.rank0.safetensors",
        "step000002.rank0.safetensors",
    ]
    assert sorted(p.name for p in (tmp_path / "idle").iterdir()) == ["index.rank0.jsonl"]


def test_selected_modules_that_never_run_are_reported(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Tiny()
    model.unused = nn.Linear(2, 2)
    run_steps(model, tmp_path / "run", 1, every=1, include=["fc*", "unused"])
    dump = load_dump(tmp_path / "run" / "step000000.rank0.safetensors")
    assert json.loads(dump.metadata["record"])["not_run"] == ["unused"]
    assert [k for k in dump.keys() if not k.startswith("grad/")] == ["fc1", "fc2"]


# -- torchrun, 2 ranks, gloo on CPU ---------------------------------------------------------


def _reference_grads(steps: int, world: int) -> dict[int, dict[str, torch.Tensor]]:
    """Plain single-process training on every rank's batches: the gradient DDP averages."""
    sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
    try:
        import record_dist as worker
    finally:
        sys.path.pop(0)
    model = worker.make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=worker.LR)
    out = {}
    for step in range(steps):
        loss = sum(model(worker.batch(step, r)).square().mean() for r in range(world)) / world
        loss.backward()
        out[step] = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return out


@pytest.fixture(scope="module")
def dist_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists() or not torch.distributed.is_available():
        pytest.skip("needs torchrun and torch.distributed")
    out = tmp_path_factory.mktemp("dist")
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src"),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
    }
    command = [str(torchrun), "--standalone", "--nproc-per-node", "2"]
    command += [str(ROOT / "tests" / "fixtures" / "record_dist.py"), str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


PARAMS = ("0.weight", "0.bias", "2.weight", "2.bias")


def test_ddp_ranks_write_their_own_files_with_equal_param_grads(dist_runs: Path) -> None:
    run = dist_runs / "ddp"
    names = sorted(p.name for p in run.glob("step*"))
    assert names == [f"step00000{s}.rank{r}.safetensors" for s in (0, 2) for r in (0, 1)]
    reference = _reference_grads(3, 2)
    for step in (0, 2):
        a = load_dump(run / f"step{step:06d}.rank0.safetensors")
        b = load_dump(run / f"step{step:06d}.rank1.safetensors")
        assert (a.metadata["rank"], b.metadata["rank"]) == ("0", "1")
        assert a.metadata["world_size"] == "2" and a.metadata["dist_backend"] == "gloo"
        for name in PARAMS:
            assert torch.equal(a["grad/" + name], b["grad/" + name])
            torch.testing.assert_close(a["grad/" + name], reference[step][name])
        assert not torch.equal(a["0"], b["0"])  # each rank saw its own batch
    files = [str(run / f"step000002.rank{r}.safetensors") for r in (0, 1)]
    runner = CliRunner()
    assert runner.invoke(app, ["diff", *files, "--include", "grad/*.*"]).exit_code == 0
    assert runner.invoke(app, ["diff", *files, "--include", "0"]).exit_code == 1
    index = read_run(run)
    assert sorted(index.ranks) == [0, 1]
    assert [s["step"] for s in index.ranks[1].steps] == [0, 2]


def test_fsdp2_records_shards_and_gathers_full_grads(dist_runs: Path) -> None:
    reference = _reference_grads(3, 2)
    ddp = load_dump(dist_runs / "ddp" / "step000002.rank0.safetensors")
    shards = [load_dump(dist_runs / "fsdp" / f"step000002.rank{r}.safetensors") for r in (0, 1)]
    for name in PARAMS:
        key = "grad/" + name
        full = reference[2][name]
        placed = [json.loads(d.metadata["placements"])[key] for d in shards]
        rows = [(full.shape[0] + 1) // 2, full.shape[0] - (full.shape[0] + 1) // 2]
        for place, dump, n in zip(placed, shards, rows, strict=True):
            assert place["placements"] == ["Shard(dim=0)"]
            assert place["global_shape"] == list(full.shape) and place["mesh"] == [2]
            assert list(dump[key].shape) == place["local_shape"] == [n, *full.shape[1:]]
        torch.testing.assert_close(torch.cat([d[key] for d in shards]), full)
    gathered = sorted(p.name for p in (dist_runs / "fsdp-gather").glob("step*"))
    assert gathered == ["step000000.rank0.safetensors", "step000002.rank0.safetensors"]
    # Rank 1 takes part in gathering and writes nothing: no half index with a start event only.
    indexes = sorted(p.name for p in (dist_runs / "fsdp-gather").glob("index*"))
    assert indexes == ["index.rank0.jsonl"]
    full = load_dump(dist_runs / "fsdp-gather" / "step000002.rank0.safetensors")
    assert "placements" not in full.metadata
    for name in PARAMS:
        torch.testing.assert_close(full["grad/" + name], ddp["grad/" + name])
    assert json.loads(full.metadata["updates"]) == pytest.approx(
        json.loads(ddp.metadata["updates"]), rel=1e-6
    )


# the lazy tripwire of steps that are not recorded (record.sentinel) -------------------------


def _trip_fields(trip) -> tuple:  # noqa: ANN001
    stats = json.dumps(trip.stats)  # NaN sums compare as text
    return (trip.step, trip.phase, trip.module, trip.key, sorted(trip.inputs), stats)


@pytest.mark.parametrize("part", ["fc2", "gate"])
def test_an_unrecorded_step_is_checked_lazily_and_trips_as_the_full_tripwire(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, part: str
) -> None:
    """Steps 1-5 are not recorded: no module output is watched on them, yet a NaN made at step
    3 (forward by fc2, backward by gate) is named exactly as the full tripwire names it."""
    from modeltap.record import tripwire

    watched: list[str] = []
    forward = tripwire.Watch.forward

    def counted(self, name, *args, **kwargs) -> None:  # noqa: ANN001
        watched.append(name)
        forward(self, name, *args, **kwargs)

    monkeypatch.setattr(tripwire.Watch, "forward", counted)
    trips = {}
    for eager in (False, True):
        torch.manual_seed(0)
        model = Tiny()
        poisoned = getattr(model, part)
        steps = []

        def poison(step: int, poisoned=poisoned, steps=steps) -> None:  # noqa: ANN001
            steps.append(len(watched))
            poisoned.on = step == 3

        with pytest.raises(NonFiniteError) as caught:
            run_steps(
                model, tmp_path / f"run{eager}", 6, every=100, before=poison,
                eager_tripwire=eager,
            )  # fmt: skip
        trips[eager] = caught.value.trip
        per_step = [b - a for a, b in zip(steps, steps[1:], strict=False)]
        # step 0 recorded: 7 modules watched; 1 and 2: none (lazy) or 7 each (eager)
        assert per_step == ([7, 7, 7] if eager else [7, 0, 0]), per_step
    assert _trip_fields(trips[False]) == _trip_fields(trips[True])
    assert trips[False].module == part and trips[False].unreproduced is None


class Chance(nn.Module):
    """A NaN in its output when a draw of the global RNG is below 0.5 (as dropout draws)."""

    on = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 1.0
        if self.on and float(torch.rand(())) < 0.5:
            y[0, 0] = float("nan")
        return y


def _chance_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), Chance(), nn.Linear(8, 3))


def _draws(seed: int) -> tuple[float, float]:
    generator = torch.Generator().manual_seed(seed)
    return float(torch.rand((), generator=generator)), float(torch.rand((), generator=generator))


def test_the_rerun_draws_what_the_step_drew(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step runs again from its RNG states: the NaN that a draw made comes back. A control
    run again without them (set_rng_states a no-op) doesn't find it."""
    seed = next(s for s in range(100) if _draws(s)[0] < 0.5 <= _draws(s)[1])

    def run(name: str) -> NonFiniteError:
        model = _chance_model()

        def poison(step: int) -> None:
            model[1].on = step == 2
            torch.manual_seed(seed)

        with pytest.raises(NonFiniteError) as caught:
            run_steps(model, tmp_path / name, 4, every=100, before=poison)
        return caught.value

    found = run("restored")
    assert (found.trip.step, found.trip.module, found.trip.unreproduced) == (2, "1", None)
    from modeltap.record import flight

    monkeypatch.setattr(flight, "set_rng_states", lambda states: None)
    missed = run("control")
    assert missed.trip.module == "__root__" and missed.trip.step == 2
    assert "the model's output was non-finite, but the step run again" in str(missed)
    assert "eager_tripwire=True" in str(missed)


class Once(nn.Module):
    """A NaN in its first output after `armed` is set, then never again."""

    armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 1.0
        if self.armed:
            self.armed = False
            y[0, 0] = float("nan")
        return y


def test_a_trip_the_rerun_cannot_make_again_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from modeltap.selection import ROOT

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), Once(), nn.Linear(8, 3))

    def arm(step: int) -> None:
        model[1].armed = step == 2

    with caplog.at_level(logging.WARNING, logger="modeltap.record"):
        rec, _ = run_steps(model, tmp_path / "run", 4, every=100, on_nonfinite="warn", before=arm)
    # (warn goes on: the NaN reaches the backward and, through the update, later steps)
    assert (rec.trips[0].step, rec.trips[0].phase, rec.trips[0].module) == (2, "forward", ROOT)
    assert "step run again from the same inputs and RNG states" in caplog.text
    events = read_run(tmp_path / "run").ranks[0].trips
    assert events[0]["unreproduced"].startswith("the model's output was non-finite")
    shown = CliRunner().invoke(app, ["show", str(tmp_path / "run")], terminal_width=200)
    assert "tripwire: step 2 forward: the model's output was non-finite, but" in shown.output


class Masked(nn.Module):
    """Makes a NaN while `on`, which the code after it masks out."""

    on = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 1.0
        if self.on:
            y[0, 0] = float("nan")
        return y


def test_a_masked_nan_trips_only_the_eager_tripwire(tmp_path: Path) -> None:
    """The documented difference: a NaN that never reaches the output (nor a gradient) trips
    the full tripwire only."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(6, 3)
            self.masked = Masked()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) + torch.nan_to_num(self.masked(x.detach()), nan=0.0).sum() * 0

    def run(name: str, **options: bool) -> modeltap.record.Recording:
        torch.manual_seed(0)
        model = Model()

        def poison(step: int) -> None:
            model.masked.on = step == 2

        return run_steps(model, tmp_path / name, 4, every=100, before=poison, **options)[0]

    assert run("lazy").trips == []
    with pytest.raises(NonFiniteError) as caught:
        run("eager", eager_tripwire=True)
    assert (caught.value.trip.step, caught.value.trip.module) == (2, "masked")


def test_a_loop_that_never_calls_the_models_forward_keeps_the_full_check(tmp_path: Path) -> None:
    """A LightningModule whose training_step calls `self.net(x)`: the recorded model's own
    forward never runs, so there is no forward to run again; the full check stays on every step
    and names the module that made the NaN."""

    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = Tiny()

    torch.manual_seed(0)
    model = Wrapper()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(NonFiniteError) as caught:
        with modeltap.record(model, tmp_path / "run", every=100) as rec:
            for step in range(5):
                model.net.fc2.on = step == 3
                model.net(batch(step)).square().mean().backward()
                opt.step()
                opt.zero_grad()
                rec.step()
    trip = caught.value.trip
    assert (trip.step, trip.module, trip.unreproduced) == (3, "net.fc2", None)
    assert rec._sentinel is None


def test_lazy_trip_in_the_second_of_two_backwards_names_the_module(tmp_path: Path) -> None:
    """Two forwards, then their two backwards, on a step checked lazily: the first backward ends
    clean, and the second forward is still kept for its own backward's re-run (a clean backward
    once let go of every forward of the step, and the trip said its backward couldn't run again)."""
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with pytest.raises(NonFiniteError) as caught:
        with modeltap.record(model, tmp_path / "run", every=100, on_nonfinite="raise") as rec:
            for step in range(5):
                model.gate.on = False
                first = model(batch(step)).square().mean()
                model.gate.on = step == 3
                second = model(batch(step + 10)).square().mean()
                first.backward()
                second.backward()
                opt.step()
                opt.zero_grad()
                rec.step()
    trip = caught.value.trip
    assert trip.unreproduced is None
    assert (trip.step, trip.phase, trip.module, trip.key) == (3, "backward", "gate", "grad/fc2")


def test_lazy_warn_names_a_forward_once_not_again_in_its_backward(tmp_path: Path) -> None:
    """warn: a NaN made in the forward of a lazily checked step is named there; the step's
    backward carries that NaN and is not reported again as a backward that can't be run."""
    torch.manual_seed(0)
    model = Tiny()

    def poison(step: int) -> None:
        model.gate.on = step == 3  # a NaN gradient at 3; the weights are NaN from step 4 on

    rec, _ = run_steps(model, tmp_path / "run", 5, every=100, on_nonfinite="warn", before=poison)
    assert [(t.step, t.phase, t.module, t.unreproduced) for t in rec.trips] == [
        (3, "backward", "gate", None),
        (4, "forward", "fc1", None),
    ]


# non-finite gradients trip when an optimizer step is about to take them (issue 29, item 4b) --


@pytest.mark.parametrize("every", [1, 100])
def test_a_nan_gradient_that_no_optimizer_takes_is_a_skipped_step(
    tmp_path: Path, every: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A loop that steps no optimizer (backward only): a NaN that gate's backward makes at step 3
    reaches no weight, so the step is reported as skipped, with a warning naming gate, on a
    recorded step as on one checked lazily; with an optimizer it trips (the test above)."""
    torch.manual_seed(0)
    model = Tiny()
    with caplog.at_level(logging.WARNING, logger="modeltap.record"):
        with modeltap.record(model, tmp_path / "run", every=every) as rec:
            for step in range(5):
                model.gate.on = step == 3
                model(batch(step)).square().mean().backward()
                grads_nan = not all(torch.isfinite(p.grad).all() for p in model.parameters())
                model.zero_grad()
                rec.step()
                assert grads_nan is (step == 3)
    assert rec.trips == [] and rec.skipped == [3]
    assert read_run(tmp_path / "run").ranks[0].skipped == [3]
    assert "step 3: non-finite gradients that no optimizer step took" in caplog.text
    shown = CliRunner().invoke(app, ["show", str(tmp_path / "run")])  # no GradScaler here
    assert "skipped (inf/NaN gradients, no optimizer step): steps 3" in shown.output
    assert "GradScaler" not in shown.output
    assert "module 'gate' (PoisonGrad) gradient w.r.t. its input 'grad/fc2'" in caplog.text


@pytest.mark.parametrize("every", [1, 100])
@pytest.mark.parametrize("kind", ["sgd", "lbfgs"])
def test_a_nan_gradient_trips_when_the_closure_returns(
    tmp_path: Path, every: int, kind: str
) -> None:
    """`optimizer.step(closure)`: the closure's backward makes the NaN, and the trip comes when
    it returns, before the optimizer applies it (the weights stay finite), naming gate."""
    torch.manual_seed(0)
    model = Tiny()
    if kind == "lbfgs":
        opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NonFiniteError) as caught:
        with modeltap.record(model, tmp_path / "run", every=every) as rec:
            for step in range(5):

                def closure(step: int = step) -> torch.Tensor:
                    opt.zero_grad()
                    loss = model(batch(step)).square().mean()
                    loss.backward()
                    return loss

                model.gate.on = step == 3
                opt.step(closure)
                rec.step()
    trip = caught.value.trip
    assert (trip.step, trip.phase, trip.module, trip.key) == (3, "backward", "gate", "grad/fc2")
    assert trip.unreproduced is None
    assert all(torch.isfinite(p).all() for p in model.parameters())


class _AmplifyGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor  # type: ignore[attr-defined]
        return x * 1.0

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None  # type: ignore[attr-defined]


class AmplifyGrad(nn.Module):
    """Identity forward; its backward multiplies the gradient by `factor`: 1e7 overflows a
    float16 gradient of these sizes, not a float32 one."""

    factor = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _AmplifyGrad.apply(x, self.factor)


def test_a_float16_backward_overflow_on_an_unrecorded_step_is_named_by_the_rerun(
    tmp_path: Path,
) -> None:
    """fp16 autocast: a gradient that overflows float16 at step 3 (not recorded) is named as the
    full tripwire names it. The step's backward is run again when it ends, outside the autocast
    region: the re-run computes in the precision the step's forward ran in (in float32 it was
    finite, and the trip said the step could not be made again)."""
    trips = {}
    for eager in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), AmplifyGrad(), nn.Linear(16, 3))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        with pytest.raises(NonFiniteError) as caught:
            with modeltap.record(
                model, tmp_path / f"run{eager}", every=100, eager_tripwire=eager
            ) as rec:
                for step in range(5):
                    model[1].factor = 1e7 if step == 3 else 1.0
                    with torch.autocast("cpu", dtype=torch.float16):
                        y = model(batch(step))
                    y.float().square().mean().backward()
                    opt.step()
                    opt.zero_grad()
                    rec.step()
        trips[eager] = caught.value.trip
    trip = trips[False]
    assert (trip.step, trip.phase, trip.module, trip.key) == (3, "backward", "1", "grad/0")
    assert trip.unreproduced is None
    assert _trip_fields(trip) == _trip_fields(trips[True])


def test_the_verbs_stay_bound_over_their_packages(tmp_path: Path) -> None:
    # `modeltap.record` and `modeltap.capture` are verbs and packages of the same names. A new
    # process imports a module of each package first (the import system binds a package on its
    # parent at the package's first import): the names must still call the verbs, and still
    # reach the packages' names.
    code = f"""
import modeltap.record.recording, modeltap.capture.eager, pathlib, torch
import modeltap
from modeltap.record import Recording
torch.manual_seed(0)
net, x, run = torch.nn.Linear(3, 2), torch.randn(4, 3), pathlib.Path({str(tmp_path)!r})
with modeltap.record(net, run, every=1) as rec:
    net(x).sum().backward()
    rec.step()
assert isinstance(rec, Recording)
plain = torch.nn.functional.linear(x, net.weight, net.bias)
assert torch.equal(modeltap.capture(net, x)["__root__"], plain)
assert modeltap.record.RecordOptions is modeltap.record.options.RecordOptions
assert modeltap.capture.hooks is modeltap.capture.eager.hooks
print(*sorted(p.name for p in run.glob("step*")))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["step000000.rank0.safetensors"]


def test_record_takes_the_options_as_keywords_declared_once(tmp_path: Path) -> None:
    import inspect

    from modeltap.record import RecordOptions
    from modeltap.record.recording import record

    # record()'s documented keywords and defaults, as they were written out before RecordOptions
    documented = {
        "every": 100, "grads": True, "params": True, "stats_only": True, "full_every": None,
        "include": (), "exclude": (), "depth": None, "on_nonfinite": "raise", "rules": None,
        "gather": False, "dead_threshold": 0.0, "start_step": None, "hist": False,
        "formats": (), "ops": False, "eval": False, "eval_batches": 1, "scaler": None,
        "resume": False, "overwrite": False, "keep_last": 8, "flight": False,
        "eager_tripwire": False,
    }  # fmt: skip
    params = inspect.signature(record).parameters
    assert list(params)[:2] == ["model", "out_dir"]
    keywords = {n: p.default for n, p in params.items() if p.kind is p.KEYWORD_ONLY}
    assert keywords == documented and list(keywords) == list(documented)
    net = nn.Linear(2, 2)
    rec = modeltap.record(net, tmp_path / "run", every=3, on_nonfinite="dump-warn", keep_last=2)
    assert isinstance(rec.options, RecordOptions)
    assert (rec.options.every, rec.options.keep_last, rec.options.flight) == (3, 2, True)
    assert rec.selection.depth is None and rec.options.rules  # the default rules
    with pytest.raises(InputError, match="every must be a whole number"):
        RecordOptions(every=0)
    with pytest.raises(TypeError, match="evry"):
        modeltap.record(net, tmp_path / "run", evry=3)


class _OpsNet(nn.Module):
    """ops_models' SoftmaxBlock and a head, training; `depths` notes the torch function mode
    stack's depth at each forward (a mode installed by record or not)."""

    def __init__(self) -> None:
        from tests.fixtures.ops_models import SoftmaxBlock

        super().__init__()
        self.block = SoftmaxBlock()
        self.head = nn.Linear(4, 4)
        self.depths: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.depths.append(torch._C._len_torch_function_stack())
        return self.head(self.block(x))


def test_record_ops_at_recorded_steps_equal_plain_torch_and_nothing_between(tmp_path) -> None:
    """record(ops=True): on a recorded step each op's value and gradient equal plain torch's
    from that step's weights; on the others no mode is installed."""
    torch.manual_seed(0)
    model = _OpsNet().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(4)
    want: dict[int, dict[str, torch.Tensor]] = {}
    with modeltap.record(model, tmp_path / "run", every=2, stats_only=False, ops=True) as rec:
        for step in range(4):
            x = torch.randn(3, 4, generator=g)
            w = model.block.w.detach().clone().requires_grad_()
            h = x @ w
            p = torch.softmax(h, -1)
            doubled = p * 2
            loss = nn.functional.linear(doubled, model.head.weight.detach(),
                                        model.head.bias.detach()).square().mean()
            grads = torch.autograd.grad(loss, (h, p, doubled))
            want[step] = {"matmul": h.detach(), "softmax": p.detach(), "grads": grads}
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            rec.step()
    assert model.depths == [1, 0, 1, 0]  # the mode only in the recorded steps' forwards
    for step in (0, 2):
        dump = load_dump(tmp_path / "run" / f"step{step:06d}.rank0.safetensors")
        ops = json.loads(dump.metadata["ops"])
        assert list(ops) == ["block/op00.matmul", "block/op01.softmax", "block/op02.mul",
                             "head/op00.linear"]
        torch.testing.assert_close(dump["block/op00.matmul"], want[step]["matmul"])
        torch.testing.assert_close(dump["block/op01.softmax"], want[step]["softmax"])
        for key, grad in zip(("op00.matmul", "op01.softmax", "op02.mul"), want[step]["grads"],
                             strict=True):
            torch.testing.assert_close(dump[f"grad/block/{key}"], grad)
    assert not (tmp_path / "run" / "step000001.rank0.safetensors").exists()


def test_record_ops_keys_a_second_forward_as_its_module_outputs(tmp_path) -> None:
    torch.manual_seed(0)
    model = _OpsNet().train()
    with modeltap.record(model, tmp_path / "run", every=1, ops=True,
                         include=["block"]) as rec:
        for _ in range(2):
            model(torch.randn(3, 4)).sum().backward()
        model.eval()
        with torch.no_grad():
            model(torch.randn(3, 4))  # an evaluation: none of its ops
        model.train()
        rec.step()
    dump = load_dump(tmp_path / "run" / "step000000.rank0.safetensors")
    assert list(json.loads(dump.metadata["ops"])) == [
        "block/op00.matmul", "block/op01.softmax", "block/op02.mul",
        "block@1/op00.matmul", "block@1/op01.softmax", "block@1/op02.mul",
    ]
    assert model.depths == [1, 1, 0]


@pytest.mark.parametrize("compiled", ["wrapped", "in_place"])
def test_record_ops_refuses_a_compiled_model(tmp_path, compiled) -> None:
    model = nn.Linear(2, 2)
    if compiled == "wrapped":
        model = torch.compile(model)
    else:
        model.compile()
    with pytest.raises(InputError, match="ops=True sees the torch functions.*torch.compile"):
        modeltap.record(model, tmp_path / "run", ops=True)
    assert not (tmp_path / "run").exists()
