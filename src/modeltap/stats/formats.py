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
against its own values.

How it is computed, since `dump --formats` runs it on every tensor: the values are taken in
chunks that stay in the CPU's caches (one chunk per 2^24 values on other devices), each chunk
read once for what the formats share (|x|, exponents, block maxima, zeros, norm); each format then
costs a few in-place passes over one scratch buffer, and a float's rounding is the magic-number
add and subtract (no division, no `round`). The partial sums of every chunk and format come to
the host in one transfer.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

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
_BLOCKED = ("mxfp8", "mxfp4", "nvfp4", "int4")
# torch's float8 casts round to nearest even as `round_float_` does (tests/test_formats.py)
_CASTS = {E4M3: torch.float8_e4m3fn, E5M2: torch.float8_e5m2}

# Values of a chunk per CPU thread: a chunk's few buffers stay in each core's cache from one pass
# to the next (passes over a tensor of 3 MB and more ran at half the speed or less).
_PER_THREAD = 1 << 17
# The most values a chunk holds anywhere: counts are summed as float32 0/1 flags, exact below 2^24.
_MOST = 1 << 24
_EXPONENT = 0x7F800000  # a float32's exponent bits: as a float, 2^floor(log2 |v|) (0 if subnormal)


def _on_host(device: torch.device) -> bool:
    """Whether values on `device` are worked on as on the CPU: amax looked at (no device to
    wait for), cache-sized chunks, each format reduced at once, roundings by arithmetic. Other
    devices: no wait, one chunk, the formats' rows reduced together, torch's float8 casts."""
    return device.type == "cpu"


def _wide(device: torch.device) -> torch.dtype:
    """The dtype sums are taken in: float64, but where a device lacks it (Apple's MPS)."""
    return torch.float32 if device.type == "mps" else torch.float64


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
    values = _Values(clean, [name])
    q = torch.zeros(values.flat.numel(), dtype=torch.float32, device=clean.device)
    if values.amax != 0:  # (None: on a device, not looked at)
        for chunk in values.chunks():
            rounded = _QUANTIZE[name](chunk, values, q[chunk.start : chunk.start + chunk.x.numel()])
            rounded.values.mul_(rounded.scale)
    q = values.unpad(q)
    return q if all_finite else torch.where(finite, q, x32)


def format_error(x: torch.Tensor, fmt: str) -> dict[str, float | None]:
    """`rel_rmse`, `sqnr_db`, `underflow` and `clipped` of quantizing x in `fmt`."""
    (name,) = check_formats([fmt])
    return format_errors(x, [name])[name]


def format_errors(
    x: torch.Tensor, formats: Iterable[str], *, finite: bool | None = None
) -> dict[str, dict[str, float | None]]:
    """The error figures of each format, x read in chunks once for all of them.

    rel_rmse = ||Q(x) - x|| / ||x||; sqnr_db = -20 log10(rel_rmse) (None when Q is exact);
    underflow = share of the non-zero values Q maps to zero; clipped = share of the non-zero values
    that saturate: beyond the format's largest magnitude after scaling by more than half a step, so
    that rounding without saturation would have given a larger value. `finite=True`: the caller
    knows x holds no NaN or Inf (its statistics counted them), which saves a pass.
    """
    return begin_format_errors(x, formats, finite=finite).result()


@dataclass
class PendingFormats:
    """`format_errors` whose partial sums may still be on the tensor's device (`parts`, one
    float64 vector): `result()` brings them over in one transfer, or takes them as a list from a
    caller that copied them behind a CUDA event (dump/pipeline.py), so queuing costs no wait."""

    names: list[str]
    keys: list[Any] = field(default_factory=list)
    parts: torch.Tensor | None = None
    numel: int = 0

    def result(self, values: list[float] | None = None) -> dict[str, dict[str, float | None]]:
        if self.parts is None:  # empty or all zeros: Q is exact
            return {name: _figures(0.0, 0.0, 0, 0, 0) for name in self.names}
        total: dict[Any, float] = {}
        values = self.parts.tolist() if values is None else values
        for key, value in zip(self.keys, values, strict=True):
            total[key] = total.get(key, 0.0) + (value * value if value < 0 else value)
        zeros, norm = round(total["zeros"]), math.sqrt(total["norm"])
        count = self.numel - zeros
        out: dict[str, dict[str, float | None]] = {}
        for name in self.names:
            under = round(total[name, "zeros"]) - zeros  # Q(0) is 0; padding counts as zeros
            clipped = round(total.get((name, "clipped"), 0.0))
            out[name] = _figures(math.sqrt(total[name, "error"]), norm, under, clipped, count)
        return out


