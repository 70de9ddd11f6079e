"""What a low-precision format would do to a tensor: quantize-then-dequantize (`quantize`) with
each format's standard recipe, and the error that introduces (`format_error`, `format_errors`).

The recipes (docs/commands/dump.md states them for users):

- `fp8_e4m3`, `fp8_e5m2`: per-tensor current scaling, s = amax / fmax (448, 57344),
  Q(x) = float8(x / s) * s, saturated to +-fmax, rounded to nearest even by torch's casts.
- `mxfp8` (E4M3 elements), `mxfp4` (E2M1): OCP Microscaling v1.0, blocks of 32 consecutive values
  along the last dimension, shared scale 2^(floor(log2(amax_block)) - emax_elem) (emax 8 for E4M3,
  2 for E2M1; the E8M0 exponent kept within [-127, 127]), elements rounded to nearest even and
  saturated; a last dimension that is not a multiple of 32 pads its last block with zeros.
- `nvfp4`: blocks of 16 along the last dimension, E2M1 elements, a per-tensor float32 scale
  g = amax / (448 * 6) and a per-block E4M3 scale e4m3(amax_block / (6 * g)), so an element
  is x / (scale_block * g) rounded to E2M1 (as NVIDIA's ModelOpt and Transformer Engine do).
- `int8`: per-tensor symmetric, s = amax / 127, round half to even, clamp to [-127, 127];
  `int4`: groups of 32 along the last dimension, s = amax_group / 7, clamp to [-7, 7].

Every figure is over the finite values: NaN and +-Inf are left as they are by `quantize` and out
of the amax, the norms and the shares. Values are quantized in float32 (a bfloat16 or float16
tensor exactly; a float64 one rounded to float32 first), so a half-precision tensor is measured
against its own values. Each format is one vectorized pass over the tensor (blocks are a reshape),
no Python loop over elements.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from modeltap.errors import InputError

FORMATS: tuple[str, ...] = ("fp8_e4m3", "fp8_e5m2", "mxfp8", "mxfp4", "nvfp4", "int8", "int4")

E4M3_MAX = 448.0
E5M2_MAX = 57344.0
E2M1_MAX = 6.0
MX_BLOCK = 32
NV_BLOCK = 16
INT4_GROUP = 32
# Half the step beyond each element type's largest magnitude: a scaled value past fmax by more than
# this would round to a larger value than the format holds, so saturation changed it ("clipped").
# A value within it rounds to fmax anyway (and a per-tensor amax / fmax scale can leave the largest
# value a rounding error above fmax).
_HALF_STEP = {E4M3_MAX: 16.0, E5M2_MAX: 4096.0, E2M1_MAX: 1.0, 127.0: 0.5, 7.0: 0.5}
_FP8 = {"fp8_e4m3": (torch.float8_e4m3fn, E4M3_MAX), "fp8_e5m2": (torch.float8_e5m2, E5M2_MAX)}


def check_formats(names: Iterable[str]) -> list[str]:
    """The names, in order and without repeats, or an InputError listing the known ones."""
    out: list[str] = []
    for raw in names:
        name = raw.strip().lower()
        if not name:
            continue
        if name not in FORMATS:
            raise InputError(f"unknown format {raw!r}; known formats: {', '.join(FORMATS)}")
        if name not in out:
            out.append(name)
    return out


def quantize(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x quantized to `fmt` and back, in float32 with x's shape; non-finite values unchanged."""
    check_formats([fmt])
    x32 = x.detach().float()
    finite = torch.isfinite(x32)
    all_finite = bool(finite.all())
    clean = x32 if all_finite else torch.where(finite, x32, torch.zeros((), dtype=x32.dtype))
    q, _ = _quantize(clean, fmt.strip().lower())
    return q if all_finite else torch.where(finite, q, x32)


def format_error(x: torch.Tensor, fmt: str) -> dict[str, float | None]:
    """`rel_rmse`, `sqnr_db`, `underflow` and `clipped` of quantizing x in `fmt`."""
    return format_errors(x, [fmt])[fmt.strip().lower()]


def format_errors(x: torch.Tensor, formats: Iterable[str]) -> dict[str, dict[str, float | None]]:
    """The error figures of each format, x read into float32 once for all of them.

    rel_rmse = ||Q(x) - x|| / ||x||; sqnr_db = -20 log10(rel_rmse) (None when Q is exact);
    underflow = share of the non-zero values Q maps to zero; clipped = share of the non-zero values
    that saturate: beyond the format's largest magnitude after scaling by more than half a step, so
    that rounding without saturation would have given a larger value.
    """
    names = check_formats(formats)
    x32 = x.detach().float()
    finite = torch.isfinite(x32)
    if not bool(finite.all()):
        x32 = torch.where(finite, x32, torch.zeros((), dtype=x32.dtype))
    nonzero = x32 != 0
    count = int(nonzero.sum())
    norm = float(torch.linalg.vector_norm(x32))
    out: dict[str, dict[str, float | None]] = {}
    for name in names:
        q, clipped = _quantize(x32, name)
        err = float(torch.linalg.vector_norm(q - x32))
        under = int(((q == 0) & nonzero).sum()) if count else 0
        out[name] = _figures(err, norm, under, int(clipped), count)
    return out


