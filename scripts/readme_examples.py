"""Regenerate (or check) the example outputs in README.md and every page of docs/ by running them.

Every fenced block of a page whose lines start with `$ modeltap ...` is an example: each command
runs (in-process, 80 columns, in a scratch folder shared by the page's blocks, with the checkout's
`models/` linked in) and the lines after it, up to the next `$` line, are its output (stdout, then
stderr). `$ echo $?` prints the previous command's exit code, `$ ls ARGS` lists files as `ls` does,
`$ python NAME.py` runs the script docs/examples/NAME.py (copied into the scratch folder, where the
page can link it; its stdout, and its stderr only when it fails; a factory `NAME:function` of
docs/examples is copied in the same way), and `| head -N` after a command keeps its first N lines;
a path into the scratch folder is printed relative to it. A line `...` elides output: there, the
page's lines are kept and only their numbers are refreshed, each from the generated line with the
same words. A block that runs anything else fails the check (`skipped`) unless it is marked a
fragment, as below. A ```python block runs too (in the same folder, in page order, its own
globals), and fails the check when it raises. A block that cannot run here (it needs your dataset
or a framework's launcher) says so in the line before its fence, `<!-- example: fragment -->`, and
in its text; no `$` block of the docs is one.

    python scripts/readme_examples.py                   # rewrite README.md and docs/**/*.md
    python scripts/readme_examples.py --check           # exit 1 if an example is out of date
    python scripts/readme_examples.py --check docs/commands/diff.md   # those pages only

The check compares words exactly and numbers to their shown precision (5e-3 relative), so it does
not fail on another CPU's float rounding, and each line's words and shape, so a renamed option
(the command fails) or a printed line that changed shape fails it. A block whose numbers come
from rounding itself says so in an HTML comment on the line before its fence (invisible on the
rendered page):

    <!-- example: rel=0.05 -->  numbers within 5% (statistics of a bfloat16 run)
    <!-- example: rounding -->  numbers that measure rounding itself (an eager/compiled or
        float32/bfloat16 error, counts out of tolerance, the module holding the largest error):
        numbers and module names are not compared, the other words and the shape of each line
        are, so a changed verdict still fails
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.fixtures.golden import number, same_line  # noqa: E402

README = ROOT / "README.md"
DOCS = ROOT / "docs"
EXAMPLES = DOCS / "examples"  # the scripts a page's `$ python NAME.py` runs
FENCE = "```"
ELIDED = "..."
FRAGMENT = "<!-- example: fragment -->"


# A dotted module name (encoder.layer.3.output.dense, embeddings.LayerNorm), as a word of a line.
_MODULE = re.compile(r"^[(]?[A-Za-z_][\w]*(\.[\w]+)+[,):]*$")
# The marker before a block's fence: `<!-- example: rel=0.05 -->` or `<!-- example: rounding -->`.
_MARKER = re.compile(
    r"^<!-- example: (rel=(?P<rel>[0-9.e-]+)|(?P<rounding>rounding)|(?P<fragment>fragment)) -->$"
)


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
    if match is None or match["fragment"]:
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


def _tiny_gpt2_fault(folder: Path) -> None:
    """`./tiny-gpt2-fault` of the generation guide: the tiny GPT-2 with the position-embedding row
    that decoding step 3 of the guide's prompt reads replaced (so the two part at step 3)."""
    import shutil

    import torch
    from transformers import AutoTokenizer, GPT2LMHeadModel

    source = folder.parent / "tiny-gpt2"
    if not source.exists():
        _tiny_gpt2(source)
    model = GPT2LMHeadModel.from_pretrained(source)
    position = len(AutoTokenizer.from_pretrained(source)("hello world the quick")["input_ids"]) + 2
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        row = model.transformer.wpe.weight[position]
        row.copy_(torch.randn(row.shape, generator=generator) * 2)
    model.save_pretrained(folder)
    for name in source.iterdir():
        if name.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(name, folder / name.name)


def _commands(block: list[str]) -> list[tuple[str, list[str]]]:
    """(command, page's output lines) pairs of one block, continuations joined."""
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
    """The new output lines for one command, and the page's lines that no longer match (each
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


def _tiny_gpt2(folder: Path) -> None:
    """`./tiny-gpt2` of the generation examples: the tests' tiny GPT-2, built from a config."""
    from tests.fixtures.hf import build_gpt2

    build_gpt2(folder)


def _tiny_whisper(folder: Path) -> None:
    """`./tiny-whisper` of the generate page: the tests' tiny Whisper with its processor."""
    from tests.fixtures.media import build_whisper_generator

    build_whisper_generator(folder)


