import math

import pytest
import torch

from modeltap import stats as stats_module
from modeltap.stats import tensor_stats


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


def test_chunked_path_equals_whole(monkeypatch):
    torch.manual_seed(1)
    x = torch.randn(64, 33).to(torch.bfloat16)
    whole = tensor_stats(x)
    monkeypatch.setattr(stats_module, "CHUNK_ELEMENTS", 100)  # many chunks of 3 rows
    chunked = tensor_stats(x)
    for name in ("norm", "mean", "std", "min", "max"):
        assert getattr(chunked, name) == pytest.approx(getattr(whole, name), rel=1e-7)
    assert chunked.dead == whole.dead


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
