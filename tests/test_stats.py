import math

import pytest
import torch

from modeltap import stats as stats_module
from modeltap.stats import tensor_stats
from tests.fixtures.histograms import reference_hist


def reference(x: torch.Tensor) -> dict[str, float]:
    d = x.double()
    finite = d[torch.isfinite(d)]
    return {
        "norm": float(finite.norm()),
        "mean": float(finite.mean()),
        "std": float(finite.std()),
        "min": float(finite.min()),
        "max": float(finite.max()),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_moments_match_float64_reference(dtype):
    torch.manual_seed(0)
    x = (torch.randn(4, 50, 96) * 3 + 1).to(dtype)
    s = tensor_stats(x)
    ref = reference(x)
    for name, value in ref.items():
        assert getattr(s, name) == pytest.approx(value, rel=1e-6), name
    assert s.shape == [4, 50, 96] and s.dtype == str(dtype).removeprefix("torch.")
    assert s.nan == 0 and s.inf == 0


def test_nan_and_inf_are_counted_and_left_out_of_moments():
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    x[0, 1] = math.nan
    x[2, 2] = math.inf
    x[1, 3] = -math.inf
    s = tensor_stats(x)
    assert (s.nan, s.inf) == (1, 2)
    ref = reference(x)
    assert s.mean == pytest.approx(ref["mean"]) and s.max == ref["max"] and s.min == ref["min"]


def test_dead_units_definition():
    x = torch.tensor([[[1.0, -1.0, 0.0, 0.5], [2.0, -3.0, 0.0, -0.5]]])  # [1, 2, 4]
    s = tensor_stats(x)
    assert (s.units, s.dead) == (4, 2)  # units 1 and 2 never exceed 0
    assert tensor_stats(x, dead_threshold=0.6).dead == 3
    assert tensor_stats(x, dead_threshold=-5.0).dead == 0


def test_padded_positions_do_not_keep_a_unit_alive():
    x = torch.tensor([[[1.0, -1.0], [-1.0, 5.0]]])  # unit 1 only alive at position 1
    mask = torch.tensor([[1, 0]], dtype=torch.bool)
    assert tensor_stats(x).dead == 0
    assert tensor_stats(x, row_mask=mask).dead == 1
    # The mask only applies to tensors shaped [batch, seq, ...].
    assert tensor_stats(x[0], row_mask=mask).dead == 0


def test_one_dim_and_empty_and_integer():
    assert tensor_stats(torch.tensor([1.0, 2.0])).dead is None
    empty = tensor_stats(torch.empty(0, 3))
    assert empty.numel == 0 and empty.norm is None
    ints = tensor_stats(torch.tensor([[1, 2], [3, 4]]))
    assert ints.mean == 2.5 and ints.norm == pytest.approx(math.sqrt(30))


def test_zero_count_on_request():
    x = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    assert tensor_stats(x, count_zeros=True).zeros == 3
    assert tensor_stats(x).zeros is None


# ---- the on-device path (issue #12): exact float64, one vector of numbers ------------------


def _exact_reference(x, mask=None, threshold=0.0):
    """float64 moments of the finite values by math.fsum (correctly rounded sums)."""
    values = [v for v in x.double().flatten().tolist() if math.isfinite(v)]
    n = len(values)
    mean = math.fsum(values) / n
    m2 = math.fsum((v - mean) ** 2 for v in values)
    rows = x.float().reshape(-1, x.shape[-1])
    if mask is not None:
        rows = rows[mask.reshape(-1)]
    alive = rows.nan_to_num(nan=-math.inf).amax(dim=0)
    return {
        "mean": mean,
        "std": math.sqrt(m2 / (n - 1)),
        "norm": math.sqrt(math.fsum(v * v for v in values)),
        "min": min(values),
        "max": max(values),
        "dead": int((alive <= threshold).sum()),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_device_path_is_exact_in_one_vector(monkeypatch, dtype):
    torch.manual_seed(3)
    x = (torch.randn(3, 40, 24) * 2 + 5).to(dtype)
    x[0, 1, 2], x[1, 5, 7], x[2, 0, 0] = math.nan, math.inf, -math.inf
    mask = torch.ones(3, 40, dtype=torch.bool)
    mask[:, 30:] = False
    monkeypatch.setattr(stats_module.device, "CHUNK_ELEMENTS", 500)  # several chunks to combine
    # The path a CUDA tensor takes, run on the CPU: kernels only, then one vector to bring over.
    pending = stats_module.device.device_stats(
        x,
        {"shape": list(x.shape), "dtype": "x", "numel": x.numel()},
        dead_threshold=5.0,
        row_mask=mask,
        count_zeros=True,
    )
    assert pending.numbers.dim() == 1 and pending.numbers.dtype == torch.float64
    s = pending.result(pending.numbers.tolist())
    ref = _exact_reference(x, mask, threshold=5.0)
    for name in ("mean", "std", "norm"):
        assert getattr(s, name) == pytest.approx(ref[name], rel=1e-12), name
    assert (s.min, s.max, s.dead) == (ref["min"], ref["max"], ref["dead"])
    assert (s.nan, s.inf, s.zeros, s.units) == (1, 2, 0, 24)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_statistics_are_exact():
    torch.manual_seed(4)
    x = torch.randn(8, 64, 96, device="cuda") * 3 + 1
    x[0, 0, 0] = math.nan
    s = tensor_stats(x, count_zeros=True)
    ref = _exact_reference(x.cpu())
    for name in ("mean", "std", "norm"):
        assert getattr(s, name) == pytest.approx(ref[name], rel=1e-12), name
    assert (s.min, s.max, s.dead, s.nan, s.inf) == (ref["min"], ref["max"], ref["dead"], 1, 0)


# ---- many small tensors at once (issue #12) -------------------------------------------------


def test_batch_of_small_tensors_is_exact_and_the_same_one_by_one():
    from modeltap.stats import batch_stats

    torch.manual_seed(5)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    tensors = [
        torch.randn(2, 6, 8) * 3 + 100,  # a large mean: a one-pass sum of squares would lose it
        torch.randn(7).to(torch.bfloat16),
        torch.relu(torch.randn(2, 6, 5) - torch.tensor([0, 9, 0, 0, 0])),  # a dead unit, zeros
        torch.randn(3, 4, dtype=torch.float64),
        torch.arange(12).reshape(3, 4),  # integers: the per-tensor path
        torch.empty(0, 3),
        torch.tensor([[1.0, math.nan], [math.inf, 2.0]]),  # NaN/Inf: the per-tensor path
        torch.randn(600, 500),  # above BATCH_ELEMENTS: the per-tensor path
    ]
    zeros = [True] * len(tensors)
    together = batch_stats(tensors, dead_threshold=0.0, row_mask=mask, count_zeros=zeros)
    for x, s in zip(tensors, together, strict=True):
        alone = tensor_stats(x, row_mask=mask, count_zeros=True)
        assert s == alone  # a tensor's numbers do not depend on its companions, to the bit
        if not x.numel():
            continue
        keep = mask if x.dim() == 3 else None
        ref = _exact_reference(x, keep)
        # A mean near 0 is as exact as the sum it comes from, whose float32 error (the per-tensor
        # path, split by torch's thread count) scales with the spread, not with the mean.
        assert s.mean == pytest.approx(ref["mean"], rel=1e-7, abs=1e-7 * ref["std"])
        for name in ("std", "norm"):
            assert getattr(s, name) == pytest.approx(ref[name], rel=1e-7), name
        assert (s.min, s.max) == (ref["min"], ref["max"])
        if x.dim() >= 2:
            assert s.dead == ref["dead"]
        assert s.zeros == int((x == 0).sum())
    assert together[2].dead > 0 and together[6].nan == 1 and together[6].inf == 1


@pytest.mark.parametrize(
    "shape",
    # (8, 50_000) and (600_000,) span 2 and 3 blocks of 2^18 elements: the blocks' moments are
    # combined around a large mean
    [(4, 7, 33), (3, 70_000), (2, 100_000), (8, 50_000), (600_000,), (50,), (), (1, 1, 1)],
    ids=str,
)
def test_final_stats_in_one_pass_match_a_float64_reference(shape):
    from modeltap.stats import final_stats

    torch.manual_seed(0)
    x = torch.randn(shape) * 3.0 + 1000.0  # a large mean: the centring must hold
    if x.dim() >= 2:
        x[..., 0] = -1.0  # one dead unit
    got = final_stats(x, count_zeros=True)
    ref = x.double()
    # within float32 rounding (the eager path's own error is of the same order)
    assert got.mean == pytest.approx(ref.mean().item(), rel=1e-7)
    if x.numel() > 1:
        assert got.std == pytest.approx(ref.std().item(), rel=1e-6)
    assert got.norm == pytest.approx(ref.norm().item(), rel=1e-7)
    assert (got.min, got.max) == (ref.min().item(), ref.max().item())
    assert (got.nan, got.inf, got.zeros, got.numel) == (0, 0, 0, x.numel())
    if x.dim() >= 2:
        assert (got.units, got.dead) == (x.shape[-1], 1)
    else:
        assert got.units is None


def test_final_stats_left_out_rows_and_what_goes_the_other_way():
    from modeltap.stats import final_stats

    torch.manual_seed(1)
    x = torch.randn(2, 40_000, 4)  # blocks of 65536 rows: the second row's kept rows cross them
    x[:, :, 1] = -1.0
    x[1, 30_000:, 1] = 5.0  # alive only in padding
    mask = torch.ones(2, 40_000, dtype=torch.long)
    mask[1, 30_000:] = 0
    got = final_stats(x, row_mask=mask)
    assert got.dead == 1 and got.max == 5.0
    for other in (x.bfloat16(), torch.tensor([1.0, math.nan, math.inf]), torch.arange(6)):
        assert final_stats(other) == tensor_stats(other)


def _hist_cases() -> list[torch.Tensor]:
    torch.manual_seed(0)
    spread = torch.randn(4, 8, 16) * torch.logspace(-8, 5, 16)  # every bin, zero to beyond 1e4
    broken = spread.clone()
    broken[0, 0, 0], broken[1, 1, 1], broken[2, 2, 2] = math.nan, math.inf, -math.inf
    large = torch.randn(700, 1000) * 50  # past BATCH_ELEMENTS: the per-tensor path
    return [spread, broken, large, large.bfloat16(), broken.half(), torch.zeros(3, 5)]


@pytest.mark.parametrize("case", range(6))
def test_histogram_counts_every_finite_value_in_its_bin_on_every_path(case):
    x = _hist_cases()[case]
    expected = reference_hist(x)
    assert len(expected) == stats_module.HIST_BINS
    assert tensor_stats(x, hist=True).hist == expected
    assert stats_module.batch_stats([torch.ones(2), x], hist=True)[1].hist == expected
    assert stats_module.final_stats(x, hist=True).hist == expected
    base = {"shape": list(x.shape), "dtype": "x", "numel": x.numel()}
    device_path = stats_module.device.device_stats(
        x, base, dead_threshold=0.0, row_mask=None, count_zeros=False, hist=True
    )
    assert device_path.result().hist == expected
    assert tensor_stats(x).hist is None  # only when asked for


def _numpy_reference(x: torch.Tensor, mask: torch.Tensor | None, threshold: float) -> dict:
    """Every field from float64 numpy over the whole tensor, written without modeltap's blocks."""
    import numpy as np

    v = x.double().numpy()
    finite = v[np.isfinite(v)]
    ref = {
        "nan": int(np.isnan(v).sum()),
        "inf": int(np.isinf(v).sum()),
        "zeros": int((v == 0).sum()),
        "mean": finite.mean(),
        "std": finite.std(ddof=1),
        "norm": float(np.sqrt(np.square(finite).sum())),
        "min": finite.min(),
        "max": finite.max(),
    }
    if x.dim() >= 2:
        rows = np.where(np.isnan(v), -np.inf, v).reshape(-1, x.shape[-1])
        if mask is not None and x.dim() >= 3:
            keep = mask.bool().numpy().reshape(*mask.shape, *([1] * (x.dim() - 3)))
            rows = rows[np.broadcast_to(keep, x.shape[:-1]).reshape(-1)]
        alive = rows.max(axis=0) if rows.shape[0] else np.full(x.shape[-1], -np.inf)
        ref["dead"] = int((alive <= threshold).sum())
    return ref


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float8_e4m3fn, torch.int64]
)
@pytest.mark.parametrize(
    "shape",
    [(5_000,), (3, 2_100), (2, 9, 150), (6, 5, 4, 40)],  # row pieces, whole rows, many blocks
    ids=str,
)
@pytest.mark.parametrize("broken", [False, True], ids=["finite", "nan-inf"])
@pytest.mark.parametrize("offset", [300.0, 0.5], ids=["far-mean", "near-zero-mean"])
def test_one_pass_blocks_match_an_independent_float64_reference(
    monkeypatch, dtype, shape, broken, offset
):
    """The CPU path reads a tensor a block at a time (here 500 elements: rows of 2,100 and 5,000
    come in pieces, narrow rows many to a block) and combines the blocks; every field must equal
    float64 numpy's over the whole tensor (moments within float32 rounding, the rest exactly)."""
    monkeypatch.setattr(stats_module.blocks, "BLOCK", 500)
    gen = torch.Generator().manual_seed(sum(shape))
    # a mean far from zero (the centring must hold) and one near it (sum(x^2) - n mean^2)
    x = torch.randn(shape, generator=gen) * 4.0 + offset
    x[x > offset + 6.0] = 0.0  # some zeros
    if len(shape) >= 2:
        x[..., 1] = -2.0  # a dead unit
    x = x.round() if dtype == torch.int64 else x
    x = x.to(dtype)
    if broken and dtype.is_floating_point:
        flat = x.view(-1)
        flat[7], flat[1_200], flat[-3] = math.nan, math.inf, -math.inf
    mask = None
    if len(shape) >= 3:
        mask = torch.ones(shape[:2], dtype=torch.long)
        mask[-1, 2:] = 0
        x[-1, 2:, ..., 3] = 1e3  # unit 3 is alive only where the mask leaves rows out
        x[:-1, ..., 3] = -1.0
        x[-1, :2, ..., 3] = -1.0
    got = tensor_stats(x, count_zeros=True, row_mask=mask, hist=True)
    ref = _numpy_reference(x, mask, 0.0)
    assert (got.nan, got.inf, got.zeros) == (ref["nan"], ref["inf"], ref["zeros"])
    assert (got.min, got.max) == (ref["min"], ref["max"])
    # the mean to float32 rounding of the values' scale: a mean near zero is a difference
    assert got.mean == pytest.approx(ref["mean"], rel=1e-7, abs=1e-7 * ref["std"])
    assert got.std == pytest.approx(ref["std"], rel=2e-7)
    assert got.norm == pytest.approx(ref["norm"], rel=1e-7)
    assert got.hist == reference_hist(x)
    if len(shape) >= 2:
        assert (got.units, got.dead) == (shape[-1], ref["dead"])
        if mask is not None:
            assert tensor_stats(x).dead == ref["dead"] - 1  # unit 3 lives in the padding


