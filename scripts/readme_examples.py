"""Regenerate (or check) the example outputs in README.md by running their commands.

Every fenced block in README.md whose lines start with `$ modeltap ...` is an example: each command
runs (in-process, 80 columns, in one scratch folder shared by all blocks, with the checkout's
`models/` linked in) and the lines after it, up to the next `$` line, are its output (stdout, then
stderr). `$ echo $?` prints the previous command's exit code. A line `...` in the README elides
output: there, the README's lines are kept and only their numbers are refreshed, each from the
generated line with the same words. A block that also runs something else (`$ ls`, a pipe, a
command that needs a training run first) is left as written.

    python scripts/readme_examples.py           # rewrite README.md
    python scripts/readme_examples.py --check   # exit 1 if an example's output is out of date

The check compares words exactly and numbers to their shown precision (5e-3 relative), so it does
not fail on another CPU's float rounding. A block whose numbers come from rounding itself says so
in an HTML comment on the line before its fence (invisible on the rendered page):

    <!-- example: rel=0.05 -->  numbers within 5% (statistics of a bfloat16 run)
    <!-- example: rounding -->  numbers that measure rounding itself (an eager/compiled or
        float32/bfloat16 error, counts out of tolerance, the module holding the largest error):
        numbers and module names are not compared, the other words and the shape of each line
        are, so a changed verdict still fails
"""

from __future__ import annotations

import os
import re
import shlex
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.fixtures.golden import number, same_line  # noqa: E402

README = ROOT / "README.md"
FENCE = "```"
ELIDED = "..."


# A dotted module name (encoder.layer.3.output.dense, embeddings.LayerNorm), as a word of a line.
_MODULE = re.compile(r"^[(]?[A-Za-z_][\w]*(\.[\w]+)+[,):]*$")
# The marker before a block's fence: `<!-- example: rel=0.05 -->` or `<!-- example: rounding -->`.
_MARKER = re.compile(r"^<!-- example: (rel=(?P<rel>[0-9.e-]+)|(?P<rounding>rounding)) -->$")


@dataclass(frozen=True)
class Rule:
    """How one block's output lines are compared with the README's."""

    rel: float = 5e-3
    rounding: bool = False

    def shape(self, line: str) -> list[str]:
        """The words of a line with what this rule does not compare blanked: numbers always (an
        elided README line is matched by its shape), module names too for rounding."""
        return [
            "#" if number(w) is not None or (self.rounding and _MODULE.match(w)) else w
            for w in line.split()
        ]

    def same(self, line: str, other: str) -> bool:
        if self.rounding:
            return self.shape(line) == self.shape(other)
        return same_line(line, other, rel=self.rel)


def _rule(marker: str) -> Rule:
    match = _MARKER.match(marker.strip())
    if match is None:
        return Rule()
    if match["rounding"]:
        return Rule(rounding=True)
    return Rule(rel=float(match["rel"]))


def _faulted_minilm(folder: Path) -> None:
    """`./minilm-fault` of the compare example: MiniLM with one row of one Linear scaled by 1.01."""
    import shutil

    import torch
    from transformers import AutoModel

    source = ROOT / "models" / "all-MiniLM-L6-v2"
    model = AutoModel.from_pretrained(source)
    with torch.no_grad():
        model.encoder.layer[3].output.dense.weight[0] *= 1.01
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)


def _tripped_run(folder: Path) -> None:
    """`runs/exp3` of the replay example, beside its `tripmodel.py` in the scratch folder."""
    from tests.fixtures.recorded_runs import tripped_run

    tripped_run(folder.parent.parent, "runs/exp3")


def _runs_apart(folder: Path) -> None:
    """`runs/base` and `runs/fault` of the run diff example (the run diff test's training)."""
    from tests.fixtures.recorded_runs import run_with_fault

    run_with_fault(folder, 20 if folder.name == "fault" else None)


def _tiny_vit(folder: Path) -> None:
    """`./tiny-vit` of the images example: a random 2-layer ViT classifier with its processor."""
    from tests.fixtures.media import build_vit

    build_vit(folder)


def _picture(seed: int, width: int, height: int) -> Any:
    def make(path: Path) -> None:
        from tests.fixtures.media import write_image

        write_image(path, width, height, seed=seed)

    return make


# Folders and files some examples name, made in the scratch folder the first time a command
# mentions them.
FIXTURES = {
    "./minilm-fault": _faulted_minilm,
    "runs/exp3": _tripped_run,
    "runs/base": _runs_apart,
    "runs/fault": _runs_apart,
    "./tiny-vit": _tiny_vit,
    "cat.png": _picture(1, 64, 48),
    "dog.jpg": _picture(2, 40, 60),
}