def begin_format_errors(
    x: torch.Tensor, formats: Iterable[str], *, finite: bool | None = None
) -> PendingFormats:
    """Queue `format_errors`' work; `.result()` finishes it. On the CPU it is done at once; on a
    device nothing waits for the device (NaN and Inf are zeroed without looking for them)."""
    names = check_formats(formats)
    x = x.detach()
    if not finite and not _on_host(x.device):  # one kernel, and no asking
        x = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
    elif not finite:
        mask = torch.isfinite(x)
        if not bool(mask.all()):
            x = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
    values = _Values(x, names) if x.numel() else None
    if values is None or values.amax == 0:  # empty or all zeros: Q is exact
        return PendingFormats(names)
    sums = _Sums()
    stacked = not _on_host(values.device)  # a row a format, reduced at once: fewer launches
    # On the CPU each format's Q is reduced while in cache: its zeros counted before the last
    # multiplication (which only a float32-subnormal amax could round to 0), and Q - x with it
    fused = not stacked and values.amax is not None and values.amax >= 2.0**-100
    for chunk in values.chunks():
        sums.add(["zeros"], chunk.zeros(chunk.x))
        sums.add(["norm"], chunk.squares(chunk.x))
        rows = chunk.scratch("q", rows=len(names) if stacked else 1)
        for i, name in enumerate(names):
            rounded = _QUANTIZE[name](chunk, values, rows[i if stacked else 0])
            if rounded.clipped is not None:
                sums.add([(name, "clipped")], rounded.clipped.view(1))
            if fused:
                _reduce_rounded(chunk, rounded, name, sums)
                continue
            rounded.values.mul_(rounded.scale)
            if not stacked:
                _reduce(chunk, rows, [name], sums)
        if stacked:
            _reduce(chunk, rows, names, sums)
    return PendingFormats(names, sums.keys, sums.gathered(), values.flat.numel())


def _reduce(chunk: _Chunk, q: torch.Tensor, names: list[str], sums: _Sums) -> None:
    """Each row's zeros and squared distance to the chunk's values (Q(x) - x in place)."""
    sums.add([(name, "zeros") for name in names], chunk.zeros(q))
    sums.add([(name, "error") for name in names], chunk.squares(q.sub_(chunk.x)))


def _reduce_rounded(chunk: _Chunk, rounded: _Rounded, name: str, sums: _Sums) -> None:
    """`_reduce` of one format's Q from `_Rounded`, its zeros counted before the product."""
    values = rounded.values
    sums.add([(name, "zeros")], chunk.zeros(values))
    x = chunk.x.view(values.shape)
    if rounded.exact:  # a power-of-two scale: x - values * scale in one pass, as exact
        error = torch.addcmul(x, values, rounded.scale, value=-1, out=values)
    else:  # else Q's own float32 rounding first (addcmul may fuse the two)
        error = values.mul_(rounded.scale).sub_(x)
    sums.add([(name, "error")], chunk.squares(error))


def _figures(err: float, norm: float, under: int, clipped: int, count: int) -> dict[str, Any]:
    rel = err / norm if norm > 0 else 0.0
    return {
        "rel_rmse": rel,
        "sqnr_db": -20.0 * math.log10(rel) if rel > 0 else None,
        "underflow": under / count if count else 0.0,
        "clipped": clipped / count if count else 0.0,
    }


class _Sums:
    """Partial sums (squares and counts) as tensors on the device, brought to the host in one
    transfer and added there in float64. A negative part is minus a norm: its square counts."""

    def __init__(self) -> None:
        self.keys: list[Any] = []
        self.parts: list[torch.Tensor] = []

    def add(self, keys: list[Any], part: torch.Tensor) -> None:
        """`part`: one value a key, 1-D."""
        self.keys.extend(keys)
        self.parts.append(part)  # float32 or float64: cat widens them all

    def gathered(self) -> torch.Tensor:
        """Every part in one float64 vector, still where they were computed."""
        return torch.cat(self.parts).double()