def test_cpu_statistics_are_the_same_bits_whatever_torchs_thread_count():
    """A dump takes large tensors' statistics in its writer thread and small ones in the caller;
    `dump --compile --stats-only` on workers. The numbers must not depend on where (torch's
    reductions split their work by thread count, and a second OpenMP team beside the model's slows
    both): the CPU path reads the values with numpy, one core, whatever the setting."""
    torch.manual_seed(0)
    x = torch.randn(8, 128, 3072) * 3.0 + 1.0  # 24 blocks of 2^17 elements
    threads = torch.get_num_threads()
    try:
        seen = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            seen.append(tensor_stats(x, hist=True, count_zeros=True))
            seen.append(tensor_stats(x.bfloat16()))
    finally:
        torch.set_num_threads(threads)
    assert seen[0::2] == [seen[0]] * 3 and seen[1::2] == [seen[1]] * 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_strided_tensor_has_the_statistics_of_its_contiguous_copy(dtype) -> None:
    """Rows are read in logical order whatever the layout (numpy lays a transposed tensor out),
    so a permuted output and its contiguous copy give the same bits; both against float64."""
    torch.manual_seed(0)
    x = (torch.randn(4, 300, 200) * 2.0 + 0.5).to(dtype).transpose(1, 2)  # [4, 200, 300]
    assert not x.is_contiguous()
    got = tensor_stats(x, count_zeros=True, hist=True)
    assert got == tensor_stats(x.contiguous(), count_zeros=True, hist=True)
    ref = _numpy_reference(x, None, 0.0)
    assert (got.min, got.max, got.dead) == (ref["min"], ref["max"], ref["dead"])
    assert got.mean == pytest.approx(ref["mean"], rel=1e-7)
    assert got.hist == reference_hist(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64])
