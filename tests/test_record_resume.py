"""Run folders resumed, truncated, or written to a full or read-only disk (issue 29, items 2, 3
and 12): a step number is always the training's own step (the framework's global_step, or
`start_step`), a run resumed before the folder's last step is refused or, with
resume="truncate", its later steps are moved aside; a failed write is one line, leaves no
temporary file, and the index lists exactly the step files there are.

The frameworks are the real ones (transformers' Trainer with resume_from_checkpoint, Lightning
with ckpt_path); gradients are checked against what the framework's own callback saw.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

import modeltap
from modeltap.errors import InputError
from modeltap.record import read_run
from tests.fixtures import frameworks


def _events(folder: Path) -> list[dict]:
    return [json.loads(x) for x in (folder / "index.rank0.jsonl").read_text().splitlines()]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _recorded(folder: Path) -> list[int]:
    return [s["step"] for s in read_run(folder).ranks[0].steps]


def _step_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("step"))


def _loop(
    folder: Path, steps: int, *, seed: int = 0, grads: dict | None = None, **options: object
) -> None:
    """A plain loop; `grads` gets each step's parameter gradients as the optimizer takes them
    (read by plain code just before `opt.step()`), keyed by the recording's step number."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with modeltap.record(model, folder, **options) as rec:
        for _ in range(steps):
            model(torch.randn(3, 4)).square().mean().backward()
            if grads is not None:
                grads[rec.step_index] = {
                    n: p.grad.detach().clone() for n, p in model.named_parameters()
                }
            opt.step()
            opt.zero_grad()
            rec.step()


# -- item 2 with the plain API ---------------------------------------------------------------