class _Values:
    """A finite tensor laid out for the formats: flat, rows zero-padded to a multiple of 32 when
    a block format is asked for, and its largest magnitude: on the CPU as a float too (one pass),
    elsewhere only on the device (no wait for it)."""

    def __init__(self, x: torch.Tensor, names: list[str]) -> None:
        if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            x = x.float()  # float64 rounded to float32 first, as the recipes say
        self.shape, self.device = x.shape, x.device
        self.last = x.shape[-1] if x.dim() else 1
        rows = x.reshape(-1, self.last)
        self.pad = -self.last % MX_BLOCK if any(n in _BLOCKED for n in names) else 0
        if self.pad:
            rows = torch.nn.functional.pad(rows, (0, self.pad))
        self.flat = rows.reshape(-1)
        self.amax: float | None = None
        if _on_host(self.device):  # where aminmax is the fast pass, and looking costs no wait
            lo, hi = torch.aminmax(self.flat)
            self.amax = max(float(hi), -float(lo))
            self.amax_t = torch.tensor(self.amax, dtype=torch.float32)
        else:  # one reduction, no wait
            self.amax_t = torch.linalg.vector_norm(self.flat, ord=math.inf).float()
        self.nvfp4 = "nvfp4" in names
        # squares summed in float64 where float32 ones could overflow or underflow (or on a
        # device, where amax isn't looked at)
        self.wide = self.amax is None or not 2.0**-40 <= self.amax <= 2.0**60
        self._scales: dict[Any, tuple[torch.Tensor, bool]] = {}

    def chunks(self) -> Iterator[_Chunk]:
        per = _MOST
        if _on_host(self.device):
            per = min(_MOST, _PER_THREAD * max(1, torch.get_num_threads()))
        total = self.flat.numel()
        for start in range(0, total, per):
            part = self.flat[start : start + per]
            if part.dtype != torch.float32:
                part = _buffer("x", part.numel(), torch.float32, part.device).copy_(part)
            yield _Chunk(part, start, self.nvfp4, self.wide)

    def scale(self, fmax: float) -> tuple[torch.Tensor, bool]:
        """(s = amax / fmax, 1 where s is 0; whether x / s can exceed fmax: where s is subnormal,
        and on a device, where amax isn't looked at. Else x / s <= fmax (1 + 2^-23) rounds to
        fmax on any grid.)"""
        if fmax not in self._scales:
            s = self.amax_t / fmax
            unsafe = self.amax is None or float(s) < 2.0**-126
            self._scales[fmax] = (torch.where(s > 0, s, 1.0), unsafe)
        return self._scales[fmax]

    def nvfp4_scale(self) -> torch.Tensor:
        """nvfp4's per-tensor g = amax / (448 * 6) (1 where that is 0: all blocks then decode
        to 0, as their E4M3 scales are 0)."""
        if "nvfp4" not in self._scales:
            g = self.amax_t / (E4M3_MAX * E2M1_MAX)
            self._scales["nvfp4"] = (torch.where(g > 0, g, 1.0), False)
        return self._scales["nvfp4"][0]

    def unpad(self, q: torch.Tensor) -> torch.Tensor:
        q = q.view(-1, self.last + self.pad)
        return (q[:, : self.last] if self.pad else q).reshape(self.shape)


