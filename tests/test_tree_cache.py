"""`modeltap ls` keeps each model's module tree in a cache, so a second run needs neither torch nor
transformers; a changed config, class or option is another entry."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from modeltap.cli import app
from modeltap.loading.tree_cache import cache_dir
from tests.conftest import ROOT

runner = CliRunner()

# `ls` in a fresh interpreter, saying which of torch and transformers it imported.
_LS = """
import json, sys
from typer.testing import CliRunner
from modeltap.cli import app
r = CliRunner().invoke(app, ["ls", *sys.argv[1:]])
heavy = {m: m in sys.modules for m in ("torch", "transformers")}
print(json.dumps({"code": r.exit_code, "output": r.output, **heavy}))
"""


def _ls_process(*args: str | Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    result = subprocess.run(
        [sys.executable, "-c", _LS, *map(str, args)], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def _entries() -> list[Path]:
    return sorted((cache_dir() / "ls").glob("*.json"))


def test_second_ls_needs_neither_torch_nor_transformers(bert_dir: Path) -> None:
    from transformers import AutoModel

    first = _ls_process(bert_dir, "--depth", "3")
    assert first["code"] == 0 and first["torch"] and first["transformers"]
    (entry,) = _entries()
    second = _ls_process(bert_dir, "--depth", "3")
    assert second == {**first, "torch": False, "transformers": False}
    # what the cache holds is the model's own tree, by plain transformers
    model = AutoModel.from_pretrained(bert_dir)
    want = [
        [n or "__root__", type(m).__name__, sum(p.numel() for p in m.parameters())]
        for n, m in model.named_modules()
    ]
    assert json.loads(entry.read_text())["modules"] == want
    # --no-cache builds the tree again and leaves the cache as it was
    stamp = entry.stat().st_mtime_ns
    bypass = _ls_process(bert_dir, "--depth", "3", "--no-cache")
    assert bypass == first
    assert _entries() == [entry] and entry.stat().st_mtime_ns == stamp


def test_a_changed_config_or_class_is_another_entry(bert_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(bert_dir, model)
    r = runner.invoke(app, ["ls", str(model), "--include", "encoder.layer.1"])
    assert r.exit_code == 0 and "BertLayer" in r.output
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    r = runner.invoke(app, ["ls", str(model), "--include", "encoder.layer.1"])
    assert r.exit_code == 2 and "no module 'encoder.layer.1'" in r.stderr
    r = runner.invoke(app, ["ls", str(model), "--model-class", "BertForMaskedLM"])
    assert r.exit_code == 0 and "BertForMaskedLM" in r.output and "cls" in r.output
    assert len(_entries()) == 3
    # another selection of the same tree is the same entry
    r = runner.invoke(app, ["ls", str(model), "--include", "embeddings*"])
    assert r.exit_code == 0 and "encoder" not in r.output and len(_entries()) == 3


def test_a_damaged_entry_is_built_again(bert_dir: Path) -> None:
    first = runner.invoke(app, ["ls", str(bert_dir)])
    (entry,) = _entries()
    entry.write_text('{"modules": [["__root__", "Fake"')
    again = runner.invoke(app, ["ls", str(bert_dir)])
    assert again.exit_code == 0 and again.output == first.output
    assert json.loads(entry.read_text())["modules"][0][1] == "BertModel"


def test_a_cache_that_cannot_be_written_costs_only_speed(
    bert_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("MODELTAP_CACHE", str(tmp_path / "a-file"))
    r = runner.invoke(app, ["ls", str(bert_dir)])
    assert r.exit_code == 0 and "BertModel" in r.output
    assert list(tmp_path.glob(".*.tmp")) == []


def test_cache_dir_honours_modeltap_cache_then_xdg(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MODELTAP_CACHE", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("MODELTAP_CACHE")
    assert cache_dir() == tmp_path / "xdg" / "modeltap"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "modeltap"


def test_a_hub_id_is_read_at_the_revision_its_cache_holds(
    bert_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.constants as constants

    from tests.fixtures.hf import hf_cache

    home = hf_cache(tmp_path / "hf", "org/tiny-bert", bert_dir, commit="a" * 40)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    first = runner.invoke(app, ["ls", "org/tiny-bert"])
    assert first.exit_code == 0 and len(_entries()) == 1

    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("built the tree instead of reading the cache")

    monkeypatch.setattr("modeltap.loading.hf.load_meta_model", no_build)
    assert runner.invoke(app, ["ls", "org/tiny-bert"]).output == first.output
    # a new revision in the Hugging Face cache (main moved to it) is another entry
    repo = home / "hub" / "models--org--tiny-bert"
    newer = repo / "snapshots" / ("b" * 40)
    shutil.copytree(repo / "snapshots" / ("a" * 40), newer, symlinks=False)
    config = json.loads((newer / "config.json").read_text())
    (newer / "config.json").unlink()
    (newer / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    (repo / "refs" / "main").write_text("b" * 40)
    with pytest.raises(AssertionError, match="built the tree"):
        runner.invoke(app, ["ls", "org/tiny-bert"], catch_exceptions=False)
    pinned = runner.invoke(app, ["ls", "org/tiny-bert", "--revision", "a" * 40])
    assert pinned.output == first.output