def test_resume_before_the_folders_last_step_is_refused_naming_the_choices(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _loop(run, 6, every=2, start_step=1)  # steps 1..6
    assert _recorded(run) == [2, 4, 6]
    before = {p.name: _digest(p) for p in run.iterdir()}
    with pytest.raises(InputError) as caught:
        _loop(run, 3, every=2, start_step=4, resume=True)  # a checkpoint after step 3
    message = caught.value.message
    assert "\n" not in message
    assert "holds steps up to 6" in message and "resumes at step 4" in message
    assert "resume='truncate'" in message and "another folder" in message
    assert {p.name: _digest(p) for p in run.iterdir()} == before  # nothing touched
    with pytest.raises(InputError, match="resume must be True, False or 'truncate'"):
        _loop(run, 1, every=2, start_step=7, resume="yes")
    with pytest.raises(InputError, match="^resume='truncate' with every=3 but the run used 2;"):
        _loop(run, 1, every=3, start_step=4, resume="truncate")  # the message names what it got


def test_truncate_moves_the_later_steps_aside_and_numbers_by_the_given_step(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    _loop(run, 6, every=2, full_every=2, start_step=1)
    old = {n: _digest(run / n) for n in _step_files(run)}
    grads: dict[int, dict[str, torch.Tensor]] = {}
    _loop(
        run, 3, seed=1, grads=grads, every=2, full_every=2, start_step=4, resume="truncate"
    )  # 4, 5, 6

    # Steps 4 and 6 are the resumed run's (not renumbered to 8): their parameter gradients are
    # the ones its optimizer took at those steps.
    assert _recorded(run) == [2, 4, 6]
    assert _step_files(run) == [f"step{s:06d}.rank0.safetensors" for s in (2, 4, 6)]
    for step in (4, 6):
        with safe_open(run / f"step{step:06d}.rank0.safetensors", "pt") as f:
            assert f.metadata()["step"] == str(step)
            for name, grad in grads[step].items():
                torch.testing.assert_close(f.get_tensor("grad/" + name), grad, rtol=0, atol=0)
    # The first run's steps 4 and 6 moved aside, whole; step 2 stays the first run's.
    aside = run / "truncated-step000004"
    assert sorted(p.name for p in aside.iterdir()) == [
        "step000004.rank0.safetensors",
        "step000006.rank0.safetensors",
    ]
    for name in ("step000004.rank0.safetensors", "step000006.rank0.safetensors"):
        assert _digest(aside / name) == old[name]
    assert _digest(run / "step000002.rank0.safetensors") == old["step000002.rank0.safetensors"]
    # The index says so: a truncate event, and read_run counts the new steps only.
    truncate = [e for e in _events(run) if e["event"] == "truncate"]
    assert truncate == [
        {
            "event": "truncate",
            "rank": 0,
            "from_step": 4,
            "folder": "truncated-step000004",
            "files": ["step000004.rank0.safetensors", "step000006.rank0.safetensors"],
        }
    ]
    index = read_run(run).ranks[0]
    assert [t["from_step"] for t in index.truncated] == [4]
    assert [len(index.resumed)] == [1]
    assert read_run(run).step_file(4, 0) == run / "step000004.rank0.safetensors"
    from modeltap.render.run_tables import run_json  # what `show DIR --json` prints

    assert run_json(read_run(run))["ranks"]["0"]["truncated"][0]["from_step"] == 4

    # Truncated again from the same step: a second subfolder, nothing overwritten.
    _loop(run, 1, seed=2, every=2, full_every=2, start_step=4, resume="truncate")
    assert (run / "truncated-step000004-2" / "step000004.rank0.safetensors").is_file()
    assert _recorded(run) == [2, 4]


def test_resume_without_a_start_step_continues_after_the_last_step(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _loop(run, 5, every=2)  # 0..4
    _loop(run, 4, every=2, resume=True)  # 5..8, as before: no step number given
    assert _recorded(run) == [0, 2, 4, 6, 8]
    _loop(run, 2, every=2, start_step=11, resume=True)  # a later step: kept as given
    assert _recorded(run) == [0, 2, 4, 6, 8, 12]


# -- items 2 and 3 with transformers' Trainer ------------------------------------------------


class _Batches(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.items = [
            {
                "input_ids": torch.randint(5, 100, (8,), generator=generator),
                "attention_mask": torch.ones(8, dtype=torch.long),
                "labels": i % 2,
            }
            for i in range(n)
        ]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


def _trainer(out: Path, callbacks: list, max_steps: int = 6):  # noqa: ANN202 - transformers
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=100,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=2,
    )
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=max_steps,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        save_strategy="steps",
        save_steps=3,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        logging_strategy="no",
    )
    model = BertForSequenceClassification(config)
    return Trainer(model=model, args=args, train_dataset=_Batches(24), callbacks=callbacks)


def _grad_reference():  # noqa: ANN202 - a TrainerCallback
    """The Trainer's own view: global_step + 1 and the gradients the optimizer is about to use."""
    from transformers import TrainerCallback

    class Reference(TrainerCallback):
        def __init__(self) -> None:
            self.grads: dict[int, dict[str, torch.Tensor]] = {}
            self.steps: list[int] = []

        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            self.grads[state.global_step + 1] = {
                n: p.grad.detach().clone()
                for n, p in model.named_parameters()
                if p.grad is not None
            }

        def on_step_end(self, args, state, control, **kw):
            self.steps.append(state.global_step)

    return Reference()


def _check_grads(run: Path, step: int, grads: dict[str, torch.Tensor]) -> None:
    with safe_open(run / f"step{step:06d}.rank0.safetensors", "pt") as f:
        assert f.metadata()["step"] == str(step)
        for name, grad in grads.items():
            torch.testing.assert_close(f.get_tensor("grad/" + name), grad, rtol=0, atol=0)


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A Trainer run of 6 steps recorded every 2 (steps 2, 4, 6), checkpoints at 3 and 6."""
    from modeltap.integrations import ModeltapCallback

    root = tmp_path_factory.mktemp("trainer")
    _trainer(root / "ckpt", [ModeltapCallback(root / "run", every=2, full_every=2)]).train()
    assert _recorded(root / "run") == [2, 4, 6]
    return root / "ckpt", root / "run"


def _copy_run(run: Path, to: Path) -> Path:
    import shutil

    shutil.copytree(run, to)
    return to


def test_trainer_resumed_from_an_earlier_checkpoint_is_refused_by_default(
    trainer_run: tuple[Path, Path], tmp_path: Path
) -> None:
    from modeltap.integrations import ModeltapCallback

    ckpt, first = trainer_run
    run = _copy_run(first, tmp_path / "run")
    before = {p.name: _digest(p) for p in run.iterdir()}
    trainer = _trainer(tmp_path / "out", [ModeltapCallback(run, every=2, full_every=2)])
    with pytest.raises(InputError, match="resume='truncate'") as caught:
        trainer.train(resume_from_checkpoint=str(ckpt / "checkpoint-3"))
    assert "resumes at step 4" in caught.value.message and "\n" not in caught.value.message
    assert {p.name: _digest(p) for p in run.iterdir()} == before
    assert not (run / "step000008.rank0.safetensors").exists()


def test_trainer_resumed_with_truncate_records_its_global_steps(
    trainer_run: tuple[Path, Path], tmp_path: Path
) -> None:
    from modeltap.integrations import ModeltapCallback

    ckpt, first = trainer_run
    run = _copy_run(first, tmp_path / "run")
    old = {n: _digest(run / n) for n in _step_files(run)}
    reference = _grad_reference()
    callbacks = [reference, ModeltapCallback(run, every=2, full_every=2, resume="truncate")]
    _trainer(tmp_path / "out", callbacks).train(resume_from_checkpoint=str(ckpt / "checkpoint-3"))

    assert reference.steps == [4, 5, 6]
    assert _recorded(run) == [2, 4, 6]  # before the fix: 2, 4, 6, 8 (step 5 written as 8)
    assert not (run / "step000008.rank0.safetensors").exists()
    for step in (4, 6):
        _check_grads(run, step, reference.grads[step])
    aside = run / "truncated-step000004"
    for name in ("step000004.rank0.safetensors", "step000006.rank0.safetensors"):
        assert _digest(aside / name) == old[name]
    assert _digest(run / "step000002.rank0.safetensors") == old["step000002.rank0.safetensors"]
    assert [t["from_step"] for t in read_run(run).ranks[0].truncated] == [4]


def test_trainer_resumed_into_a_new_folder_records_by_global_step(
    trainer_run: tuple[Path, Path], tmp_path: Path
) -> None:
    from modeltap.integrations import ModeltapCallback

    ckpt, _ = trainer_run
    run = tmp_path / "fresh"
    reference = _grad_reference()
    callbacks = [reference, ModeltapCallback(run, every=2, full_every=2)]
    # before the fix: InputError "resume=True but ... holds no run to resume"
    _trainer(tmp_path / "out", callbacks).train(resume_from_checkpoint=str(ckpt / "checkpoint-3"))
    assert reference.steps == [4, 5, 6]
    assert _recorded(run) == [4, 6]
    for step in (4, 6):
        _check_grads(run, step, reference.grads[step])
    events = _events(run)
    assert events[0]["event"] == "start" and events[0]["start_step"] == 4


def test_trainer_resumed_from_the_last_checkpoint_continues_the_folder(
    trainer_run: tuple[Path, Path], tmp_path: Path
) -> None:
    from modeltap.integrations import ModeltapCallback

    ckpt, first = trainer_run
    run = _copy_run(first, tmp_path / "run")
    reference = _grad_reference()
    callbacks = [reference, ModeltapCallback(run, every=2, full_every=2)]
    trainer = _trainer(tmp_path / "out", callbacks, max_steps=8)
    trainer.train(resume_from_checkpoint=str(ckpt / "checkpoint-6"))
    assert reference.steps == [7, 8]
    assert _recorded(run) == [2, 4, 6, 8]
    _check_grads(run, 8, reference.grads[8])
    assert [e["event"] for e in _events(run)].count("resume") == 1


# -- item 3 with Lightning -------------------------------------------------------------------


def test_lightning_resumed_into_a_new_folder_records_by_global_step(tmp_path: Path) -> None:
    pl = frameworks.lightning()

    from modeltap.integrations.lightning import ModeltapCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, i):
            return self(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(1)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(32, 4)), batch_size=4
    )
    quiet = {
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    first = pl.Trainer(max_steps=3, **quiet)
    first.fit(Module(), loader)
    checkpoint = tmp_path / "step3.ckpt"
    first.save_checkpoint(checkpoint)

    steps: list[int] = []

    class Steps(pl.Callback):
        def on_train_batch_end(self, trainer, *a):
            steps.append(trainer.global_step)

    run = tmp_path / "run"
    resumed = pl.Trainer(
        max_steps=6, callbacks=[Steps(), ModeltapCallback(run, every=2, full_every=2)], **quiet
    )
    # before the fix: InputError "resume=True but ... holds no run to resume"
    resumed.fit(Module(), loader, ckpt_path=checkpoint)
    assert steps == [4, 5, 6]
    assert _recorded(run) == [4, 6]
    assert _events(run)[0]["start_step"] == 4


# -- item 12: a full or read-only disk -------------------------------------------------------


def _no_temp_files(folder: Path) -> bool:
    return not [p.name for p in folder.iterdir() if p.name.startswith(".")]


def _index_matches_files(folder: Path) -> None:
    listed = sorted(s["file"] for s in read_run(folder).ranks[0].steps)
    assert listed == _step_files(folder)
    for line in (folder / "index.rank0.jsonl").read_text().splitlines():
        json.loads(line)  # no line cut short


def _disk_full(*args: object) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _full_model_loop(
    folder: Path, steps: int, *, arm: dict | None = None, at: int = 0, **options: object
) -> nn.Module:
    """Full tensors every step; `arm["on"]` turns True as step `at` begins."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with modeltap.record(model, folder, every=1, full_every=1, **options) as rec:
        for _ in range(steps):
            if arm is not None and rec.step_index == at:
                arm["on"] = True
            model(torch.randn(8, 64)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            rec.step()
    return model


def test_disk_full_while_writing_a_step_is_one_line_and_leaves_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tensors' bytes fail to go to disk at step 2 (os.pwrite, where the writer puts them):
    one InputError naming the fix, the step's temporary file removed, the index listing the
    two whole steps."""
    from modeltap.dump import writer as writer_module

    real = os.pwrite
    arm = {"on": False}

    def pwrite(fd: int, data: object, offset: int) -> int:
        if arm["on"]:
            _disk_full()
        return real(fd, data, offset)

    monkeypatch.setattr(writer_module.os, "pwrite", pwrite)
    run = tmp_path / "run"
    with pytest.raises(InputError) as caught:
        _full_model_loop(run, 4, arm=arm, at=2)
    monkeypatch.undo()
    message = caught.value.message
    assert message.startswith("no space left on the device") and "\n" not in message
    assert "step 2 was not kept" in message and "free some space" in message
    assert _no_temp_files(run)
    assert _recorded(run) == [0, 1]
    _index_matches_files(run)


def test_disk_full_when_a_step_file_is_made_leaves_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reservation of a new step file fails (before the fix: a raw OSError and the
    `.step000000.rank0.safetensors.PID.tmp` left behind)."""
    from modeltap.dump import writer as writer_module

    real_open = open

    class Full:
        def __init__(self, file: object) -> None:
            self._file = file

        def __getattr__(self, name: str) -> object:
            return getattr(self._file, name)

        def write(self, data: object) -> int:
            _disk_full()
            return 0

        def truncate(self, size: int | None = None) -> int:
            _disk_full()
            return 0

    def full_open(path: object, mode: str = "r", *args: object, **kwargs: object) -> object:
        file = real_open(path, mode, *args, **kwargs)
        return Full(file) if "w" in mode and str(path).endswith(".tmp") else file

    monkeypatch.setattr(writer_module, "open", full_open, raising=False)
    run = tmp_path / "run"
    with pytest.raises(InputError, match="no space left on the device.*step 0 was not kept"):
        _full_model_loop(run, 2)
    monkeypatch.undo()
    assert _no_temp_files(run)
    assert _recorded(run) == []
    _index_matches_files(run)


def test_disk_full_on_the_index_cuts_no_line_and_keeps_no_unlisted_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The index line of step 1 gets half written: the half line is cut back off, step 1's
    file (written whole) is removed, and the run stays readable."""
    from modeltap.record import index as index_module

    real_write = os.write
    arm = {"on": False}

    def write(fd: int, data: bytes) -> int:
        if arm["on"] and b'"event": "step"' in bytes(data[:40]):
            arm["on"] = False
            real_write(fd, bytes(data[:40]))  # the first bytes land, then the disk is full
            _disk_full()
        return real_write(fd, data)

    monkeypatch.setattr(index_module.os, "write", write)
    run = tmp_path / "run"
    with pytest.raises(InputError, match="no space left on the device.*step 1 was not kept"):
        _full_model_loop(run, 3, arm=arm, at=1)
    monkeypatch.undo()
    assert _recorded(run) == [0]
    _index_matches_files(run)
    assert _no_temp_files(run)
    _full_model_loop(run, 2, resume=True)  # goes on after it, line by line
    assert _recorded(run) == [0, 1, 2]
    _index_matches_files(run)


def test_a_new_run_folder_on_a_read_only_disk_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tests run as root, whom permission bits do not stop: the file system's refusal is
    simulated where it comes (making the folder; opening the index of an existing one)."""
    from modeltap.record import index as index_module

    real_mkdir = Path.mkdir
    target = tmp_path / "ro" / "run"

    def mkdir(self: Path, *args: object, **kwargs: object) -> None:
        if self == target:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    with pytest.raises(InputError) as caught:
        _full_model_loop(target, 1)
    message = caught.value.message
    assert "\n" not in message and "not writable (Read-only file system)" in message
    assert "writable disk" in message
    monkeypatch.undo()

    folder = tmp_path / "denied"
    folder.mkdir()
    real_open = os.open

    def denied(path: object, *args: object, **kwargs: object) -> int:
        if str(path).endswith(".jsonl"):
            raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(index_module.os, "open", denied)
    with pytest.raises(InputError, match="not writable \\(Permission denied\\)"):
        _full_model_loop(folder, 1)
    monkeypatch.undo()
    assert list(folder.iterdir()) == []
    model = nn.Linear(2, 2)
    with modeltap.record(model, folder, every=1):  # the same folder, once writable
        model(torch.randn(1, 2)).sum().backward()