class _Chunk:
    """A chunk of the values (float32, whole blocks) and what several formats read from it."""

    def __init__(self, x: torch.Tensor, start: int, nvfp4: bool, wide: bool) -> None:
        self.x, self.start, self.nvfp4, self.wide = x, start, nvfp4, wide
        self.n = x.numel()
        self._abs: torch.Tensor | None = None
        self._amax: dict[int, torch.Tensor] = {}
        self._scratch: dict[Any, torch.Tensor] = {}

    def scratch(
        self, name: str, dtype: torch.dtype = torch.float32, rows: int | None = None
    ) -> torch.Tensor:
        """A reused buffer the size of the chunk (`rows` of it: shaped (rows, chunk))."""
        key = (name, rows)
        if key not in self._scratch:
            buffer = _buffer(name, (rows or 1) * self.n, dtype, self.x.device)
            self._scratch[key] = buffer if rows is None else buffer.view(rows, self.n)
        return self._scratch[key]

    def abs(self) -> torch.Tensor:
        if self._abs is None:
            self._abs = torch.abs(self.x, out=self.scratch("abs"))
        return self._abs

    def block_amax(self, size: int) -> torch.Tensor:
        """The largest magnitude of each block of `size`, shaped (blocks, 1)."""
        if size not in self._amax:
            if size == MX_BLOCK and self.nvfp4:  # two blocks of 16 make one of 32
                amax = self.block_amax(NV_BLOCK).view(-1, 2).amax(-1)
            elif size == NV_BLOCK:  # a pooling, where amax over rows of 16 is slow on CPU
                amax = torch.nn.functional.max_pool1d(self.abs().view(1, -1), size, size)
            else:
                amax = self.abs().view(-1, size).amax(-1)
            self._amax[size] = amax.view(-1, 1)
        return self._amax[size]

    def zeros(self, v: torch.Tensor) -> torch.Tensor:
        """How many of v (of each row of v) are 0, 1-D: a float32 sum of 0/1 flags, which is
        faster than count_nonzero on the CPU."""
        rows = v.numel() // self.n
        if rows == 1:
            return torch.eq(v, 0, out=self.flags().view(v.shape)).sum().view(1)
        return torch.eq(v, 0, out=self.scratch("flags", rows=rows)).sum(-1)

    def squares(self, v: torch.Tensor) -> torch.Tensor:
        """The sum of squares of v (of each row of a 2-D v), 1-D: in float32 (a dot product,
        the fastest on the CPU) where they can't overflow, else in float64 as minus the norm
        (squared on the host, `_Sums`: a launch less)."""
        if not self.wide and v.numel() == self.n:
            flat = v.view(-1)
            return torch.dot(flat, flat).view(1)
        rows = v.view(-1, self.n)
        return torch.linalg.vector_norm(rows, dim=-1, dtype=_wide(v.device)).neg_()

    def bits(self) -> torch.Tensor:
        """An int32 buffer of the chunk's size, for the rounding."""
        return self.scratch("bits", torch.int32)

    def flags(self) -> torch.Tensor:
        """A float32 buffer of the chunk's size: the rounding's int32 one (free between uses),
        one buffer less in the cache."""
        return self.bits().view(torch.float32)

    def over(self, amax: torch.Tensor, limit: torch.Tensor, *, rare: bool) -> torch.Tensor | None:
        """How many values of the chunk exceed their block's `limit` in magnitude. `rare`: first
        look at the blocks' maxima (on the CPU, where that costs no wait) for a block that does:
        None where none does."""
        if rare and _on_host(self.x.device) and not bool((amax > limit).any()):
            return None
        flags = self.flags().view(amax.shape[0], -1)
        return torch.gt(self.abs().view(flags.shape), limit, out=flags).sum()