def _figures(err: float, norm: float, under: int, clipped: int, count: int) -> dict[str, Any]:
    rel = err / norm if norm > 0 else 0.0
    return {
        "rel_rmse": rel,
        "sqnr_db": -20.0 * math.log10(rel) if rel > 0 else None,
        "underflow": under / count if count else 0.0,
        "clipped": clipped / count if count else 0.0,
    }


def _quantize(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q(x), how many values saturated) for a finite float32 x."""
    if fmt in _FP8:
        dtype, fmax = _FP8[fmt]
        return _per_tensor(x, fmax, lambda v: v.to(dtype).float())
    if fmt == "int8":
        return _per_tensor(x, 127.0, torch.round)
    if fmt == "int4":
        return _blocked(x, INT4_GROUP, lambda b: _scaled(b, _amax(b) / 7.0, 7.0, torch.round))
    if fmt == "mxfp8":
        return _blocked(x, MX_BLOCK, lambda b: _mx(b, 8, E4M3_MAX, _to_e4m3))
    if fmt == "mxfp4":
        return _blocked(x, MX_BLOCK, lambda b: _mx(b, 2, E2M1_MAX, round_e2m1))
    return _nvfp4(x)


def _per_tensor(x: torch.Tensor, fmax: float, cast: Any) -> tuple[torch.Tensor, torch.Tensor]:
    amax = x.abs().max() if x.numel() else torch.zeros(())
    return _scaled(x, amax / fmax, fmax, cast)


def _scaled(
    x: torch.Tensor, scale: torch.Tensor, fmax: float, cast: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """cast(x / scale) * scale, saturated at +-fmax; a zero scale (all-zero x) quantizes to 0."""
    safe = torch.where(scale > 0, scale, torch.ones((), dtype=scale.dtype))
    v = x / safe
    clipped = (v.abs() > fmax + _HALF_STEP[fmax]).sum()
    q = cast(v.clamp(-fmax, fmax)) * safe
    return torch.where(scale > 0, q, torch.zeros((), dtype=q.dtype)), clipped


def _amax(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.abs().amax(dim=-1, keepdim=True)


def _blocked(x: torch.Tensor, size: int, fn: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """fn over blocks of `size` along the last dimension (the last block zero-padded)."""
    if x.numel() == 0:
        return x.clone(), torch.zeros((), dtype=torch.int64)
    last = x.shape[-1] if x.dim() else 1
    rows = x.reshape(-1, last)
    pad = -last % size
    if pad:
        rows = torch.nn.functional.pad(rows, (0, pad))
    q, clipped = fn(rows.reshape(-1, size))
    q = q.reshape(rows.shape)[:, :last]
    return q.reshape(x.shape), clipped


def _to_e4m3(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.float8_e4m3fn).float()


def round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """v (within +-6) rounded to nearest even on the E2M1 grid 0, 0.5, 1, 1.5, 2, 3, 4, 6."""
    a = v.abs()
    # The grid's step is 0.5 below 2, 1 in [2, 4) and 2 from 4: rounding a / step half to even
    # is round-to-nearest-even on the grid (an even multiple of the step has mantissa bit 0).
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    return torch.copysign(torch.round(a / step) * step, v)


def _mx(
    blocks: torch.Tensor, emax: int, fmax: float, cast: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MX: the shared E8M0 scale 2^(floor(log2 amax) - emax), then the elements cast."""
    amax = _amax(blocks)
    _, exp = torch.frexp(amax)  # amax = m * 2^exp with m in [0.5, 1): floor(log2 amax) = exp - 1
    shared = (exp - 1 - emax).clamp(-127, 127)
    scale = torch.where(amax > 0, torch.ldexp(torch.ones_like(amax), shared), 0.0)
    return _scaled(blocks, scale, fmax, cast)


def _nvfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    amax = x.abs().max() if x.numel() else torch.zeros(())
    g = amax / (E4M3_MAX * E2M1_MAX)
    safe_g = torch.where(g > 0, g, torch.ones(()))

    def blocks_fn(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        block_scale = _to_e4m3((_amax(b) / (E2M1_MAX * safe_g)).clamp(max=E4M3_MAX))
        return _scaled(b, block_scale * safe_g, E2M1_MAX, round_e2m1)

    return _blocked(x, NV_BLOCK, blocks_fn)