@pytest.mark.parametrize(
    # rows a multiple of GRAPH_ROWS, with a remainder, fewer than it, one dim, none
    "shape",
    [(4, 64, 48), (3, 37, 20), (5, 9), (1_000,), ()],
    ids=str,
)
@pytest.mark.parametrize("offset", [300.0, 0.5], ids=["far-mean", "near-zero-mean"])
def test_graph_stats_match_an_independent_float64_reference(dtype, shape, offset):
    """`graph_stats` (what a compiled stats-only dump computes in its graph) of finite tensors:
    every field equals float64 numpy's within the same tolerance as `tensor_stats`, run eagerly
    and compiled by inductor; a NaN or an Inf makes `stats_from_graph` refuse."""
    from modeltap.stats import graph_stats, rows_kept, stats_from_graph

    gen = torch.Generator().manual_seed(sum(shape) + int(offset))
    x = torch.randn(shape, generator=gen) * 4.0 + offset
    # a unit per column with its own offset: the first row, not the mean, is each one's pivot
    x = x + torch.linspace(-50, 50, shape[-1]) if shape else x
    if len(shape) >= 2:
        x[..., 1] = -2.0  # a dead unit
    mask = None
    if len(shape) >= 3:
        mask = torch.ones(shape[:2], dtype=torch.bool)
        mask[-1, 2:] = False
        x[-1, 2:, 3] = 1e3  # unit 3 is alive only where the mask leaves rows out
        x[:-1, :, 3] = -1.0
        x[-1, :2, 3] = -1.0
    x = (x.round() if dtype == torch.int64 else x).to(dtype)
    ref = _numpy_reference(x, mask, 0.0)
    compiled = torch.compile(graph_stats, backend="inductor", dynamic=False)
    for run in (graph_stats, compiled):
        got = stats_from_graph(run(x, rows_kept(x, mask)).tolist(), list(x.shape), x.dtype)
        assert (got.nan, got.inf, got.numel) == (0, 0, x.numel())
        assert (got.min, got.max) == (ref["min"], ref["max"])
        assert got.mean == pytest.approx(ref["mean"], rel=1e-7, abs=1e-7 * ref["std"])
        if x.numel() > 1:
            assert got.std == pytest.approx(ref["std"], rel=2e-7)
        assert got.norm == pytest.approx(ref["norm"], rel=2e-7)
        if len(shape) >= 2:
            assert (got.units, got.dead) == (shape[-1], ref["dead"])
        else:
            assert got.units is None
    if dtype.is_floating_point and x.numel():
        for bad in (math.nan, math.inf, -math.inf):
            y = x.clone()
            y.view(-1)[x.numel() // 2] = bad
            assert stats_from_graph(graph_stats(y).tolist(), list(y.shape), y.dtype) is None


def test_graph_stats_of_an_empty_tensor_are_tensor_stats():
    from modeltap.stats import graph_stats, stats_from_graph

    x = torch.empty(2, 0, 3)
    numbers = graph_stats(x)  # no reduction of an empty tensor is taken (amax would fail)
    assert numbers.shape == (0,) and numbers.dtype == torch.float64
    assert stats_from_graph(numbers.tolist(), [2, 0, 3], x.dtype) == tensor_stats(x)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_square_sum_has_the_bits_of_squares_written_out_and_summed(dtype):
    """The block pass's square sum (einsum, no squares written) against the squares written to
    an array and summed the way every other sum of the block is: the same bits, so statistics
    did not change with it; sizes with and without a remainder, and below einsum's threshold."""
    import numpy as np

    from modeltap.stats.blocks import _square_sum, _sum

    rng = np.random.default_rng(3)
    for n in (31, 32, 33, 511, 512, 513, 4097, 1 << 17, 768 * 170 + 5):
        for scale in (1e-3, 1.0, 1e3):
            x = (rng.standard_normal(n) * scale).astype(dtype)
            assert _square_sum(x) == _sum(np.square(x)), (n, scale)


@pytest.mark.parametrize(
    ("dtype", "value", "threshold"),
    [
        (torch.bfloat16, 0.10009765625, 0.1),  # 0.1 rounds to bfloat16's 0.10009765625
        (torch.float16, 0.1000366, 0.10002),
        (torch.int64, 16_777_217, 16_777_216.0),  # float32 would round the value down
    ],
)
def test_graph_stats_count_dead_units_in_the_cpu_paths_dtype(dtype, value, threshold):
    """The dead-unit threshold is compared where the CPU path compares it (float32, float64 for
    wide integers), not in the tensor's own dtype, which would round the threshold."""
    from modeltap.stats import graph_stats, stats_from_graph

    x = torch.full((4, 3), value, dtype=dtype)
    x[:, 2] = 0
    want = tensor_stats(x, dead_threshold=threshold)
    got = stats_from_graph(graph_stats(x, None, threshold).tolist(), [4, 3], dtype)
    top = float(x.max())  # the value as the dtype holds it
    assert (got.dead, got.min, got.max) == (want.dead, want.min, want.max) == (1, 0, top)


@pytest.mark.parametrize("nonfinite", ["inf", "nan", "both"])
@pytest.mark.parametrize("numel", [138, 5_000, 300_000], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("final", [False, True], ids=["eager", "final"])
def test_nonfinite_values_are_counted_without_a_numpy_warning(nonfinite, numel, dtype, final):
    """A block holding +inf and -inf sums to NaN in numpy, which warned `invalid value
    encountered in reduce` from inside the statistics (issue 29 item 4): the counts are the
    statistics' to report, the moments those of the finite values, and no warning."""
    import warnings

    import numpy as np

    from modeltap.stats import final_stats

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(numel, generator=generator).to(dtype)
    if nonfinite != "nan":
        x[50:53] = math.inf
        x[60:62] = -math.inf
    if nonfinite != "inf":
        x[-40:] = math.nan
    x = x.reshape(-1, 2)
    values = x.double().numpy().reshape(-1)
    finite = values[np.isfinite(values)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = (final_stats if final else tensor_stats)(x)
    assert got.nan == int(np.isnan(values).sum()) == (0 if nonfinite == "inf" else 40)
    assert got.inf == int(np.isinf(values).sum()) == (0 if nonfinite == "nan" else 5)
    assert got.mean == pytest.approx(float(finite.mean()), rel=1e-6, abs=1e-9)
    assert got.std == pytest.approx(float(finite.std(ddof=1)), rel=1e-6)
    assert got.norm == pytest.approx(float(np.sqrt(np.square(finite).sum())), rel=1e-6)
    assert (got.min, got.max) == (float(finite.min()), float(finite.max()))


def test_all_nan_tensor_has_counts_and_no_moments():
    import warnings

    x = torch.full((300_000,), math.nan)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = tensor_stats(x)
    assert (got.nan, got.inf) == (300_000, 0)
    assert (got.norm, got.mean, got.min, got.max, got.absmax) == (None,) * 5


def test_rules_pass_no_magnitude_verdict_on_a_nonfinite_tensor():
    """A GradScaler-skipped step's gradient below a ReLU: NaN where the unit was on, 0 where
    off. Its finite values have norm 0, which read as a vanishing gradient (issue 29 item 4);
    the NaN count is what it reports, and no rule judges its size."""
    from modeltap.record.rules import (
        ACTIVATION,
        GRADIENT,
        PARAM_GRAD,
        Observation,
        apply_rules,
        default_rules,
    )

    grad = torch.zeros(8, 64)
    grad[:, ::3] = math.nan
    huge = torch.full((8, 64), 1e6)
    huge[0, 0] = math.inf
    saturated = torch.ones(8, 64)
    saturated[0, 0] = math.nan
    observations = [
        Observation("grad/1", GRADIENT, tensor_stats(grad)),
        Observation("grad/0.weight", PARAM_GRAD, tensor_stats(grad)),
        Observation("grad/2", GRADIENT, tensor_stats(huge)),
        Observation("3", ACTIVATION, tensor_stats(saturated), module_class="Sigmoid"),
    ]
    assert tensor_stats(grad).nan == 8 * 22 and tensor_stats(grad).norm == 0.0
    assert apply_rules(default_rules(), observations, step=0, rank=0) == []
    # the same tensors without their non-finite values are judged as before
    finite = [
        Observation("grad/1", GRADIENT, tensor_stats(grad.nan_to_num(0.0))),
        Observation("grad/2", GRADIENT, tensor_stats(huge.nan_to_num(posinf=1e6))),
        Observation(
            "3", ACTIVATION, tensor_stats(saturated.nan_to_num(1.0)), module_class="Sigmoid"
        ),
    ]
    hits = apply_rules(default_rules(), finite, step=0, rank=0)
    assert [h.rule for h in hits] == ["vanishing_gradient", "exploding_gradient", "saturation"]


def test_gradscaler_skipped_step_is_not_reported_vanishing(tmp_path):
    """fp16 autocast with a GradScaler whose scale overflows the backward: the step is skipped,
    its gradients hold NaN, and no rule hit (before: vanishing_gradient on the ReLU outputs'
    gradients, NaN where a unit was on and 0 elsewhere) nor a numpy warning."""
    import warnings

    import modeltap
    from modeltap.record import read_run

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 4),
    )  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**60)
    nonfinite_counts: dict[str, int] = {}  # the reference: plain tensor hooks on the same backward

    def count_nonfinite(name):
        def forward_hook(module, args, output):
            output.register_hook(
                lambda g: nonfinite_counts.update({name: int((~g.isfinite()).sum())})
            )

        return forward_hook

    for name in ("0", "2"):
        model.get_submodule(name).register_forward_hook(count_nonfinite(name))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with modeltap.record(model, tmp_path / "run", every=1, scaler=scaler) as rec:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(8, 16) * 100).float().square().mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            hits = rec.step()
    step = read_run(tmp_path / "run").ranks[0].steps[0]
    assert step.get("skipped") is True and rec.skipped == [0]
    assert hits == [] and step["hits"] == []
    assert nonfinite_counts["0"] > 0 and nonfinite_counts["2"] > 0
    assert step["keys"]["grad/0"]["nonfinite"] == nonfinite_counts["0"]
    assert step["keys"]["grad/2"]["nonfinite"] == nonfinite_counts["2"]
    assert step["keys"]["grad/2"]["norm"] == 0.0  # its finite values: the ReLU's zeros
    from modeltap.render.run_tables import run_table  # what `show DIR` prints

    assert "vanishing" not in run_table(read_run(tmp_path / "run"), 0, width=120).plain


def test_device_statistics_finish_from_numbers_the_writer_copied():
    """A CUDA dump copies each tensor's statistics numbers to pinned memory and lets go of the
    device vector before finishing them (dump/writer.py): the first GPU run failed every CUDA dump
    on `assert self.numbers is not None`. The device path, run here on a CPU tensor."""
    torch.manual_seed(0)
    x = torch.randn(6, 40) * 3.0 + 1.0
    x[2, 5] = 0.0
    base = {"shape": [6, 40], "dtype": "float32", "numel": 240}
    options = {"dead_threshold": 0.0, "row_mask": None, "count_zeros": True, "hist": False}
    pending = stats_module.device.device_stats(x, base, **options)
    numbers = pending.numbers.tolist()
    pending.numbers = None  # as the writer does once its non-blocking copy is queued
    got = pending.result(numbers)
    ref = x.double()
    assert (got.numel, got.min, got.max) == (240, float(x.min()), float(x.max()))
    assert got.mean == pytest.approx(ref.mean().item(), rel=1e-7)
    assert got.std == pytest.approx(ref.std().item(), rel=1e-6)
    assert got.norm == pytest.approx(ref.norm().item(), rel=1e-7)
    assert got.zeros == 1
