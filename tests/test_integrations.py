"""modeltap.record inside the real frameworks: transformers' Trainer, Lightning, and a GradScaler.

Each test trains a tiny model with the framework itself (no mocks) and checks the recording against
what plain hooks and the framework's own callbacks saw in the same run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

from modeltap.dump import load_dump
from modeltap.record import read_run
from tests.fixtures import frameworks
from tests.fixtures.recorded_runs import run_with_fault, tripped_run

TEXTS = ["hello world", "the quick brown fox", "numbers users can trust", "a second sentence"]


def _classifier():  # noqa: ANN202 - transformers type
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=120,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=2,
    )
    return BertForSequenceClassification(config)


class _Texts(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        from tests.fixtures.hf import bert_tokenizer

        tok = bert_tokenizer()
        self.items = []
        for i in range(n):
            enc = tok(TEXTS[i % len(TEXTS)], padding="max_length", max_length=8)
            self.items.append({**{k: torch.tensor(v) for k, v in enc.items()}, "labels": i % 2})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


def _training_keys(keys: list[str]) -> set[str]:
    return {k for k in keys if not k.startswith("grad/")}


def test_trainer_callback_records_training_steps_only(tmp_path: Path) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from modeltap.integrations import ModeltapCallback

    model = _classifier()
    seen: dict[str, object] = {"steps": [], "outputs": {}, "grads": {}}

    class Reference(TrainerCallback):
        """Plain hooks and the Trainer's own events, in the same run."""

        def on_step_begin(self, args, state, control, model=None, **kw):
            self.step = state.global_step + 1
            self.outputs = seen["outputs"].setdefault(self.step, {})

        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            # After the Trainer's clipping: what the optimizer is about to use.
            params = model.named_parameters()
            seen["grads"][state.global_step + 1] = {
                n: p.grad.detach().clone() for n, p in params if p.grad is not None
            }

        def on_step_end(self, args, state, control, **kw):
            seen["steps"].append(state.global_step)

    reference = Reference()

    def hook(module, args, output):
        if module.training and torch.is_grad_enabled():
            reference.outputs.setdefault("classifier", []).append(output.detach().clone())

    model.classifier.register_forward_hook(hook)
    args = TrainingArguments(
        output_dir=str(tmp_path / "trainer"),
        max_steps=6,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        gradient_accumulation_steps=2,
        max_grad_norm=0.05,  # small enough to clip: the recorded gradients must be the clipped ones
        eval_strategy="steps",
        eval_steps=3,
        learning_rate=1e-3,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        logging_strategy="no",
    )
    run = tmp_path / "run"
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=_Texts(24),
        eval_dataset=_Texts(4),
        callbacks=[reference, ModeltapCallback(run, every=2, full_every=2, eval=True)],
    )
    trainer.train()

    index = read_run(run)
    recorded = [s["step"] for s in index.ranks[0].steps]
    assert seen["steps"] == [1, 2, 3, 4, 5, 6]
    assert recorded == [s for s in seen["steps"] if s % 2 == 0]  # the Trainer's global_step
    for step in recorded:
        path = run / f"step{step:06d}.rank0.safetensors"
        dump = load_dump(path)
        keys = _training_keys(dump.order or [])
        # Two micro-batches per optimizer step, nothing from the evaluations at steps 3 and 6.
        assert {k for k in keys if k.startswith("classifier")} == {"classifier", "classifier@1"}
        assert "__root__@2" not in keys and "classifier@2" not in keys
        outputs = seen["outputs"][step]["classifier"]
        with safe_open(path, "pt") as f:
            torch.testing.assert_close(f.get_tensor("classifier"), outputs[0], rtol=0, atol=0)
            torch.testing.assert_close(f.get_tensor("classifier@1"), outputs[1], rtol=0, atol=0)
            for name, grad in seen["grads"][step].items():
                torch.testing.assert_close(f.get_tensor("grad/" + name), grad, rtol=0, atol=0)
        clipped = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g) for g in seen["grads"][step].values()])
        )
        assert clipped <= 0.05 * 1.001
    # The evaluations, after global steps 3 and 6, in their own files, in eval mode.
    assert [e["step"] for e in index.ranks[0].evals] == [3, 6]
    ev = load_dump(run / "eval000003.rank0.safetensors")
    assert ev.metadata["phase"] == "eval" and ev.metadata["train_mode"] == "false"
    assert "classifier" in (ev.order or []) and not any(k.startswith("grad/") for k in ev.order)


