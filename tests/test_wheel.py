"""modeltap as `pip install` leaves it: a wheel in a fresh venv, run from a folder outside the repo.

The venv has no pip and no copy of torch or transformers: a `.pth` line adds the shared venv's
site-packages after its own, as a plain path, so the shared venv's editable modeltap (its own `.pth`
file, processed only for a site directory) stays out and `import modeltap` finds the wheel's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import ROOT


def _run(args: list[str | Path], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, f"{args}\n{result.stdout}\n{result.stderr}"
    return result


@pytest.mark.slow
def test_installed_wheel_runs_dump_diff_and_compare_outside_the_checkout(
    tmp_path: Path, bert_dir: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and "MODELTAP" not in k}
    env["HOME"] = str(tmp_path)  # no user cache or config from outside
    # Build from a copy: an in-tree build leaves build/ and *.egg-info in the checkout.
    source = tmp_path / "source"
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    _run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", "dist", source], tmp_path, env)
    (wheel,) = (tmp_path / "dist").glob("modeltap-*.whl")

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], tmp_path, env)
    python = venv / "bin" / "python"
    site = _run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path, env
    ).stdout.strip()
    Path(site, "shared.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([*pip, "--python", python, "install", "--no-deps", wheel], tmp_path, env)

    away = tmp_path / "elsewhere"
    away.mkdir()
    where = _run([python, "-c", "import modeltap; print(modeltap.__file__)"], away, env)
    assert where.stdout.startswith(str(venv)), where.stdout

    def modeltap(*args: str | Path) -> str:
        return _run([venv / "bin" / "modeltap", *args], away, env).stdout

    modeltap("dump", bert_dir, "hello world", "-o", "ref.safetensors")
    modeltap("dump", bert_dir, "hello world", "--dtype", "bfloat16", "-o", "bf16.safetensors")
    # the bf16 preset, from the wheel, compares the values across dtypes (no --upcast)
    diff = modeltap("diff", "bf16.safetensors", "ref.safetensors", "--preset", "bf16")
    assert "PASS" in diff and "scaled_atol=0.05" in diff, diff
    compare = modeltap("compare", bert_dir, "hello world", "--against", "bf16")
    assert "bf16" in compare and "scaled_atol=0.05" in compare, compare
