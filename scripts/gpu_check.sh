#!/usr/bin/env bash
# Issue 29 #22: the GPU check in one run, under 8 minutes on one H100 (a GPU machine is lent to some
# sessions by chance, for about 15 minutes: run it as it is, `bash scripts/gpu_check.sh`).
#   1. a Python whose torch sees the GPU: $PYTHON, else .venv's, else python3's. Where there is a
#      GPU but only a CPU build of torch, a CUDA build of the same version (or $TORCH_SPEC) is
#      installed into .venv with every other package pinned as it is (pip's index: PIP_INDEX_URL).
#   2. the CUDA tests: those named *cuda* in the test files that ask torch.cuda.is_available().
#   3. scripts/gpu_check.py: `modeltap dump`, `grads` and `generate` of a 1.1B Llama in bf16 built
#      from a config (no download), then dump / bare forward and the others, peak RSS and GPU
#      memory, as one table (its docstring says how each figure is taken).
# Without a CUDA GPU it prints one line saying why and exits 0. GPU_CHECK_TINY=1 runs the whole flow
# on the CPU with a tiny Llama instead: a dry run of every step but the GPU itself.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1

skip() {
  echo "gpu_check: skipped, $*"
  exit 0
}

sees_cuda() { "$1" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; }

candidates=()
seen=" "
for py in "${PYTHON:-}" .venv/bin/python python3; do
  [ -n "$py" ] && command -v "$py" >/dev/null || continue
  real=$(realpath "$(command -v "$py")")
  case "$seen" in *" $real "*) continue ;; esac
  seen="$seen$real "
  candidates+=("$py")
done
[ ${#candidates[@]} -gt 0 ] || skip "no Python found (set PYTHON)"

tiny=${GPU_CHECK_TINY:-0}
if [ "$tiny" = 1 ]; then
  python=${candidates[0]}
  device=cpu
else
  if [ "${CUDA_VISIBLE_DEVICES+set}" = set ] && [[ "$CUDA_VISIBLE_DEVICES" =~ ^(|-1)$ ]]; then
    skip "CUDA_VISIBLE_DEVICES='$CUDA_VISIBLE_DEVICES' hides every GPU"
  fi
  python=""
  for py in "${candidates[@]}"; do
    if sees_cuda "$py"; then python=$py && break; fi
  done
  if [ -z "$python" ]; then
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    if [ "${gpus:-0}" = 0 ]; then
      torch=$("${candidates[0]}" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo none)
      skip "no CUDA GPU on this machine (no GPU in nvidia-smi; ${candidates[0]}'s torch: $torch)"
    fi
    [ -x .venv/bin/python ] || { echo "gpu_check: $gpus GPU(s) but no torch sees them, and no .venv (run scripts/setup.sh)" >&2; exit 1; }
    version=$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])')
    spec=${TORCH_SPEC:-torch==$version}
    echo "gpu_check: $gpus GPU(s), .venv's torch is a CPU build: installing $spec, all else pinned" >&2
    constraints=$(mktemp)
    trap 'rm -f "$constraints"' EXIT
    .venv/bin/python -m pip freeze --exclude-editable | grep -iv '^torch[=@ ]' > "$constraints"
    .venv/bin/python -m pip install -q --force-reinstall --no-deps "$spec"
    .venv/bin/python -m pip install -q -c "$constraints" "$spec"  # its CUDA libraries, nothing else
    sees_cuda .venv/bin/python || { echo "gpu_check: $spec installed, still no CUDA in torch" >&2; exit 1; }
    python=.venv/bin/python
  fi
  device=cuda
fi

echo "gpu_check: $($python -c 'import sys, torch; print(sys.executable, "torch", torch.__version__, "cuda", torch.version.cuda)')"
if [ "$device" = cuda ]; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; fi

# The tests that skip without a GPU; naming the files keeps pytest in one process (no workers).
files=$(grep -l 'cuda.is_available' tests/test_*.py)
set +e
# shellcheck disable=SC2086
timeout 180 "$python" -m pytest -q -p no:cacheprovider -rs -k cuda $files 2>&1 | tee /tmp/gpu_check_tests.$$
tests=$(grep -E '^=*.*[0-9]+ (passed|failed|skipped|error)' /tmp/gpu_check_tests.$$ | tail -n1 | tr -d '=' | xargs)
rm -f /tmp/gpu_check_tests.$$
set -e

args=(--device "$device" --tests "${tests:-no summary}")
[ "$tiny" = 1 ] && args+=(--tiny)
timeout 330 "$python" scripts/gpu_check.py "${args[@]}"
case "$tests" in *failed* | *error* | "") exit 1 ;; esac