def _tone(path: Path) -> None:
    """`tone.wav` of the generate page: 1.028 s of a 440 Hz sine at 16 kHz, longer than the tiny
    Whisper's 1 s window."""
    from tests.fixtures.media import tone, write_wav

    write_wav(path, tone(16_000, 1.028), 16_000)


# Folders and files some examples name, made in the scratch folder the first time a command
# mentions them.
FIXTURES = {
    "./minilm-fault": _faulted_minilm,
    "runs/exp3": _tripped_run,
    "runs/base": _runs_apart,
    "runs/fault": _runs_apart,
    "./tiny-vit": _tiny_vit,
    "./tiny-gpt2": _tiny_gpt2,
    "./tiny-gpt2-fault": _tiny_gpt2_fault,
    "cat.png": _picture(1, 64, 48),
    "dog.jpg": _picture(2, 40, 60),
    "./tiny-whisper": _tiny_whisper,
    "tone.wav": _tone,
}


def _head(args: list[str]) -> tuple[list[str], int | None]:
    """A command's own words, and N of a `| head -N` after it (None without one)."""
    if "|" not in args:
        return args, None
    at = args.index("|")
    pipe = args[at + 1 :]
    if len(pipe) != 2 or pipe[0] != "head" or not re.fullmatch(r"-\d+", pipe[1]):
        raise ValueError(f"only `| head -N` follows a command here, not `| {shlex.join(pipe)}`")
    return args[:at], int(pipe[1][1:])


def run(command: str, cwd: Path) -> tuple[list[str], int]:
    """Run one command; (output lines, exit code)."""
    args, head = _head(shlex.split(command, comments=True))
    lines, code = _run_one(args, cwd)
    # a path into the scratch folder (an op's source line) as the reader's, relative to it
    lines = [line.replace(f"{cwd.resolve()}{os.sep}", "") for line in lines]
    return (lines if head is None else lines[:head]), code


def _copy_examples(args: list[str], cwd: Path) -> None:
    """The docs/examples scripts a command names, as `NAME.py` or as a factory `NAME:function`,
    copied into the scratch folder (a fresh import of each)."""
    for arg in args:
        name = re.fullmatch(r"(\w+)(\.py|:\w+)", arg)
        if name and (EXAMPLES / f"{name[1]}.py").is_file():
            source = (EXAMPLES / f"{name[1]}.py").read_text(encoding="utf-8")
            (cwd / f"{name[1]}.py").write_text(source, encoding="utf-8")
            sys.modules.pop(name[1], None)


def _run_one(args: list[str], cwd: Path) -> tuple[list[str], int]:
    """`modeltap ...` in-process, `ls`, or `python NAME.py` (docs/examples/NAME.py)."""
    from typer.testing import CliRunner

    from modeltap.cli import app

    for name, build in FIXTURES.items():
        if name in args and not (cwd / name).exists():
            build(cwd / name)
    _copy_examples(args, cwd)
    if args[0] == "python":
        done = subprocess.run(
            [sys.executable, *args[1:]], cwd=cwd, capture_output=True, text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )  # fmt: skip
        # stdout alone: the libraries' warnings and progress bars vary between installs
        text = done.stdout + (done.stderr if done.returncode else "")
        return text.rstrip("\n").splitlines(), done.returncode
    if args[0] == "ls":
        done = subprocess.run(
            ["ls", "-C", "-w", "80", "-T", "0", *args[1:]],
            cwd=cwd,
            capture_output=True,
            text=True,
            env={**os.environ, "LC_ALL": "C"},
        )
        return (done.stdout + done.stderr).rstrip("\n").splitlines(), done.returncode
    old = Path.cwd()
    os.chdir(cwd)
    try:
        with _library_logging():
            result = CliRunner().invoke(app, args[1:], env={"COLUMNS": "80"}, terminal_width=80)
    finally:
        os.chdir(old)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise RuntimeError(f"`{shlex.join(args)}` raised {result.exception!r}")
    text = result.stdout + result.stderr
    return [line.rstrip() for line in text.splitlines()], result.exit_code


@contextlib.contextmanager
def _library_logging() -> Iterator[None]:
    """transformers' log as a process started fresh has it, around one example. Its handler holds
    the stderr of the moment it is made: made here, not inside a command whose captured stderr is
    closed after it; and a Trainer in a python block sets its verbosity for the whole process."""
    from transformers.utils import logging

    verbosity = logging.get_verbosity()  # makes the handler, on this process' stderr
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)


