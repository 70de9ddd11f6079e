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
import threading
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
# A value within it rounds to fmax anyway. Per-tensor amax / fmax scaling (fp8, int8) and int4's
# amax / 7 never clip; MX's power-of-two scale and nvfp4's rounded E4M3 scale can.
_HALF_STEP = {E4M3_MAX: 16.0, E5M2_MAX: 4096.0, E2M1_MAX: 1.0}
# Element types as (mantissa bits, smallest normal exponent, largest magnitude).
E4M3 = (3, -6, E4M3_MAX)
E5M2 = (2, -14, E5M2_MAX)
E2M1 = (1, 0, E2M1_MAX)
_FP8 = {"fp8_e4m3": E4M3, "fp8_e5m2": E5M2}


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
    (name,) = check_formats([fmt])
    x32 = x.detach().float()
    finite = torch.isfinite(x32)
    all_finite = bool(finite.all())
    clean = x32 if all_finite else torch.where(finite, x32, torch.zeros((), dtype=x32.dtype))
    if clean.numel() == 0:
        return clean.clone()
    q, _, _ = _quantize(_Work(clean), name)
    q = _unblock(q, clean).clone()
    return q if all_finite else torch.where(finite, q, x32)


def format_error(x: torch.Tensor, fmt: str) -> dict[str, float | None]:
    """`rel_rmse`, `sqnr_db`, `underflow` and `clipped` of quantizing x in `fmt`."""
    (name,) = check_formats([fmt])
    return format_errors(x, [name])[name]


def format_errors(
    x: torch.Tensor, formats: Iterable[str], *, finite: bool | None = None
) -> dict[str, dict[str, float | None]]:
    """The error figures of each format, x read into float32 once for all of them.

    rel_rmse = ||Q(x) - x|| / ||x||; sqnr_db = -20 log10(rel_rmse) (None when Q is exact);
    underflow = share of the non-zero values Q maps to zero; clipped = share of the non-zero values
    that saturate: beyond the format's largest magnitude after scaling by more than half a step, so
    that rounding without saturation would have given a larger value. `finite=True`: the caller
    knows x holds no NaN or Inf (its statistics counted them), which saves a pass.
    """
    names = check_formats(formats)
    x32 = x.detach().float()
    if not finite:
        mask = torch.isfinite(x32)
        if not bool(mask.all()):
            x32 = torch.where(mask, x32, torch.zeros((), dtype=x32.dtype))
    if x32.numel() == 0:
        return {name: _figures(0.0, 0.0, 0, 0, 0) for name in names}
    work = _Work(x32)
    count = x32.numel() - _zeros(work, x32)
    norm = float(torch.linalg.vector_norm(x32))
    out: dict[str, dict[str, float | None]] = {}
    for name in names:
        q, xs, clipped = _quantize(work, name)
        under = _zeros(work, q) - (q.numel() - count)  # Q(0) is 0; padding counts as zeros
        err = float(torch.linalg.vector_norm(q.sub_(xs)))
        out[name] = _figures(err, norm, under, clipped, count)
    return out


def _figures(err: float, norm: float, under: int, clipped: int, count: int) -> dict[str, Any]:
    rel = err / norm if norm > 0 else 0.0
    return {
        "rel_rmse": rel,
        "sqnr_db": -20.0 * math.log10(rel) if rel > 0 else None,
        "underflow": under / count if count else 0.0,
        "clipped": clipped / count if count else 0.0,
    }