def test_eval_forward_inside_a_step_is_not_recorded(tmp_path: Path) -> None:
    import modeltap

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 4)
    with modeltap.record(model, tmp_path / "run", every=1) as rec:
        for _ in range(2):
            model(x).square().mean().backward()
            model.eval()
            with torch.no_grad():
                model(x + 1)
            model.train()
            with torch.inference_mode():
                model(x)
            opt.step()
            opt.zero_grad()
            rec.step()
    for step in (0, 1):
        order = load_dump(tmp_path / "run" / f"step{step:06d}.rank0.safetensors").order
        assert not any("@" in k for k in order), order
    assert not list((tmp_path / "run").glob("eval*"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_grad_scaler_skipped_step_is_reported_and_grads_unscaled(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    import modeltap

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # A scale so large that the first backward overflows: the scaler skips that step, lowers
    # its scale to 256 (not 1, so unscaling shows), and the next ones go through.
    scaler = torch.amp.GradScaler(
        "cpu", init_scale=2.0**126, backoff_factor=2.0**-118, growth_interval=1000
    )
    x = torch.randn(5, 4)
    unscaled: dict[int, dict[str, torch.Tensor]] = {}
    output_grads: dict[int, torch.Tensor] = {}
    stepped = []
    with modeltap.record(model, tmp_path / "run", every=1, scaler=scaler, stats_only=False) as rec:
        for step in range(4):
            with torch.autocast("cpu", dtype=dtype):
                y = model(x)
            y.register_hook(lambda g, s=step: output_grads.__setitem__(s, g.detach().clone()))
            scale = scaler.get_scale()
            loss = y.float().square().sum() * (100 if step == 0 else 1)  # step 0 overflows
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            unscaled[step] = {n: p.grad.clone() for n, p in model.named_parameters()}
            before = model[0].weight.detach().clone()
            scaler.step(opt)
            scaler.update()
            stepped.append(not torch.equal(before, model[0].weight))
            output_grads[step] = output_grads[step] / scale
            opt.zero_grad()
            rec.step()
    assert stepped[0] is False and all(stepped[1:])  # the scaler skipped step 0 only
    assert scaler.get_scale() == 256.0
    # The autocast forward is recorded in the dtype it ran in.
    dump = load_dump(tmp_path / "run" / "step000001.rank0.safetensors")
    assert dump.stats_for("0").dtype == str(dtype).removeprefix("torch.")
    assert rec.skipped == [0]
    index = read_run(tmp_path / "run").ranks[0]
    assert index.skipped == [0]
    assert index.steps[0].get("skipped") is True and "skipped" not in index.steps[1]
    for step in (1, 2, 3):
        path = tmp_path / "run" / f"step{step:06d}.rank0.safetensors"
        with safe_open(path, "pt") as f:
            for name, grad in unscaled[step].items():
                torch.testing.assert_close(f.get_tensor("grad/" + name), grad, rtol=0, atol=0)
        stats = load_dump(path).stats_for("grad/2")
        expected = torch.linalg.vector_norm(output_grads[step].float()).item()
        assert stats is not None and stats.norm == pytest.approx(expected, rel=1e-3)


def test_lightning_callback_steps_equal_global_step(tmp_path: Path) -> None:
    pl = frameworks.lightning()

    from modeltap.integrations.lightning import ModeltapCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
            self.train_outputs: dict[int, list[torch.Tensor]] = {}

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, i):
            y = self(batch[0])
            self.train_outputs.setdefault(self.trainer.global_step + 1, []).append(y.detach())
            return y.square().mean()

        def validation_step(self, batch, i):
            return self(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    module = Module()
    steps = []
    grads: dict[int, dict[str, torch.Tensor]] = {}

    class Steps(pl.Callback):
        def on_train_batch_end(self, trainer, *a):
            steps.append(trainer.global_step)

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            params = pl_module.named_parameters()
            grads[trainer.global_step + 1] = {n: p.grad.clone() for n, p in params}

    trainer = pl.Trainer(
        max_steps=4,
        accumulate_grad_batches=2,
        val_check_interval=4,
        limit_val_batches=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Steps(), ModeltapCallback(tmp_path / "run", every=2, full_every=2)],
    )
    trainer.fit(module, loader, loader)
    index = read_run(tmp_path / "run").ranks[0]
    assert sorted(set(steps)) == [0, 1, 2, 3, 4]
    assert [s["step"] for s in index.steps] == [2, 4]
    for step in (2, 4):
        path = tmp_path / "run" / f"step{step:06d}.rank0.safetensors"
        dump = load_dump(path)
        assert _training_keys(dump.order) >= {"__root__", "__root__@1"}
        assert "__root__@2" not in dump.order  # two micro-batches, no validation forward
        for k, expected in enumerate(module.train_outputs[step]):
            key = "__root__" if k == 0 else f"__root__@{k}"  # aliases of net.2's output
            torch.testing.assert_close(dump[key], expected, rtol=0, atol=0)
        for name, grad in grads[step].items():  # what the optimizer step applied
            torch.testing.assert_close(dump["grad/" + name], grad, rtol=0, atol=0)


def _loop(folder: Path, steps: int, **options: object) -> None:
    import modeltap

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with modeltap.record(model, folder, **options) as rec:
        for _ in range(steps):
            model(torch.randn(3, 4)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            rec.step()


def test_run_folder_reuse_is_refused_resumed_or_overwritten(tmp_path: Path) -> None:
    from modeltap.errors import InputError

    run = tmp_path / "run"
    _loop(run, 5, every=2)
    with pytest.raises(InputError, match="already holds a recorded run; pass resume=True"):
        _loop(run, 1, every=2)
    assert [s["step"] for s in read_run(run).ranks[0].steps] == [0, 2, 4]

    with pytest.raises(InputError, match="resume with the same options"):
        _loop(run, 1, every=3, resume=True)
    _loop(run, 4, every=2, resume=True)  # continues after step 4: steps 5..8
    steps = read_run(run).ranks[0].steps
    assert [s["step"] for s in steps] == [0, 2, 4, 6, 8]
    lines = [json.loads(x)["event"] for x in (run / "index.rank0.jsonl").read_text().splitlines()]
    assert lines.count("start") == 1 and lines.count("resume") == 1

    (run / "notes.txt").write_text("mine")
    _loop(run, 3, every=2, overwrite=True)
    assert [s["step"] for s in read_run(run).ranks[0].steps] == [0, 2]
    assert not (run / "step000004.rank0.safetensors").exists()
    assert (run / "notes.txt").read_text() == "mine"  # only the run's own files go

    with pytest.raises(InputError, match="holds no run to resume"):
        _loop(tmp_path / "empty", 1, resume=True)
    with pytest.raises(InputError, match="exclude each other"):
        _loop(tmp_path / "both", 1, resume=True, overwrite=True)


def test_attention_key_bias_is_reported_once_as_structural(tmp_path: Path) -> None:
    """The gradient of an attention key bias is zero by construction (softmax cancels a shift
    of every score of a query); it is reported once, while a real vanishing gradient is not."""
    import modeltap

    model = _classifier()
    model.train()
    data = _Texts(8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with modeltap.record(model, tmp_path / "run", every=1) as rec:
        all_hits = []
        for step in range(3):
            batch = torch.utils.data.default_collate([data[2 * step], data[2 * step + 1]])
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad()
            all_hits.append(rec.step())
    structural = [h for h in all_hits[0] if h.rule == "structural_zero_gradient"]
    assert {h.key for h in structural} == {
        f"grad/bert.encoder.layer.{i}.attention.self.key.bias" for i in range(2)
    }
    assert not [h for hits in all_hits for h in hits if h.rule == "vanishing_gradient"]
    assert not [h for hits in all_hits[1:] for h in hits if "key.bias" in h.key]
    # Nor dead units on the integer inputs passed through or the logits.
    assert not [h for hits in all_hits for h in hits if h.rule == "dead_units"]


@pytest.mark.parametrize("width", [80, 120])
def test_show_run_never_cuts_a_number_nor_a_name_end(tmp_path: Path, width: int) -> None:
    from rich.console import Console

    import modeltap
    from modeltap.render import fmt, run_heading, run_table

    model = _classifier()
    model.train()
    data = _Texts(6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with modeltap.record(model, tmp_path / "run", every=1) as rec:
        for step in range(3):
            batch = torch.utils.data.default_collate([data[2 * step], data[2 * step + 1]])
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad()
            rec.step()
    run = read_run(tmp_path / "run")
    console = Console(width=width, record=True, color_system=None)
    console.print(run_heading(run, 0))
    console.print(run_table(run, 0, width=width))
    lines = console.export_text().splitlines()
    assert all(len(line.rstrip()) <= width for line in lines)
    words = {w for line in lines for w in line.split()}
    last = run.ranks[0].steps[-1]
    for key, entry in last["keys"].items():
        assert fmt(entry["norm"]) in words, key  # every last value whole
    for name, ratio in last["updates"].items():
        assert fmt(ratio) in words, name
    table = lines[lines.index(next(x for x in lines if x.startswith("parameter"))) + 1 :]
    names = [line.split()[0] for line in table if line.strip()]
    assert len(names) == len(set(names)) == len(last["updates"])  # no two rows alike
    assert all(not n.endswith("…") for n in names)  # names lose their start, never their end
    for name, shown in zip(last["updates"], names, strict=True):
        pieces = shown.split("…")  # the start, the end, and where names part, kept between
        assert name.startswith(pieces[0]) and name.endswith(pieces[-1])
        assert all(piece in name for piece in pieces[1:-1])


def test_accelerate_recipe_records_optimizer_steps(tmp_path: Path) -> None:
    """The NaN guide's Accelerate recipe: `record` around the loop, `rec.step()` when the
    accelerator synchronised gradients (an optimizer step), with its GradScaler if any."""
    from accelerate import Accelerator

    import modeltap

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4))
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    grads_seen = {}
    with modeltap.record(
        model, tmp_path / "run", every=2, full_every=2, scaler=accelerator.scaler
    ) as rec:
        for (x,) in loader:
            with accelerator.accumulate(model):
                accelerator.backward(model(x).square().mean())
                if accelerator.sync_gradients:  # what the optimizer step below applies
                    grads_seen[rec.step_index] = {
                        n: p.grad.clone() for n, p in model.named_parameters()
                    }
                opt.step()
                opt.zero_grad()
            if accelerator.sync_gradients:
                rec.step()
    index = read_run(tmp_path / "run").ranks[0]
    assert [s["step"] for s in index.steps] == [0, 2]  # 8 batches, 2 per step: steps 0..3
    dump = load_dump(tmp_path / "run" / "step000002.rank0.safetensors")
    assert {"0", "0@1"} <= set(dump.order) and "0@2" not in dump.order
    for step in (0, 2):
        with safe_open(tmp_path / "run" / f"step{step:06d}.rank0.safetensors", "pt") as f:
            for name, grad in grads_seen[step].items():
                torch.testing.assert_close(f.get_tensor("grad/" + name), grad, rtol=0, atol=0)


@pytest.mark.parametrize("armed", [{"on_nonfinite": "dump"}, {"flight": True}])
def test_replay_reproduces_a_nan_from_the_step_file_alone(tmp_path: Path, armed: dict) -> None:
    import subprocess
    import sys

    tripmodel, error = tripped_run(tmp_path, **armed)
    assert error.trip.step == 7 and error.trip.module == "2"
    dump = load_dump(tmp_path / "run" / "step000007.rank0.safetensors")
    flight = json.loads(dump.metadata["flight"])
    assert flight["module"] == "2" and flight["rng"] == ["cpu"] and flight["training"]
    trend = json.loads(dump.metadata["trend"])
    assert [t["step"] for t in trend] == [0, 5]  # the recorded steps before the trip
    recorded = dump["2"]
    assert torch.isnan(recorded).any() and torch.isinf(recorded).any()

    # In a new process, from the step file alone: the same NaN and Inf positions.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    command = [sys.executable, "-m", "modeltap", "replay", "run", "tripmodel:make", "--step"]
    done = subprocess.run([*command, "7"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("REPRODUCED  step 7 rank 0: module '2' (Noisy)")
    nan, inf = int(torch.isnan(recorded).sum()), int(torch.isinf(recorded).sum())
    assert f"{nan} NaN / {inf} Inf on replay, {nan} NaN / {inf} Inf recorded" in done.stdout
    assert "parameter weight: 8×8 float32, 0 NaN / 1 Inf" in done.stdout

    # The dropout mask matters: the same call with another RNG state gives other positions,
    # so the replay above reproduced them only through the recorded state.
    noisy = tripmodel.make()[2].train()
    noisy.weight.data = dump["flight/param/weight"]
    torch.manual_seed(123)
    other = noisy(dump["flight/arg/0"])
    assert not torch.equal(torch.isnan(other), torch.isnan(recorded))

    # A step without a trip is a one-line error.
    done = subprocess.run([*command, "5"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.startswith("error: step 5 of 'run' did not trip")


@pytest.mark.parametrize("full_every", [None, 10])
def test_run_diff_names_the_step_and_layer_where_two_runs_part(
    tmp_path: Path, full_every: int | None
) -> None:
    from typer.testing import CliRunner

    from modeltap.cli import app
    from modeltap.diff import diff_runs

    run_with_fault(tmp_path / "a", None, full_every=full_every)
    run_with_fault(tmp_path / "b", 20, full_every=full_every)
    run_with_fault(tmp_path / "c", None, full_every=full_every)
    report = diff_runs(tmp_path / "b", tmp_path / "a")
    first = report.first
    assert (first.step, first.rank, first.first) == (20, 0, "2")  # not 0 or 1, upstream of it
    assert all(not s.failed for s in report.steps if s.step < 20)
    assert first.tensors is (full_every is not None)
    assert diff_runs(tmp_path / "c", tmp_path / "a").passed  # the same run twice
    import modeltap  # the library verb takes run folders too

    verb = modeltap.diff(tmp_path / "b", tmp_path / "a").first
    assert (verb.step, verb.rank, verb.first) == (20, 0, "2")

    result = CliRunner().invoke(app, ["diff", str(tmp_path / "b"), str(tmp_path / "a")])
    assert result.exit_code == 1
    assert "first divergence: step 20, rank 0, 2" in result.stdout
    result = CliRunner().invoke(app, ["diff", str(tmp_path / "c"), str(tmp_path / "a"), "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["passed"] is True
    result = CliRunner().invoke(app, ["diff", str(tmp_path / "c"), str(tmp_path / "a") + "/x"])
    assert result.exit_code == 2


def test_run_diff_refuses_what_applies_to_dumps_only(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from modeltap.cli import app

    run_with_fault(tmp_path / "a", None)
    args = ["diff", str(tmp_path / "a"), str(tmp_path / "a")]
    result = CliRunner().invoke(app, [*args, "--junit", str(tmp_path / "r.xml"), "--strict"])
    assert result.exit_code == 2
    assert "--junit and --strict can't apply to run folders" in result.output
    assert not (tmp_path / "r.xml").exists()


@pytest.mark.parametrize("eager", [False, True])
def test_trainer_trip_at_an_unrecorded_step_names_the_module(tmp_path: Path, eager: bool) -> None:
    """transformers' Trainer with gradient accumulation and an eval, every=100: a NaN written
    into the second layer's attention output at global step 3 (not recorded) raises out of
    train() naming that module and step, lazily (the step run again) as eagerly. A fault that
    only the first call makes is tested in test_record (the re-run says it can't make it again)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from modeltap.integrations import ModeltapCallback
    from modeltap.record import NonFiniteError

    model = _classifier()
    target = model.bert.encoder.layer[1].attention.output.dense
    armed = {"on": False, "calls": 0}

    class Arm(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            armed["on"] = state.global_step + 1 == 3

    def poison(module, args, output):  # every training forward of global step 3
        if armed["on"] and module.training and torch.is_grad_enabled():
            armed["calls"] += 1
            output = output.clone()
            output[0, 0, 0] = float("nan")
            return output
        return None

    target.register_forward_hook(poison)
    args = TrainingArguments(
        output_dir=str(tmp_path / "trainer"), max_steps=5, per_device_train_batch_size=2,
        gradient_accumulation_steps=2, eval_strategy="steps", eval_steps=1,
        per_device_eval_batch_size=2, save_strategy="no", report_to=[], use_cpu=True, seed=0,
        disable_tqdm=True, logging_strategy="no",
    )  # fmt: skip
    callback = ModeltapCallback(tmp_path / "run", every=100, eager_tripwire=eager)
    trainer = Trainer(
        model=model, args=args, train_dataset=_Texts(24), eval_dataset=_Texts(2),
        callbacks=[Arm(), callback],
    )  # fmt: skip
    with pytest.raises(NonFiniteError) as caught:
        trainer.train()
    trip = caught.value.trip
    assert (trip.step, trip.phase) == (3, "forward")
    assert (trip.module, trip.key) == ("bert.encoder.layer.1.attention.output.dense",) * 2
    assert trip.unreproduced is None and trip.stats["nan"] == 1
    # lazily, the step's first forward ran once more (the re-run that named the module)
    assert armed["calls"] == (1 if eager else 2)


def test_lightning_trip_when_training_step_calls_a_submodule(tmp_path: Path) -> None:
    """Lightning, the LightningModule's training_step calling `self.net(x)` (its own forward never
    runs): a NaN made by net.1 at global step 3 (not recorded) raises out of fit() naming it."""
    pl = frameworks.lightning()

    from modeltap.integrations.lightning import ModeltapCallback
    from modeltap.record import NonFiniteError

    class Poisoned(nn.Module):
        on = False

        def forward(self, x):
            y = x * 1.0
            if self.on:
                y[0, 0] = float("nan")
            return y

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(4, 8), Poisoned(), nn.ReLU(), nn.Linear(8, 1))

        def training_step(self, batch, i):
            self.net[1].on = self.trainer.global_step + 1 == 3
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(1)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(32, 4)), batch_size=4
    )
    trainer = pl.Trainer(
        max_steps=6, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ModeltapCallback(tmp_path / "run", every=100)],
    )  # fmt: skip
    with pytest.raises(NonFiniteError) as caught:
        trainer.fit(Module(), loader)
    trip = caught.value.trip
    assert (trip.step, trip.phase, trip.module) == (3, "forward", "net.1")


# the gradient an optimizer step applies (issue 29, item 1), and non-finite gradients that no
# optimizer step takes (item 4b) ---------------------------------------------------------------


def _recorded_param_grads(run: Path, step: int) -> dict[str, torch.Tensor]:
    path = run / f"step{step:06d}.rank0.safetensors"
    params = json.loads(load_dump(path).metadata["grad"])["params"]
    with safe_open(path, "pt") as f:
        return {name: f.get_tensor("grad/" + name) for name in params}


def _assert_same_grads(recorded: dict, expected: dict) -> None:
    assert sorted(recorded) == sorted(expected)
    for name, grad in expected.items():
        torch.testing.assert_close(recorded[name], grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(
    ("accumulate", "precision", "fast_dev_run", "clip"),
    [(1, "32-true", False, None), (4, "32-true", False, None), (1, "bf16-mixed", False, None),
     (4, "bf16-mixed", False, None), (1, "16-mixed", False, None), (1, "32-true", True, None),
     (4, "32-true", False, 0.01)],
)  # fmt: skip
def test_lightning_records_the_gradients_the_optimizer_step_applies(
    tmp_path: Path, accumulate: int, precision: str, fast_dev_run: bool, clip: float | None
) -> None:
    """Lightning steps its optimizer with `optimizer.step(closure)`, the closure running the last
    micro-batch's forward and backward: the recorded parameter gradients of global step N are
    those Lightning's own `on_before_optimizer_step` sees at step N (they had been step N-1's, or
    those after micro-batch 3 of 4), and the update ratios those of the weights the step changed.
    "16-mixed" runs in float16 with a GradScaler on the CPU (the precision plugin given
    explicitly; the flag alone falls back to bfloat16 there): the gradients are the unscaled
    ones. With `gradient_clip_val` (applied after `on_before_optimizer_step`) they are the
    clipped ones the SGD step applied, read after it in the module's own `optimizer_step`."""
    pl = frameworks.lightning()
    from lightning.pytorch.plugins import MixedPrecision

    from modeltap.integrations.lightning import ModeltapCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, i):
            return self(batch[0]).float().square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
            optimizer.step(closure=optimizer_closure)
            # SGD leaves the gradients it applied in .grad
            applied.append({n: p.grad.clone() for n, p in self.named_parameters()})

    seen: dict[int, dict[str, torch.Tensor]] = {}
    applied: list[dict[str, torch.Tensor]] = []
    weights: dict[int, dict[str, torch.Tensor]] = {}

    class Reference(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            step = trainer.global_step + 1
            seen[step] = {n: p.grad.clone() for n, p in pl_module.named_parameters()}
            weights[step] = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

        def on_train_batch_end(self, trainer, pl_module, *args):
            if trainer.global_step in weights and "after" not in weights[trainer.global_step]:
                after = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
                weights[trainer.global_step]["after"] = after

    torch.manual_seed(1)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(64, 4)), batch_size=4
    )
    options: dict = {"fast_dev_run": 3} if fast_dev_run else {"max_steps": 3}
    if precision == "16-mixed":
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
        options["plugins"] = [MixedPrecision("16-mixed", "cpu", scaler)]
    else:
        options["precision"] = precision
    run = tmp_path / "run"
    trainer = pl.Trainer(
        accumulate_grad_batches=accumulate, accelerator="cpu", logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        gradient_clip_val=clip,
        callbacks=[Reference(), ModeltapCallback(run, every=1, full_every=1)], **options,
    )  # fmt: skip
    trainer.fit(Module(), loader)
    index = read_run(run).ranks[0]
    assert [s["step"] for s in index.steps] == [1, 2, 3] == sorted(seen)
    assert len(applied) == 3
    for entry in index.steps:
        step = entry["step"]
        recorded = _recorded_param_grads(run, step)
        _assert_same_grads(recorded, applied[step - 1])
        if clip is None:
            _assert_same_grads(recorded, seen[step])
        else:  # clipped after Lightning's hook: a norm of 0.01 from a larger one
            norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in recorded.values()]))
            assert norm == pytest.approx(clip, rel=1e-3)
            assert not torch.equal(recorded["net.0.weight"], seen[step]["net.0.weight"])
        before, after = weights[step], weights[step]["after"]
        for name, ratio in entry["updates"].items():
            change = torch.linalg.vector_norm(after[name] - before[name])
            expected = (change / torch.linalg.vector_norm(before[name])).item()
            assert ratio == pytest.approx(expected, rel=1e-5), name
        if accumulate > 1:  # every micro-batch of the step, the last one's backward included
            order = load_dump(run / f"step{step:06d}.rank0.safetensors").order
            assert f"grad/net.2@{accumulate - 1}" in order


def _closure_loop(folder: Path, kind: str) -> tuple[dict, dict, dict]:
    """Three steps of a small regression, `kind`: "plain" (`opt.step()` after the backward),
    "sgd-closure" (`opt.step(closure)`) or "lbfgs" (LBFGS evaluating its closure several times
    per step). Returns, per step, every closure evaluation's gradients (the loop's own reading
    just before `opt.step()` for "plain"), and the weights before and after the step."""
    import modeltap

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    if kind == "lbfgs":
        opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    evaluations: dict[int, list[dict[str, torch.Tensor]]] = {}
    before: dict[int, dict[str, torch.Tensor]] = {}
    after: dict[int, dict[str, torch.Tensor]] = {}

    def grads() -> dict[str, torch.Tensor]:
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    def weights() -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    with modeltap.record(model, folder, every=1, full_every=1) as rec:
        for step in range(3):
            x = torch.randn(6, 4, generator=torch.Generator().manual_seed(step))
            target = x.sum(dim=1, keepdim=True)

            def closure(step: int = step, x: torch.Tensor = x, target=target) -> torch.Tensor:
                opt.zero_grad()
                loss = (model(x) - target).square().mean()
                loss.backward()
                evaluations.setdefault(step, []).append(grads())
                return loss

            before[step] = weights()
            if kind == "plain":
                closure()
                opt.step()
            else:
                opt.step(closure)
            after[step] = weights()
            rec.step()
    return evaluations, before, after


@pytest.mark.parametrize("kind", ["plain", "sgd-closure", "lbfgs"])
def test_a_plain_loop_records_the_gradients_its_optimizer_step_uses(
    tmp_path: Path, kind: str
) -> None:
    """Parameter gradients of a step are those the optimizer step takes: read before `step()`
    without a closure, when the closure returns with one (they exist only then). LBFGS evaluates
    its closure several times per step, each evaluation at new weights: the recorded gradients
    are the first evaluation's, at the weights the step starts from (the ones its first
    direction comes from), and the update ratios are those of the whole step."""
    evaluations, before, after = _closure_loop(tmp_path / "run", kind)
    index = read_run(tmp_path / "run").ranks[0]
    assert [s["step"] for s in index.steps] == [0, 1, 2]
    for entry in index.steps:
        step = entry["step"]
        _assert_same_grads(_recorded_param_grads(tmp_path / "run", step), evaluations[step][0])
        assert set(entry["updates"]) == set(before[step])
        for name, ratio in entry["updates"].items():
            change = torch.linalg.vector_norm(after[step][name] - before[step][name])
            expected = (change / torch.linalg.vector_norm(before[step][name])).item()
            assert ratio == pytest.approx(expected, rel=1e-5), name
        if kind == "lbfgs":  # several evaluations per step, each with other gradients
            assert len(evaluations[step]) > 1
            first, last = evaluations[step][0], evaluations[step][-1]
            assert not torch.equal(first["0.weight"], last["0.weight"])


@pytest.mark.parametrize("every", [1, 100])
def test_grad_scaler_overflow_without_scaler_is_a_skipped_step(
    tmp_path: Path, every: int, caplog: pytest.LogCaptureFixture
) -> None:
    """fp16 autocast and a plain GradScaler, not handed to `record`: the overflowing backward of
    step 2 never reaches the optimizer (the scaler skips `optimizer.step()`), so the step is
    reported as skipped, on a recorded step (every=1) as on one checked lazily (every=100),
    instead of raising NonFiniteError. The steps after it train and are recorded as usual."""
    import logging

    import modeltap

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=1000)
    stepped = []
    unscaled: dict[int, dict[str, torch.Tensor]] = {}
    with caplog.at_level(logging.INFO, logger="modeltap.record"):
        with modeltap.record(model, tmp_path / "run", every=every, full_every=1) as rec:
            for step in range(5):
                x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
                with torch.autocast("cpu", dtype=torch.float16):
                    y = model(x)
                loss = y.float().square().mean() * (1e6 if step == 2 else 1.0)
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                unscaled[step] = {n: p.grad.clone() for n, p in model.named_parameters()}
                before = model[0].weight.detach().clone()
                scaler.step(opt)
                scaler.update()
                stepped.append(not torch.equal(before, model[0].weight))
                opt.zero_grad()
                rec.step()
    assert stepped == [True, True, False, True, True]  # the scaler skipped step 2 only
    assert not torch.isfinite(unscaled[2]["0.weight"]).all()
    assert rec.trips == [] and rec.skipped == [2]
    index = read_run(tmp_path / "run").ranks[0]
    assert index.skipped == [2] and index.trips == []
    assert "step 2: non-finite gradients" in caplog.text and "scaler=" in caplog.text
    if every == 1:
        assert [s.get("skipped", False) for s in index.steps] == [False, False, True, False, False]
        for step in (0, 1, 3, 4):  # read after scaler.unscale_, as the optimizer takes them
            _assert_same_grads(_recorded_param_grads(tmp_path / "run", step), unscaled[step])


def test_trainer_callback_passes_formats_and_ops_through(tmp_path: Path) -> None:
    """ModeltapCallback(..., formats=[...], ops=True): the recorded step holds the ops of the
    selected attention (the query projection equal to F.linear of the module's input with that
    step's weights, seen by a plain pre-hook) with their gradients, and every stored tensor's
    figures equal test_formats' reference on it."""
    from transformers import Trainer, TrainingArguments

    from modeltap.integrations import ModeltapCallback
    from tests.fixtures.quant_reference import assert_figures, reference_figures

    model = _classifier()
    attention = model.bert.encoder.layer[0].attention.self
    seen: list[torch.Tensor] = []

    def pre_hook(module, args, kwargs):
        if module.training and torch.is_grad_enabled():
            hidden = (args or (kwargs["hidden_states"],))[0].detach()
            seen.append(nn.functional.linear(hidden, module.query.weight, module.query.bias))

    attention.register_forward_pre_hook(pre_hook, with_kwargs=True)
    args = TrainingArguments(
        output_dir=str(tmp_path / "trainer"), max_steps=2, per_device_train_batch_size=2,
        learning_rate=1e-2, save_strategy="no", report_to=[], use_cpu=True, seed=0,
        disable_tqdm=True, logging_strategy="no",
    )  # fmt: skip
    run = tmp_path / "run"
    callback = ModeltapCallback(run, every=2, stats_only=False, formats=["int8", "mxfp8"],
                                ops=True, include=["bert.encoder.layer.0.attention.self"])
    Trainer(model=model, args=args, train_dataset=_Texts(8), callbacks=[callback]).train()

    path = run / "step000002.rank0.safetensors"
    assert [p.name for p in sorted(run.glob("step*.safetensors"))] == [path.name]
    module = "bert.encoder.layer.0.attention.self"
    with safe_open(path, "pt") as f:
        meta = f.metadata()
        ops = json.loads(meta["ops"])
        assert f"{module}/op00.linear" in ops and ops[f"{module}/op00.linear"]["op"].endswith(
            "linear"
        )
        torch.testing.assert_close(f.get_tensor(f"{module}/op00.linear"), seen[1].detach())
        assert f"grad/{module}/op00.linear" in f.keys()
        stats = json.loads(meta["stats"])
        keys = [k for k in f.keys() if k in stats and f.get_tensor(k).is_floating_point()]
        assert any(k.startswith(f"grad/{module}/op") for k in keys)
        for key in keys:
            tensor = f.get_tensor(key)
            for fmt in ("int8", "mxfp8"):
                assert_figures(stats[key]["formats"][fmt], reference_figures(tensor, fmt))
