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


def _examples():
    import importlib.util

    path = ROOT / "scripts" / "readme_examples.py"
    spec = importlib.util.spec_from_file_location("readme_examples", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_rounding_blocks_compare_words_not_rounding():
    examples = _examples()
    rounding = examples._rule("<!-- example: rounding -->")
    # What changed between 1 and 2 threads on one machine: the numbers and the module that holds
    # the largest error.
    assert rounding.same(
        "largest cumulative error 0.02898 in encoder.layer.4.attention.self.key",
        "largest cumulative error 0.03678 in encoder.layer.3.attention.self",
    )
    assert rounding.same(
        "first divergence: embeddings.LayerNorm  (max abs 4.77e-7, max rel 8.71e-5, 0.1%",
        "first divergence: embeddings.LayerNorm  (max abs 4.77e-7, max rel 1.21e-4, 0.1%",
    )
    # A changed verdict is still caught, and so is a different kind of line.
    assert not rounding.same("PASS  79 compared, 0 out", "FAIL  79 compared, 3 out")
    assert not rounding.same("no origin: every module's own", "origin: encoder.layer.3 introduced")
    # Blocks without a marker keep the shown-precision rule; rel=X widens it.
    assert not examples._rule("").same("pooler 1×384 1.184 8.23e-4", "pooler 1×384 1.184 8.34e-4")
    assert examples._rule("<!-- example: rel=0.05 -->").same(
        "pooler 1×384 1.184 8.23e-4", "pooler 1×384 1.183 8.34e-4"
    )


def test_stale_lines_are_reported_with_what_is_printed_now():
    examples = _examples()
    out, stale = examples._merge(["PASS  3 compared"], ["FAIL  3 compared"])
    assert out == ["FAIL  3 compared"]
    assert stale == ["'PASS  3 compared' now 'FAIL  3 compared'"]
    _, stale = examples._merge(["a", "b"], ["a"])
    assert stale == ["2 lines where it now prints 1"]


def test_readme_numbers_repeated_calls_as_the_recorder_does(tmp_path):
    """The README says once how the k-th call of a module is keyed; a step of three forwards,
    recorded, keys them so (checked against the outputs plain hooks saw)."""
    import re

    import torch

    import modeltap
    from modeltap.dump import load_dump

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    # Every "the first/second ... `x@k`" the README states, as (ordinal, k).
    ordinals = {"first": 1, "second": 2, "third": 3}
    pattern = r"the (first|second|third)(?: forward's keys are| call is) `[\w.]+@(\d+)`"
    claims = re.findall(pattern, readme)
    assert claims, "the README states the rule nowhere"
    # "the (N+1)-th `module@N`": a k-th call is @(k-1), the first having no suffix.
    for var, plus, suffix in re.findall(r"the \(?(\w)(\+1)?\)?-th `[\w.]+@(\w)`", readme):
        assert (var, plus) == (suffix, "+1"), f"the README keys a {var}-th call @{suffix}"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh())
    seen = []
    handle = model[0].register_forward_hook(lambda m, i, o: seen.append(o.detach().clone()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with modeltap.record(model, tmp_path / "run", every=1, full_every=1) as rec:
        for _ in range(3):
            model(torch.randn(2, 3)).sum().backward()
        opt.step()
        rec.step()
    handle.remove()
    dump = load_dump(tmp_path / "run" / "step000000.rank0.safetensors")
    for ordinal, k in claims:
        torch.testing.assert_close(dump[f"0@{k}"], seen[ordinals[ordinal] - 1], rtol=0, atol=0)
    torch.testing.assert_close(dump["0"], seen[0], rtol=0, atol=0)
