"""The README's example outputs are what modeltap prints today (scripts/readme_examples.py)."""

import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
def test_readme_examples_are_current():
    if not (ROOT / "models" / "all-MiniLM-L6-v2" / "model.safetensors").is_file():
        pytest.skip("the real MiniLM is not unpacked; run scripts/setup.sh")
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "readme_examples.py"), "--check"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr


def test_stale_output_is_detected():
    from tests.fixtures.golden import same_line

    assert same_line("layer.0  1×4×384  21.99  0.02775", "layer.0  1×4×384  21.99  0.02776")
    assert not same_line("layer.0  1×4×384  21.99  0.02775", "layer.0  1×4×384  22.99  0.02775")
    assert not same_line(
        "wrote minilm.grads.safetensors", "wrote all-MiniLM-L6-v2.grads.safetensors"
    )