class _Work:
    """A tensor's float32 values and the buffers every format reuses: each pass over the values
    writes into them in place (allocating a tensor-sized result costs more than computing it)."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x
        self._blocks: dict[int, torch.Tensor] = {}
        self._block_amax: dict[int, torch.Tensor] = {}
        self._amax: float | None = None

    @property
    def amax(self) -> float:
        if self._amax is None:
            self._amax = max(float(self.x.max()), -float(self.x.min()))
        return self._amax

    def block_amax(self, size: int) -> torch.Tensor:
        if size not in self._block_amax:
            self._block_amax[size] = _amax(self.blocks(size))
        return self._block_amax[size]

    def blocks(self, size: int) -> torch.Tensor:
        """x as rows of `size` along its last dimension (the last block zero-padded)."""
        if size not in self._blocks:
            self._blocks[size] = _blocks(self.x, size)
        return self._blocks[size]

    def values(self, like: torch.Tensor) -> torch.Tensor:
        return self._buffer("_values", like, torch.float32)

    def bits(self, like: torch.Tensor) -> torch.Tensor:
        return self._buffer("_bits", like, torch.int32)

    def flags(self, like: torch.Tensor) -> torch.Tensor:
        return self._buffer("_flags", like, torch.bool)

    def _buffer(self, name: str, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # Kept per thread and device from one tensor to the next: a fresh tensor-sized buffer
        # costs its page faults every time.
        key = (name, like.device)
        buffers = _BUFFERS.__dict__.setdefault("buffers", {})
        buffer = buffers.get(key)
        if buffer is None or buffer.numel() < like.numel():
            buffer = torch.empty(like.numel(), dtype=dtype, device=like.device)
            buffers[key] = buffer
        return buffer[: like.numel()].view(like.shape)


_BUFFERS = threading.local()


def _zeros(work: _Work, v: torch.Tensor) -> int:
    # Summed as bytes into int32 where that can't overflow: a bool tensor's sum first copies it
    # to int64, and a byte sum into int64 is slower still.
    wide = torch.int64 if v.numel() >= 1 << 31 else torch.int32
    return int(torch.eq(v, 0, out=work.flags(v)).view(torch.uint8).sum(dtype=wide))


def _quantize(work: _Work, fmt: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(Q(x) in a work buffer, x in the same layout, how many values saturated) for a finite,
    non-empty float32 x; a block format's layout is its blocks (`_unblock` gives x's shape)."""
    x = work.x
    if fmt in _FP8:
        element = _FP8[fmt]
        return _per_tensor(work, element[2], lambda v: round_float_(v, element, work)), x, 0
    if fmt == "int8":
        return _per_tensor(work, 127.0, torch.Tensor.round_), x, 0
    blocks = work.blocks(NV_BLOCK if fmt == "nvfp4" else MX_BLOCK)
    if fmt == "int4":
        scale = work.block_amax(MX_BLOCK) / 7.0
        return _scaled(work, blocks, scale, 7.0, torch.Tensor.round_), blocks, 0
    if fmt == "nvfp4":
        q, clipped = _nvfp4(work, blocks)
        return q, blocks, clipped
    q, clipped = _mx(work, blocks, 8 if fmt == "mxfp8" else 2, E4M3 if fmt == "mxfp8" else E2M1)
    return q, blocks, clipped


def round_float_(
    v: torch.Tensor, element: tuple[int, int, float], work: _Work | None = None
) -> torch.Tensor:
    """v (float32, within the element type's range) rounded in place to nearest even on the grid
    of a float type with `mantissa` bits and smallest normal exponent `emin`.

    The grid's step at v is 2^(max(exponent of v, emin) - mantissa), read from v's exponent bits;
    v / step is exact (a power of two), and rounding it half to even picks the even mantissa.
    """
    mantissa, emin, _ = element
    out = torch.empty(v.shape, dtype=torch.int32, device=v.device) if work is None else work.bits(v)
    bits = torch.bitwise_and(v.view(torch.int32), 0x7F800000, out=out)
    step = bits.clamp_(min=(emin + 127) << 23).sub_(mantissa << 23).view(torch.float32)
    return v.div_(step).round_().mul_(step)


def round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """v (within +-6) rounded to nearest even on the E2M1 grid 0, 0.5, 1, 1.5, 2, 3, 4, 6."""
    return round_float_(v.float().clone(), E2M1)