def run(command: str, cwd: Path) -> tuple[list[str], int]:
    """Run one `modeltap ...` command in-process; (output lines, exit code)."""
    from typer.testing import CliRunner

    from modeltap.cli import app

    args = shlex.split(command, comments=True)[1:]
    for name, build in FIXTURES.items():
        if name in args and not (cwd / name).exists():
            build(cwd / name)
    old = Path.cwd()
    os.chdir(cwd)
    try:
        result = CliRunner().invoke(app, args, env={"COLUMNS": "80"}, terminal_width=80)
    finally:
        os.chdir(old)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise RuntimeError(f"`{command}` raised {result.exception!r}")
    text = result.stdout + result.stderr
    return [line.rstrip() for line in text.splitlines()], result.exit_code


def _commands(block: list[str]) -> list[tuple[str, list[str]]]:
    """(command, README output lines) pairs of one block, continuations joined."""
    pairs: list[tuple[str, list[str]]] = []
    lines = iter(block)
    for line in lines:
        if line.startswith("$ "):
            command = line[2:]
            while command.endswith("\\"):
                command = command[:-1] + " " + next(lines).strip()
            pairs.append((command, []))
        elif pairs:
            pairs[-1][1].append(line)
    return pairs


def _merge(
    readme: list[str], generated: list[str], rule: Rule = Rule()
) -> tuple[list[str], list[str]]:
    """The new output lines for one command, and the README lines that no longer match (each
    with the line it was matched against)."""
    if ELIDED not in [line.strip() for line in readme]:
        if len(readme) != len(generated):
            return generated, [f"{len(readme)} lines where it now prints {len(generated)}"]
        pairs = zip(readme, generated, strict=True)
        stale = [f"{a!r} now {b!r}" for a, b in pairs if not rule.same(a, b)]
        return generated, stale
    out, stale, start = [], [], 0
    for line in readme:
        if line.strip() == ELIDED or not line.strip():
            out.append(line)
            continue
        for i in range(start, len(generated)):
            if rule.shape(generated[i]) == rule.shape(line):
                if not rule.same(line, generated[i]):
                    stale.append(f"{line!r} now {generated[i]!r}")
                out.append(generated[i])
                start = i + 1
                break
        else:
            stale.append(f"{line!r} is no longer printed")
            out.append(line)
    return out, stale


def regenerate(text: str, scratch: Path) -> tuple[str, list[str]]:
    lines = text.splitlines()
    out: list[str] = []
    problems: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        out.append(line)
        i += 1
        if not line.startswith(FENCE):
            continue
        end = lines.index(FENCE, i)
        block = lines[i:end]
        i = end + 1
        commands = [b for b in block if b.startswith("$ ")]
        runnable = all(c.startswith("$ modeltap ") or c == "$ echo $?" for c in commands)
        if line.strip() != FENCE or not commands or not runnable or "|" in "".join(commands):
            out.extend(block)
            out.append(FENCE)
            continue
        rule = _rule(out[-2] if len(out) > 1 else "")
        last_code = 0
        raw = iter(block)
        for command, readme_out in _commands(block):
            head = next(raw)
            out.append(head)
            while head.endswith("\\"):
                head = next(raw)
                out.append(head)
            for _ in readme_out:
                next(raw)
            if command.strip() == "echo $?":
                generated = [str(last_code)]
            elif command.startswith("modeltap "):
                generated, last_code = run(command, scratch)
            else:
                raise ValueError(f"README example runs something other than modeltap: {command}")
            new, stale = _merge(readme_out, generated, rule)
            out.extend(new)
            problems += [f"`{command}`: {s}" for s in stale]
        out.append(FENCE)
    return "\n".join(out) + "\n", problems


def main() -> int:
    check = "--check" in sys.argv[1:]
    with tempfile.TemporaryDirectory() as folder:
        scratch = Path(folder)
        (scratch / "models").symlink_to(ROOT / "models")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        new, problems = regenerate(README.read_text(), scratch)
    if check:
        for problem in problems:
            print(f"out of date: {problem}", file=sys.stderr)
        if problems:
            print(
                "README examples are out of date: run scripts/readme_examples.py", file=sys.stderr
            )
        return 1 if problems else 0
    README.write_text(new)
    print(f"README.md: {len(problems)} example lines refreshed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
