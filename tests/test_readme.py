"""The examples of README.md and of every docs page print what modeltap prints today, and their
Python snippets run (scripts/readme_examples.py)."""

import subprocess
import sys

import pytest

from tests.conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _have_minilm():
    return (ROOT / "models" / "all-MiniLM-L6-v2" / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("page", [p.relative_to(ROOT).as_posix() for p in PAGES])
def test_examples_are_current(page, monkeypatch):
    """Each page on its own, so the pages spread over the xdist workers."""
    if not _have_minilm():
        pytest.skip("the real MiniLM is not unpacked; run scripts/setup.sh")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _, problems = _examples().check_page(ROOT / page)
    assert not problems, "\n".join([*problems, "refresh with: scripts/readme_examples.py " + page])


def test_the_check_runs_from_the_command_line(tmp_path):
    """On a page of one command that needs no model (the pages themselves run above)."""
    page = tmp_path / "page.md"
    page.write_text("```\n$ modeltap --version | head -1\nmodeltap 0.0.0\n```\n")
    script = [sys.executable, str(ROOT / "scripts" / "readme_examples.py")]
    result = subprocess.run([*script, "--check", str(page)], capture_output=True, text=True)
    assert result.returncode == 1 and "out of date" in result.stderr, result.stderr
    assert subprocess.run([*script, str(page)], capture_output=True).returncode == 0
    result = subprocess.run([*script, "--check", str(page)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert page.read_text().splitlines()[2].startswith("modeltap ")


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
    """The docs say how the k-th call of a module is keyed; a step of three forwards,
    recorded, keys them so (checked against the outputs plain hooks saw)."""
    import re

    import torch

    import modeltap
    from modeltap.dump import load_dump

    readme = "\n".join(p.read_text(encoding="utf-8") for p in PAGES)
    # Every "the first/second ... `x@k`" the README and the docs state, as (ordinal, k).
    ordinals = {"first": 1, "second": 2, "third": 3}
    pattern = r"the (first|second|third)(?: forward's keys are| call is) `[\w.]+@(\d+)`"
    claims = re.findall(pattern, readme)
    assert claims, "neither the README nor the docs state the rule"
    # "the (N+1)-th `module@N`": a k-th call is @(k-1), the first having no suffix.
    for var, plus, suffix in re.findall(r"the \(?(\w)(\+1)?\)?-th `[\w.]+@(\w)`", readme):
        assert (var, plus) == (suffix, "+1"), f"a page keys a {var}-th call @{suffix}"
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


# The ls page's first example, as a page would show it (the tree's first two rows, then `...`).
LS_PAGE = """
```
$ modeltap ls models/all-MiniLM-L6-v2 --depth 2
module                       class               params
__root__                     BertModel       22,713,216
...
```
"""


@pytest.mark.slow
def test_the_check_fails_when_an_option_is_renamed_or_a_line_changes_shape(tmp_path):
    """The examples check against a page that is right, then against the same page after an
    option was renamed (as if `--depth` became `--max-depth` in the program) and after a
    printed line changed shape (a column more): the first passes, both others fail."""
    if not _have_minilm():
        pytest.skip("the real MiniLM is not unpacked; run scripts/setup.sh")
    examples = _examples()
    (tmp_path / "models").symlink_to(ROOT / "models")
    _, problems = examples.regenerate(LS_PAGE, tmp_path)
    assert problems == []
    renamed = LS_PAGE.replace("--depth 2", "--max-depth 2")
    _, problems = examples.regenerate(renamed, tmp_path)
    assert problems and "no longer printed" in problems[0], problems
    reshaped = LS_PAGE.replace("BertModel       22,713,216", "BertModel  cpu  22,713,216")
    _, problems = examples.regenerate(reshaped, tmp_path)
    assert problems == [
        "`modeltap ls models/all-MiniLM-L6-v2 --depth 2`: "
        "'__root__                     BertModel  cpu  22,713,216' is no longer printed"
    ]


def test_python_snippets_run_and_fragments_are_left_alone(tmp_path):
    examples = _examples()
    page = "```python\nimport json\nopen('made.json', 'w').write(json.dumps(1))\n```\n"
    assert examples.regenerate(page, tmp_path) == (page, [])
    assert (tmp_path / "made.json").read_text() == "1"
    broken = "text\n```python\nraise ValueError('no dataset')\n```\n"
    _, problems = examples.regenerate(broken, tmp_path)
    assert problems == ["the python block at line 2 raised ValueError: no dataset"]
    fragment = "<!-- example: fragment -->\n" + broken.split("\n", 1)[1]
    assert examples.regenerate(fragment, tmp_path) == (fragment, [])


def test_a_block_the_script_cannot_run_fails_the_check_unless_marked_a_fragment(tmp_path):
    """Before: a block with a pipe or another program was left as written, silently."""
    examples = _examples()
    page = "```\n$ espeak-ng -w spoken.wav hello\n$ modeltap ls spoken.wav\n```\n"
    _, problems = examples.regenerate(page, tmp_path)
    assert problems == [
        "the block at line 1 is skipped: it runs what this script can't; make it runnable, "
        "or mark it a fragment"
    ]
    fragment = "<!-- example: fragment -->\n" + page
    assert examples.regenerate(fragment, tmp_path) == (fragment, [])
    piped = "```\n$ modeltap --help | grep dump\n```\n"
    assert examples.regenerate(piped, tmp_path)[1][0].startswith("the block at line 1 is skipped")


def test_head_keeps_a_commands_first_lines_and_python_runs_a_docs_example(tmp_path):
    examples = _examples()
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / "a.txt").write_text("")
    (scratch / "b.txt").write_text("")
    every, code = examples.run("ls -1", scratch)
    assert every == ["a.txt", "b.txt"] and code == 0
    assert examples.run("ls -1 | head -1", scratch) == (["a.txt"], 0)
    # a script of docs/examples runs in the scratch folder, its stdout the output, a path into
    # the folder printed relative to it
    examples.EXAMPLES = tmp_path / "examples"
    examples.EXAMPLES.mkdir()
    (examples.EXAMPLES / "hello.py").write_text(
        "import os, sys\nopen('made.txt', 'w')\nprint(os.path.abspath('made.txt'))\n"
        "print('noise', file=sys.stderr)\n"
    )
    page = "```\n$ python hello.py\nstale\n```\n"
    out, problems = examples.regenerate(page, scratch)
    assert problems == ["`python hello.py`: 'stale' now 'made.txt'"]
    assert out == page.replace("stale", "made.txt") and (scratch / "made.txt").is_file()


def test_a_python_block_leaves_transformers_log_as_it_found_it(tmp_path):
    """A Trainer in a page's python block sets transformers' verbosity for the process; a later
    page's command then printed transformers' warnings into its output (generate.md's Whisper
    after README.md's Trainer, in one pytest process)."""
    from transformers.utils import logging

    examples = _examples()
    before = logging.get_verbosity()
    page = "```python\nfrom transformers.utils import logging\nlogging.set_verbosity_info()\n```\n"
    assert examples.regenerate(page, tmp_path) == (page, [])
    assert logging.get_verbosity() == before