def _buffer(name: str, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Kept per thread and device from one chunk and tensor to the next: a fresh buffer costs its
    # page faults every time.
    buffers = _BUFFERS.__dict__.setdefault("buffers", {})
    key = (name, dtype, device)
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < n:
        buffer = torch.empty(n, dtype=dtype, device=device)
        buffers[key] = buffer
    return buffer[:n]


_BUFFERS = threading.local()


def round_float_(
    v: torch.Tensor, element: tuple[int, int, float], bits: torch.Tensor | None = None
) -> torch.Tensor:
    """v (float32, within the element type's range) rounded in place to nearest even on the grid
    of a float type with `mantissa` bits and smallest normal exponent `emin`.

    The grid's step at v is 2^(max(exponent of v, emin) - mantissa), read from v's exponent bits.
    Adding C = 1.5 * 2^23 * step lands v + C where float32's own step is the grid's, so the
    addition rounds v half to even on the grid, and subtracting C again is exact. (`bits`: an
    int32 scratch tensor of v's size.)
    """
    mantissa, emin, _ = element
    if not _on_host(v.device) and element in _CASTS:  # a device's cast is cheaper: the same bits
        return v.copy_(v.to(_CASTS[element]))
    out = torch.empty_like(v, dtype=torch.int32) if bits is None else bits
    step = torch.bitwise_and(v.view(torch.int32), _EXPONENT, out=out).view(torch.float32)
    step.clamp_(min=2.0**emin)
    magic = 1.5 * 2.0 ** (23 - mantissa)
    return v.add_(step, alpha=magic).sub_(step, alpha=magic)


class _Rounded(NamedTuple):
    """A format's Q(x) but for its last multiplication: `values` (the chunk's work buffer, shaped
    as `scale` broadcasts over it) times `scale`; how many values clipped (None: none)."""

    values: torch.Tensor
    scale: torch.Tensor
    clipped: torch.Tensor | None = None
    exact: bool = False  # the scale is a power of two: values * scale rounds nothing


def _per_tensor(element: tuple[int, int, float] | None, fmax: float) -> _Quantizer:
    """fp8 (a float `element`) or int8 (None): x / s rounded and saturated."""

    def run(chunk: _Chunk, values: _Values, out: torch.Tensor) -> _Rounded:
        scale, unsafe = values.scale(fmax)
        v = torch.div(chunk.x, scale, out=out)
        if unsafe:
            v.clamp_(-fmax, fmax)
        if element is None:
            v.round_()
        else:
            round_float_(v, element, chunk.bits())
        return _Rounded(v, scale)

    return run


def _mx(emax: int, element: tuple[int, int, float]) -> _Quantizer:
    """OCP MX: the shared E8M0 scale 2^(floor(log2 amax) - emax), then the elements rounded."""

    def run(chunk: _Chunk, values: _Values, out: torch.Tensor) -> _Rounded:
        # 2^(floor(log2 amax) - emax) from amax's exponent bits, at least 2^-127 (E8M0's least);
        # an all-zero block gets 2^-127 too, which leaves its zeros zero
        amax = chunk.block_amax(MX_BLOCK)
        bits = torch.bitwise_and(amax.view(torch.int32), _EXPONENT)
        scale = bits.view(torch.float32).mul_(2.0**-emax).clamp_(min=2.0**-127)
        fmax = element[2]
        # x * 2^-k is x / 2^k to the bit, and the cheaper pass
        v = _scaled(chunk, MX_BLOCK, out, torch.reciprocal(scale), fmax, element)
        clipped = chunk.over(amax, scale * (fmax + _HALF_STEP[fmax]), rare=False)  # clips often
        return _Rounded(v, scale, clipped, exact=True)

    return run


def _nvfp4(chunk: _Chunk, values: _Values, out: torch.Tensor) -> _Rounded:
    g = values.nvfp4_scale()
    amax = chunk.block_amax(NV_BLOCK)
    scale = round_float_((amax / (E2M1_MAX * g)).clamp_(max=E4M3_MAX), E4M3).mul_(g)
    # an E4M3 scale of 0 decodes its block to 0: x / inf is 0, and 0 * 0 too
    v = _scaled(
        chunk, NV_BLOCK, out, torch.where(scale > 0, scale, math.inf), E2M1_MAX, E2M1, divide=True
    )
    # such a block's values count as clipped beyond 7 unscaled, as the recipe's x / 1 would
    limit = torch.where(scale > 0, scale, 1.0).mul_(E2M1_MAX + _HALF_STEP[E2M1_MAX])
    return _Rounded(v, scale, chunk.over(amax, limit, rare=True))


def _int4(chunk: _Chunk, values: _Values, out: torch.Tensor) -> _Rounded:
    scale = chunk.block_amax(INT4_GROUP) / 7.0  # 0 only for an all-zero group: x / 1 is 0
    safe = torch.where(scale > 0, scale, 1.0)
    return _Rounded(_scaled(chunk, INT4_GROUP, out, safe, 7.0, None, divide=True), scale)


def _scaled(
    chunk: _Chunk,
    size: int,
    out: torch.Tensor,
    by: torch.Tensor,
    fmax: float,
    element: tuple[int, int, float] | None,
    *,
    divide: bool = False,
) -> torch.Tensor:
    """The chunk's blocks of `size` times `by` (divided by `by` where `divide`), saturated at
    +-fmax and rounded (to integers where `element` is None), in `out` shaped as the blocks."""
    blocks = chunk.x.view(-1, size)
    v = out.view(blocks.shape)
    (torch.div if divide else torch.mul)(blocks, by, out=v)
    v.clamp_(-fmax, fmax)
    if element is None:
        return v.round_()
    return round_float_(v, element, chunk.bits().view(v.shape))


_Quantizer = Callable[[_Chunk, _Values, torch.Tensor], _Rounded]
_QUANTIZE: dict[str, _Quantizer] = {
    "fp8_e4m3": _per_tensor(E4M3, E4M3_MAX),
    "fp8_e5m2": _per_tensor(E5M2, E5M2_MAX),
    "mxfp8": _mx(8, E4M3),
    "mxfp4": _mx(2, E2M1),
    "nvfp4": _nvfp4,
    "int8": _per_tensor(None, 127.0),
    "int4": _int4,
}
