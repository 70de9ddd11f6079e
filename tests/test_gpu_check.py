"""scripts/gpu_check.sh where there is no CUDA GPU: one line saying why, exit 0, nothing else."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT


def _run(env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    script = ROOT / "scripts" / "gpu_check.sh"
    return subprocess.run(
        ["bash", str(script)], env=env, cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_hidden_gpus_are_one_skip_line(tmp_path: Path) -> None:
    done = _run({**os.environ, "CUDA_VISIBLE_DEVICES": ""}, tmp_path)  # hides any GPU
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    assert done.stdout == "gpu_check: skipped, CUDA_VISIBLE_DEVICES='' hides every GPU\n"


@pytest.mark.skipif(
    torch.cuda.is_available() or shutil.which("nvidia-smi") is not None,
    reason="a machine without a GPU",
)
def test_no_gpu_is_one_skip_line_naming_the_torch_it_asked(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    done = _run({**env, "PYTHON": sys.executable}, tmp_path)
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    assert done.stdout == (
        f"gpu_check: skipped, no CUDA GPU on this machine (no GPU in nvidia-smi; "
        f"{sys.executable}'s torch: {torch.__version__})\n"
    )
