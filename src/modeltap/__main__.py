"""The `modeltap` command (`python -m modeltap`, and the installed script): the CLI in a process
whose string hashes are the same from run to run.

Python salts str hashes per process, and so the order in which a set of strings iterates. Some
models call a module in that order: Gemma3 and ModernBERT run `rotary_emb` once per layer type,
looping over `set(config.layer_types)`. Which call is `rotary_emb` and which `rotary_emb@1` would
then change from one run to the next, and two dumps of one model and input would differ there.
With PYTHONHASHSEED unset, the command starts again at once with PYTHONHASHSEED=0, before importing
anything heavy (not for help or --version, where no model runs: a quarter of `--help`'s time);
a seed the user set is kept.
"""

from __future__ import annotations

import os
import sys

HASH_SEED = "0"


# Arguments that only print text (help, the version): no model runs, so no restart for them.
_NOTHING_RUNS = ([], ["-h"], ["--help"], ["--version"])


def main() -> None:
    args = sys.argv[1:]
    if _hash_seed_unset() and not (args in _NOTHING_RUNS or args[1:] in (["-h"], ["--help"])):
        try:
            os.execve(sys.executable, sys.orig_argv, {**os.environ, "PYTHONHASHSEED": HASH_SEED})
        except OSError:
            pass  # not restartable here: go on with this process' salt
    from modeltap.cli import main as cli_main

    cli_main()


def _hash_seed_unset() -> bool:
    # -E and -I ignore PYTHONHASHSEED (restarting would loop); Windows has no exec that keeps the
    # process, only one that starts another and leaves the shell waiting on nothing.
    return (
        os.name == "posix"
        and bool(sys.executable)
        and not sys.flags.ignore_environment
        and os.environ.get("PYTHONHASHSEED", "") in ("", "random")
    )


if __name__ == "__main__":
    main()