def _per_tensor(work: _Work, fmax: float, cast: Any) -> torch.Tensor:
    x, amax = work.x, work.amax
    if amax == 0:
        return work.values(x).zero_()
    scale = torch.tensor(amax, dtype=torch.float32) / fmax  # the float32 scale the recipe stores
    return _scaled(work, x, scale.to(x.device), fmax, cast)


def _scaled(
    work: _Work, x: torch.Tensor, scale: torch.Tensor, fmax: float, cast: Any
) -> torch.Tensor:
    """cast(x / scale) * scale, saturated at +-fmax, in the work buffer; a zero scale (an
    all-zero block) leaves zeros."""
    safe = torch.where(scale > 0, scale, torch.ones((), dtype=scale.dtype, device=scale.device))
    v = torch.div(x, safe, out=work.values(x))
    return cast(v.clamp_(-fmax, fmax)).mul_(safe)


def _amax(blocks: torch.Tensor) -> torch.Tensor:
    return torch.maximum(blocks.amax(dim=-1, keepdim=True), -blocks.amin(dim=-1, keepdim=True))


def _blocks(x: torch.Tensor, size: int) -> torch.Tensor:
    last = x.shape[-1] if x.dim() else 1
    rows = x.reshape(-1, last)
    pad = -last % size
    if pad:
        rows = torch.nn.functional.pad(rows, (0, pad))
    return rows.reshape(-1, size)


def _unblock(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """q, in x's layout or in blocks of x (`_blocks`), shaped as x."""
    if q.shape == x.shape:
        return q
    last = x.shape[-1] if x.dim() else 1
    q = q.reshape(-1, last + (-last % q.shape[-1]))
    return (q[:, :last] if q.shape[1] != last else q).reshape(x.shape)


def _clipped(blocks: torch.Tensor, amax: torch.Tensor, scale: torch.Tensor, fmax: float) -> int:
    """Values beyond fmax + half a step after scaling: looked for only in the blocks whose
    largest value is."""
    limit = fmax + _HALF_STEP[fmax]
    over = (amax > limit * scale).reshape(-1)
    if not bool(over.any()):
        return 0
    return int(torch.count_nonzero(blocks[over].abs() > limit * scale[over]))


def _mx(
    work: _Work, blocks: torch.Tensor, emax: int, element: tuple[int, int, float]
) -> tuple[torch.Tensor, int]:
    """OCP MX: the shared E8M0 scale 2^(floor(log2 amax) - emax), then the elements rounded."""
    amax = work.block_amax(blocks.shape[-1])
    _, exp = torch.frexp(amax)  # amax = m * 2^exp with m in [0.5, 1): floor(log2 amax) = exp - 1
    shared = (exp - 1 - emax).clamp(-127, 127)
    scale = torch.where(amax > 0, torch.ldexp(torch.ones_like(amax), shared), 0.0)
    fmax = element[2]
    q = _scaled(work, blocks, scale, fmax, lambda v: round_float_(v, element, work))
    return q, _clipped(blocks, amax, scale, fmax)


def _nvfp4(work: _Work, blocks: torch.Tensor) -> tuple[torch.Tensor, int]:
    x, amax = work.x, work.amax
    if amax == 0:
        return work.values(blocks).zero_(), 0
    g = (torch.tensor(amax, dtype=torch.float32) / (E4M3_MAX * E2M1_MAX)).to(x.device)
    block_amax = work.block_amax(NV_BLOCK)
    block_scale = round_float_((block_amax / (E2M1_MAX * g)).clamp_(max=E4M3_MAX), E4M3)
    scale = block_scale * g
    q = _scaled(work, blocks, scale, E2M1_MAX, lambda v: round_float_(v, E2M1, work))
    if not bool((scale > 0).all()):  # an E4M3 scale of 0 (a block far below amax) decodes to 0
        q.mul_(scale > 0)
    return q, _clipped(blocks, block_amax, scale, E2M1_MAX)
