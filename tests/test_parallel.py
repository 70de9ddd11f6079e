"""tests/fixtures/parallel.py: the suite on pytest-xdist workers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT
from tests.fixtures import parallel

SHARED = """
import os
import pytest


@pytest.fixture(scope="module")
def built():
    with open(os.environ["BUILT_LOG"], "a") as log:
        log.write(os.environ.get("PYTEST_XDIST_WORKER", "main") + "\\n")


@pytest.mark.parametrize("i", range(8))
def test_shares(built, i):
    pass


@pytest.mark.parametrize("i", range(8))
def test_alone(i):
    pass
"""


def _pytest(folder: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    (folder / "conftest.py").write_text(
        "from tests.fixtures.parallel import (pytest_cmdline_main, pytest_configure_node,"
        " pytest_collection_modifyitems, pytest_xdist_auto_num_workers)\n"
    )
    (folder / "test_shared.py").write_text(SHARED)
    outside = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # a worker's
    env = {**outside, "PYTHONPATH": str(ROOT), **env}
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args]
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=120)


def test_a_folder_runs_on_workers_and_a_module_fixture_is_built_once(tmp_path: Path) -> None:
    """Without `loadgroup` and the groups, the two workers would each build `built`."""
    log = tmp_path / "built.log"
    done = _pytest(tmp_path, str(tmp_path), BUILT_LOG=str(log), PYTEST_XDIST_AUTO_NUM_WORKERS="2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "created: 2/2 workers" in done.stdout and "16 passed" in done.stdout
    assert len(log.read_text().split()) == 1, log.read_text()  # one worker built it, once


def test_a_named_file_or_no_xdist_runs_in_one_process(tmp_path: Path) -> None:
    log = tmp_path / "built.log"
    for args in (["test_shared.py"], ["-p", "no:xdist", str(tmp_path)], ["-n", "0", "."]):
        log.unlink(missing_ok=True)
        done = _pytest(tmp_path, *args, BUILT_LOG=str(log))
        assert done.returncode == 0, (args, done.stdout + done.stderr)
        assert "workers" not in done.stdout and "16 passed" in done.stdout, args
        assert log.read_text() == "main\n", args


def test_a_worker_without_omp_num_threads_takes_its_share_of_the_cpus(monkeypatch) -> None:
    threads = torch.get_num_threads()
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        parallel.share_the_cpus()
        share = max(1, len(os.sched_getaffinity(0)) // 2)
        assert (os.environ["OMP_NUM_THREADS"], torch.get_num_threads()) == (str(share), share)
        monkeypatch.setenv("OMP_NUM_THREADS", "3")  # set: each worker's, as given
        torch.set_num_threads(3)
        parallel.share_the_cpus()
        assert (os.environ["OMP_NUM_THREADS"], torch.get_num_threads()) == ("3", 3)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux")
def test_auto_is_one_worker_per_usable_cpu(monkeypatch) -> None:
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    assert parallel.pytest_xdist_auto_num_workers(None) == len(os.sched_getaffinity(0))
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "3")
    assert parallel.pytest_xdist_auto_num_workers(None) == 3