def run_python(code: str, cwd: Path) -> str | None:
    """Run one ```python block in `cwd`, in globals of its own; the error it raised, if any."""
    old = Path.cwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(io.StringIO()), _library_logging():
            exec(compile(code, "<example>", "exec"), {"__name__": "__example__"})
    except Exception as exc:  # any error of the snippet is the finding
        return f"{type(exc).__name__}: {exc}"
    finally:
        os.chdir(old)
    return None


def _runnable(commands: list[str]) -> bool:
    """Whether every `$` line of a block is one this script runs: modeltap, `echo $?`, `ls`
    without a pattern for a shell to expand, or `python NAME.py` of docs/examples, each at most
    followed by `| head -N`."""

    def one(command: str) -> bool:
        command = re.sub(r" \| head -\d+$", "", command)
        if "|" in command:
            return False
        if command == "$ echo $?":
            return True
        if command.startswith("$ ls ") or command == "$ ls":
            return not any(c in command for c in "*?[")
        script = re.fullmatch(r"\$ python (\w+\.py)(\s+#.*)?", command)
        if script:
            return (EXAMPLES / script[1]).is_file()
        return command.startswith("$ modeltap ")

    return bool(commands) and all(map(one, commands))


def _run_block(block: list[str], scratch: Path, rule: Rule) -> tuple[list[str], list[str]]:
    """A command block's lines with fresh output, and the lines that no longer match."""
    out: list[str] = []
    problems: list[str] = []
    last_code = 0
    lead = next(i for i, line in enumerate(block) if line.startswith("$ "))
    out += block[:lead]  # text before the first command (what led to it) is kept as written
    raw = iter(block[lead:])
    for command, shown in _commands(block):
        head = next(raw)
        out.append(head)
        while head.endswith("\\"):
            head = next(raw)
            out.append(head)
        for _ in shown:
            next(raw)
        if command.strip() == "echo $?":
            generated = [str(last_code)]
        else:
            generated, last_code = run(command, scratch)
        new, stale = _merge(shown, generated, rule)
        out.extend(new)
        problems += [f"`{command}`: {s}" for s in stale]
    return out, problems


def regenerate(text: str, scratch: Path) -> tuple[str, list[str]]:
    """A page with its examples' output refreshed, and what no longer matched."""
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
        marker = out[-2] if len(out) > 1 else ""
        if line.strip() == FENCE + "python" and marker.strip() != FRAGMENT:
            error = run_python("\n".join(block) + "\n", scratch)
            if error:
                problems.append(f"the python block at line {i - len(block) - 1} raised {error}")
        commands = [b for b in block if b.startswith("$ ")]
        if line.strip() == FENCE and commands and marker.strip() != FRAGMENT:
            if _runnable(commands):
                block, stale = _run_block(block, scratch, _rule(marker))
                problems += stale
            else:
                problems.append(f"the block at line {i - len(block) - 1} is skipped: it runs "
                                "what this script can't; make it runnable, or mark it a fragment")
        out.extend(block)
        out.append(FENCE)
    return "\n".join(out) + "\n", problems


def pages() -> list[Path]:
    """README.md and every page of the docs site."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def check_page(page: Path) -> tuple[str, list[str]]:
    """Run one page's examples in a scratch folder of its own: (the refreshed page, problems)."""
    with tempfile.TemporaryDirectory() as folder:
        scratch = Path(folder)
        (scratch / "models").symlink_to(ROOT / "models")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        return regenerate(page.read_text(encoding="utf-8"), scratch)


def main() -> int:
    args = sys.argv[1:]
    if {"-h", "--help"} & set(args):
        print(__doc__.split("\n\n")[2])  # the usage lines of the module docstring
        return 0
    check = "--check" in args
    unknown = [a for a in args if a.startswith("-") and a != "--check"]
    missing = [a for a in args if not a.startswith("-") and not Path(a).is_file()]
    if unknown or missing:
        print(f"readme_examples: no option or page {(unknown + missing)[0]!r}; see --help",
              file=sys.stderr)
        return 2
    chosen = [Path(a).resolve() for a in args if a != "--check"] or pages()
    failed = 0
    for page in chosen:
        name = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page
        new, problems = check_page(page)
        if check:
            for problem in problems:
                print(f"{name}: out of date: {problem}", file=sys.stderr)
            failed += bool(problems)
        elif new != page.read_text(encoding="utf-8"):
            page.write_text(new, encoding="utf-8")
            print(f"{name}: {len(problems)} example lines refreshed", file=sys.stderr)
    if failed:
        print("examples are out of date: run scripts/readme_examples.py", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
