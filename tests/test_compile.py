"""torch.compile backend: same keys as eager, values within the `compile` preset, one graph."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from modeltap.capture import capture
from modeltap.capture.compile import compile_capture
from modeltap.cli import app
from modeltap.config import tolerance_preset
from tests.fixtures.backends import OTHER_GRAPH, build_nested, nested, read_dump
from tests.fixtures.breaks import breaks

runner = CliRunner()


def _dump(args: list[str]) -> None:
    result = runner.invoke(app, ["dump", *args])
    assert result.exit_code == 0, result.output


def _assert_same(eager: dict[str, torch.Tensor], other: dict[str, torch.Tensor], atol, rtol):
    assert set(other) == set(eager)
    for key, value in eager.items():
        torch.testing.assert_close(other[key], value, atol=atol, rtol=rtol, msg=key)


def test_tiny_bert_compiled_dump_has_the_eager_keys_and_values(bert_dir: Path) -> None:
    _dump([str(bert_dir), "hello world", "-o", "eager.safetensors"])
    _dump(
        [str(bert_dir), "hello world", "--compile", "--compile-backend", "aot_eager"]
        + ["--fullgraph", "-o", "compiled.safetensors"]
    )
    eager, eager_meta = read_dump("eager.safetensors")
    compiled, meta = read_dump("compiled.safetensors")
    tol = tolerance_preset("compile")
    _assert_same(eager, compiled, tol["atol"], tol["rtol"])
    assert json.loads(meta["order"]) == json.loads(eager_meta["order"])
    assert not any("_orig_mod" in k for k in compiled)
    details = json.loads(meta["backend_details"])
    assert (meta["backend"], details["graphs"], details["graph_breaks"]) == ("compile", 1, 0)
    # no break, no in-place op: nothing copied
    assert (details["copied_outputs"], details["changed_after_return"]) == (False, [])
    assert eager_meta["backend"] == "eager"
    # hooked but never called in this forward (a ModuleList, sdpa skips attention dropout)
    assert json.loads(meta["unmapped"]) == [
        "encoder.layer",
        "encoder.layer.0.attention.self.dropout",
        "encoder.layer.1.attention.self.dropout",
    ]


def test_reused_module_and_inplace_ops_keep_the_values_modules_returned() -> None:
    model = nested()
    x = torch.randn(2, 5, 4)
    got, info = compile_capture(model, x, backend="aot_eager", fullgraph=True, inputs=True)
    want = capture(model, x, inputs=True)
    assert got.keys() == want.keys()
    assert "blocks.1:in.0" in want.keys()
    assert "shared@2" in got.keys()
    for key in want.keys():
        torch.testing.assert_close(got[key], want[key], **OTHER_GRAPH, msg=key)
    # independent reference: norm's output before `h += 1`, head's before ReLU(inplace)
    with torch.no_grad():
        h = model.shared(model.embed(x))
        for block in model.blocks:
            h = model.shared(block(h))
        normed = model.norm(h)
        head = model.head(normed + 1.0)
    torch.testing.assert_close(got["norm"], normed, **OTHER_GRAPH)
    torch.testing.assert_close(got["head"], head, **OTHER_GRAPH)
    torch.testing.assert_close(got["relu"], head.relu(), **OTHER_GRAPH)
    assert info.copied_outputs and info.graphs == 1
    assert not any(m.training for m in model.modules())
    assert not any(m._forward_hooks for m in model.modules())


def test_unknown_compile_backend_is_a_one_line_error(bert_dir: Path) -> None:
    result = runner.invoke(
        app, ["dump", str(bert_dir), "hi", "--compile", "--compile-backend", "nope", "-o", "x"]
    )
    assert result.exit_code == 2
    assert "no torch.compile backend 'nope'" in result.output
    assert "Traceback" not in result.output
    assert not Path("x").exists()


@pytest.mark.slow
def test_inductor_matches_eager_within_the_compile_preset(bert_dir: Path) -> None:
    _dump([str(bert_dir), "hello world", "-o", "eager.safetensors"])
    _dump([str(bert_dir), "hello world", "--compile", "-o", "compiled.safetensors"])
    eager, _ = read_dump("eager.safetensors")
    compiled, meta = read_dump("compiled.safetensors")
    tol = tolerance_preset("compile")
    _assert_same(eager, compiled, tol["atol"], tol["rtol"])
    assert json.loads(meta["backend_details"])["compile_backend"] == "inductor"


@pytest.mark.slow
def test_grads_through_compile_equal_plain_autograd() -> None:
    _dump(
        ["tests.fixtures.backends:build_nested", "--grads", "--compile"]
        + ["--compile-backend", "eager", "-o", "g.safetensors"]
    )
    got, meta = read_dump("g.safetensors")
    details = json.loads(meta["backend_details"])
    assert meta["backend"] == "compile" and details["graphs"] > 1  # hooks break the graph
    assert details["graph_breaks"] == details["graphs"] - 1
    # independent reference: d sum(output) / d (some modules' outputs), plain autograd
    model, (x,) = build_nested()
    outputs: dict[str, torch.Tensor] = {}
    handles = [
        model.get_submodule(name).register_forward_hook(
            lambda m, a, out, name=name: outputs.__setitem__(name, out)
        )
        for name in ("embed", "blocks.0", "blocks.1.act", "norm")
    ]
    y = model(x)
    for handle in handles:
        handle.remove()
    names = list(outputs)
    grads = torch.autograd.grad(y.sum(), [outputs[n] for n in names])
    tol = tolerance_preset("compile")
    for name, want in zip(names, grads, strict=True):
        torch.testing.assert_close(got[f"grad/{name}"], want, **tol, msg=name)


def test_gpt2_without_cache_keeps_the_eager_keys(gpt2_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gpt2_dir, use_cache=False).eval()
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    got, info = compile_capture(model, input_ids=ids, backend="aot_eager", fullgraph=True)
    want = capture(model, input_ids=ids)
    assert set(got.keys()) == set(want.keys())
    tol = tolerance_preset("compile")
    for key in want.keys():
        torch.testing.assert_close(got[key], want[key], **tol, msg=key)
    assert info.graphs == 1


@pytest.mark.slow
def test_minilm_compiled_keys_and_values(minilm_dir: Path) -> None:
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(minilm_dir).eval()
    batch = dict(AutoTokenizer.from_pretrained(minilm_dir)(["hello world"], return_tensors="pt"))
    got, info = compile_capture(model, backend="aot_eager", **batch)
    want = capture(model, **batch)
    assert set(got.keys()) == set(want.keys()) and len(want.keys()) == 114
    tol = tolerance_preset("compile")
    for key in want.keys():
        torch.testing.assert_close(got[key], want[key], **tol, msg=key)
    assert info.graphs == 1


def test_compiled_stats_only_dump_equals_torch_statistics_of_the_compiled_values(
    bert_dir: Path,
) -> None:
    texts = ["hello world", "a second, longer sentence about the model"]  # padded: a row mask
    common = [str(bert_dir), *texts, "--compile", "--compile-backend", "aot_eager"]
    _dump([*common, "-o", "values.safetensors"])
    _dump([*common, "--stats-only", "-o", "stats.safetensors"])
    values, _ = read_dump("values.safetensors")
    with safe_open("stats.safetensors", "pt") as f:
        meta = f.metadata()
        assert list(f.keys()) == []
    stats = json.loads(meta["stats"])
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bert_dir)
    mask = tok(texts, padding=True, return_tensors="pt")["attention_mask"]
    assert not mask.all()
    aliases = json.loads(meta["aliases"])
    assert set(stats) | set(aliases) == set(values) and len(values) == 46
    details = json.loads(meta["backend_details"])
    assert (details["graphs"], details["statistics"]) == (1, "in the graph")
    for key, got in stats.items():
        x = values[key].double()
        assert got["numel"] == x.numel() and got["shape"] == list(x.shape)
        torch.testing.assert_close(got["mean"], x.mean().item(), rtol=1e-6, atol=1e-7, msg=key)
        torch.testing.assert_close(got["std"], x.std().item(), rtol=1e-6, atol=1e-7, msg=key)
        torch.testing.assert_close(got["norm"], x.norm().item(), rtol=1e-6, atol=0, msg=key)
        assert (got["min"], got["max"]) == (x.min().item(), x.max().item()), key
        if x.dim() >= 2:
            rows = x[mask.bool()] if x.dim() >= 3 and x.shape[:2] == mask.shape else x
            alive = rows.reshape(-1, x.shape[-1]).amax(0)
            assert got["dead"] == int((alive <= 0).sum()), key


def _returned(model: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Independent reference: plain eager hooks that copy each output as its module returns it
    (`name`, or `name:i` for a tuple's parts), and the model's output (`__root__`)."""
    values: dict[str, torch.Tensor] = {}

    def hook(name: str):
        def keep(module, args, out) -> None:
            parts = dict(enumerate(out)) if isinstance(out, tuple) else {None: out}
            for i, part in parts.items():
                values[name if i is None else f"{name}:{i}"] = part.detach().clone()

        return keep

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if n]
    try:
        with torch.no_grad():
            values["__root__"] = model(x).clone()
    finally:
        for handle in handles:
            handle.remove()
    return values


@pytest.mark.parametrize(
    ("kind", "backend", "changed"),
    [
        ("item", "aot_eager", ["a"]),
        ("item", "inductor", ["a"]),
        ("print", "aot_eager", ["a"]),
        ("eager", "aot_eager", ["a"]),
        ("pair", "aot_eager", ["pair", "pair.fc"]),
        ("relu", "aot_eager", ["a"]),
    ],
)
def test_a_value_changed_in_place_after_a_graph_break_is_the_one_its_module_returned(
    kind: str, backend: str, changed: list[str]
) -> None:
    model, x = breaks(kind)
    got, info = compile_capture(model, x, backend=backend)
    want = _returned(model, x)
    assert set(got.keys()) == set(want)
    tol = tolerance_preset("compile")
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, **tol, msg=key)
    # the change is real: the value after the forward is not the returned one
    assert (want["a"] - model.a(x).detach()).abs().max() == 0
    assert info.graph_breaks >= 1 and info.copied_outputs
    assert info.changed_after_return == changed
    assert not any(m._forward_hooks for m in model.modules())


def _stats(path: str) -> dict[str, dict]:
    """A stats-only dump's statistics by key, aliases resolved."""
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    stats = json.loads(meta["stats"])
    return {**stats, **{k: stats[t] for k, t in json.loads(meta["aliases"]).items()}}


def test_compiled_dump_across_a_graph_break_equals_the_eager_dump_stats_only_too() -> None:
    factory = "tests.fixtures.breaks:build_item"
    _dump([factory, "-o", "eager.safetensors"])
    result = runner.invoke(app, ["dump", factory, "--compile", "-o", "compiled.safetensors"])
    assert result.exit_code == 0, result.output  # inductor
    assert "note: 1 module output(s) changed in place after a graph break" in result.output
    _dump([factory, "--compile", "--stats-only", "-o", "stats.safetensors"])
    eager, _ = read_dump("eager.safetensors")
    compiled, meta = read_dump("compiled.safetensors")
    model, x = breaks("item")
    want = _returned(model, x)
    tol = tolerance_preset("compile")
    _assert_same(want, eager, 0, 0)
    _assert_same(want, compiled, tol["atol"], tol["rtol"])
    details = json.loads(meta["backend_details"])
    assert (details["graph_breaks"], details["changed_after_return"]) == (1, ["a"])
    result = runner.invoke(app, ["diff", "eager.safetensors", "compiled.safetensors"])
    assert result.exit_code == 0, result.output
    stats = _stats("stats.safetensors")
    assert set(stats) == set(want)
    for key, value in want.items():
        got, x64 = stats[key], value.double()
        torch.testing.assert_close(got["mean"], x64.mean().item(), **tol, msg=key)
        torch.testing.assert_close(got["max"], x64.max().item(), **tol, msg=key)
        torch.testing.assert_close(got["min"], x64.min().item(), **tol, msg=key)


def test_structured_output_changed_after_a_break_stats_only() -> None:
    common = ["tests.fixtures.breaks:build_pair", "--compile", "--compile-backend", "aot_eager"]
    _dump([*common, "--stats-only", "-o", "stats.safetensors"])
    stats = _stats("stats.safetensors")
    with safe_open("stats.safetensors", "pt") as f:
        meta = f.metadata()
    model, x = breaks("pair")
    want = _returned(model, x)
    assert set(stats) == set(want)
    tol = tolerance_preset("compile")
    for key, value in want.items():
        x64 = value.double()
        torch.testing.assert_close(stats[key]["min"], x64.min().item(), **tol, msg=key)
        torch.testing.assert_close(stats[key]["max"], x64.max().item(), **tol, msg=key)
    # computed in the graphs where the module returned, before the changes: nothing to copy
    details = json.loads(meta["backend_details"])
    assert details["statistics"] == "in the graph"
    assert (details["graph_breaks"], details["changed_after_return"]) == (1, [])


class _Twice(torch.nn.Module):
    """`fc` runs twice; `out` may make a NaN (`nan=True`) from a negative value's square root."""

    def __init__(self, nan: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(6, 6)
        self.act = torch.nn.GELU()
        self.out = torch.nn.Linear(6, 3)
        self.nan = nan
        self.twice = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc(x))
        if self.twice:
            h = self.fc(h)
        y = self.out(h)
        return y.sqrt() if self.nan else y


def _library_dump(model, x, out: Path, **options) -> dict[str, str]:
    from modeltap.capture.compile import CompileBackend
    from modeltap.dumping import dump_model
    from modeltap.loading.inputs import Inputs

    inputs = Inputs((x,), {}, {"kind": "tensor"})
    backend = CompileBackend("aot_eager")
    dump_model(model, inputs, out, stats_only=True, backend=backend, **options)
    with safe_open(str(out), "pt") as f:
        return f.metadata()


def _outputs(model, x) -> dict[str, list[torch.Tensor]]:
    """Independent reference: each module's outputs as plain hooks see them, in call order."""
    seen: dict[str, list[torch.Tensor]] = {}
    handles = [
        m.register_forward_hook(
            lambda mod, a, out, n=n or "__root__": seen.setdefault(n, []).append(out.clone())
        )
        for n, m in model.named_modules()
    ]
    with torch.no_grad():
        model(x)
    for handle in handles:
        handle.remove()
    return seen


@pytest.mark.parametrize("case", ["nan", "twice"])
def test_compiled_stats_only_of_each_call_or_after_the_forward_saying_why(
    tmp_path: Path, case
) -> None:
    """A module run twice: each call's statistics, from the graph. A NaN (counts need the tensor):
    the statistics are taken after the forward, as before, and the dump says why."""
    model = _Twice(nan=case == "nan")
    model.twice = case == "twice"
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    meta = _library_dump(model, x, tmp_path / "d.safetensors")
    details = json.loads(meta["backend_details"])
    if case == "nan":
        assert details["statistics"] == "after the forward: '__root__' holds a NaN or Inf"
    else:
        assert details["statistics"] == "in the graph"
    stats = json.loads(meta["stats"])
    stats.update({k: stats[t] for k, t in json.loads(meta["aliases"]).items()})
    for name, values in _outputs(model, x).items():
        for call, value in enumerate(values):
            got = stats[name if call == 0 else f"{name}@{call}"]
            assert got["nan"] == int(value.isnan().sum())
            finite = value[value.isfinite()].double()
            torch.testing.assert_close(got["mean"], finite.mean().item(), rtol=1e-6, atol=1e-7)
    if case == "nan":
        assert stats["__root__"]["nan"] > 0


def test_compiled_stats_only_with_histograms_reads_the_finished_tensors_in_place(
    tmp_path: Path, monkeypatch
) -> None:
    """With --hist the statistics need the tensors: they are read where the finished graph left
    them (`final`, by the statistics workers), not copied first as an eager dump's are; through
    `dump_model`'s own sink too (it once sent them down the copying path)."""
    monkeypatch.setenv("MODELTAP_TIMELINE", str(tmp_path / "t.jsonl"))
    model = _Twice()
    x = torch.randn(400, 6, generator=torch.Generator().manual_seed(1))
    meta = _library_dump(model, x, tmp_path / "d.safetensors", hist=True)
    assert "statistics" not in json.loads(meta["backend_details"])
    records = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    threads = {r["key"]: r["stats"][2] for r in records if "key" in r}
    assert set(threads) == {"fc", "act", "out"}  # the root returns out's tensor: an alias
    assert set(threads.values()) == {"final"}
    assert all(s["hist"] for s in json.loads(meta["stats"]).values())


def test_compiled_stats_only_dump_has_the_eager_dumps_keys_order_and_aliases(
    bert_dir: Path,
) -> None:
    """Statistics computed in the inductor graph: the eager stats-only dump's keys, order, aliases
    and dead units, moments within the compile preset (the compiled values differ from eager's)."""
    texts = ["hello world", "a second, longer sentence about the model"]  # padded: a row mask
    _dump([str(bert_dir), *texts, "--stats-only", "-o", "eager.safetensors"])
    args = [str(bert_dir), *texts, "--compile", "--stats-only", "-o", "compiled.safetensors"]
    result = runner.invoke(app, ["dump", *args])
    assert result.exit_code == 0, result.output
    assert ", statistics in the graph" in " ".join(result.output.split())  # wrapped or not
    with safe_open("eager.safetensors", "pt") as f:
        eager = f.metadata()
    with safe_open("compiled.safetensors", "pt") as f:
        compiled = f.metadata()
    details = json.loads(compiled["backend_details"])
    assert (details["graphs"], details["statistics"]) == (1, "in the graph")
    for field in ("order", "aliases", "skipped", "devices"):
        assert json.loads(compiled[field]) == json.loads(eager[field]), field
    want, got = json.loads(eager["stats"]), json.loads(compiled["stats"])
    assert list(got) == list(want) and len(want) == 26
    tol = tolerance_preset("compile")
    for key, w in want.items():
        g = got[key]
        assert {
            k: g[k] for k in ("shape", "dtype", "numel", "nan", "inf", "units", "dead") if k in w
        } == {
            k: w[k] for k in ("shape", "dtype", "numel", "nan", "inf", "units", "dead") if k in w
        }, key
        for field in ("mean", "std", "norm", "min", "max"):
            torch.testing.assert_close(g[field], w[field], **tol, msg=f"{key} {field}")


@dataclasses.dataclass
class _Out:
    h: torch.Tensor


class _Inner(torch.nn.Module):
    def forward(self, h: torch.Tensor) -> _Out:
        return _Out(h * 2)


class _Q(torch.nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return (h.abs() * 100).to(torch.uint16)


class _Big(torch.nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros_like(h)
        mask[::2] = torch.finfo(torch.float32).min  # rows: each unit holds both values
        return mask


class _Odd(torch.nn.Module):
    """`inner` returns a plain dataclass (pytree can't look into it), `q` an unsigned integer
    tensor (no min/max on CPU for uint16), `big` a finite tensor whose squares overflow float32
    (an additive attention mask of float32's lowest value)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.fc = torch.nn.Linear(6, 6)
        self.inner, self.q, self.big = _Inner(), _Q(), _Big()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.kind == "dataclass":
            return self.inner(h).h
        if self.kind == "uint16":
            return self.q(h).float()
        return h + self.big(h)


@pytest.mark.parametrize(
    ("kind", "statistics"),
    [
        ("dataclass", "after the forward: 'inner' returns a _Out pytree can't look into"),
        ("uint16", "in the graph"),
        ("big", "after the forward: 'big' has values past 1e19, whose float32 sums overflow"),
    ],
)
def test_compiled_stats_only_of_odd_outputs_equal_the_eager_dump(
    tmp_path: Path, kind: str, statistics: str
) -> None:
    """Outputs the graph statistics can't take fall back, saying why; what they can take equals
    the eager dump (a dataclass's tensors were once read as statistics vectors, an unsigned
    tensor failed the whole dump on the eager backends)."""
    model = _Odd(kind)
    # 32 rows: the float32 sums of 16 rows at a time (fewer are summed in float64)
    x = torch.randn(32, 6, generator=torch.Generator().manual_seed(1))
    compiled = _library_dump(model, x, tmp_path / "c.safetensors")
    assert json.loads(compiled["backend_details"])["statistics"] == statistics
    from modeltap.dumping import dump_model
    from modeltap.loading.inputs import Inputs

    dump_model(model, Inputs((x,), {}, {}), tmp_path / "e.safetensors", stats_only=True)
    with safe_open(str(tmp_path / "e.safetensors"), "pt") as f:
        eager = f.metadata()
    want, got = json.loads(eager["stats"]), json.loads(compiled["stats"])
    assert list(got) == list(want)
    for key, w in want.items():
        for field in ("numel", "nan", "inf", "units", "dead", "min", "max"):
            assert got[key].get(field) == w.get(field), (key, field)
        for field in ("mean", "std", "norm"):
            torch.testing.assert_close(got[key][field], w[field], rtol=1e-6, atol=1e-7)


def test_compiled_stats_only_falls_back_when_the_statistics_do_not_compile(
    tmp_path: Path, monkeypatch
) -> None:
    """Statistics that break a --fullgraph graph (here made to) fall back to the copying path,
    whose graph compiles: the dump is written and says why."""
    import modeltap.stats as stats_module
    from modeltap.capture.compile import CompileBackend
    from modeltap.dumping import dump_model
    from modeltap.loading.inputs import Inputs

    real = stats_module.graph_stats

    def breaking(*args, **kwargs):
        torch._dynamo.graph_break()
        return real(*args, **kwargs)

    monkeypatch.setattr(stats_module, "graph_stats", breaking)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    out = tmp_path / "d.safetensors"
    backend = CompileBackend("aot_eager", fullgraph=True)
    dump_model(_Twice(), Inputs((x,), {}, {}), out, stats_only=True, backend=backend)
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
    details = json.loads(meta["backend_details"])
    assert details["statistics"].startswith(
        "after the forward: the hooks with statistics did not compile"
    )
    assert details["graphs"] == 1 and set(json.loads(meta["stats"])) == {"fc", "act", "out"}


def test_compile_modules_import_one_way() -> None:
    """compile.py (the backend) imports compile_log and compile_stats; neither imports it back,
    at module level or inside a function (they did: compile_stats <-> compile)."""
    import ast
    import importlib

    for name in ("compile_log", "compile_stats", "order", "recorder"):
        module = importlib.import_module(f"modeltap.capture.{name}")
        tree = ast.parse(Path(module.__file__).read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "modeltap.capture.compile" not in imported, name


class _DeclaredSink:
    """A sink that wraps no DumpWriter but declares what a dump's sink offers (DumpSink)."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.finals: list[bool] = []
        self.asked = 0

    def tensor(self, key: str, tensor: torch.Tensor, *, final: bool = False) -> None:
        self.tensors[key] = tensor.detach().clone()
        self.finals.append(final)

    def alias(self, key: str, target: str) -> None:
        pass

    def computed(self, key: str, stats, device=None) -> None:  # noqa: ANN001
        raise AssertionError("no statistics were asked for")

    def graph_stats_options(self) -> dict | None:
        self.asked += 1
        return None


def test_compile_backend_asks_the_sink_protocol_not_what_it_wraps() -> None:
    """The compile backend hands a finished forward's tensors over as `final` to any sink that
    declares `DumpSink`'s methods (it once asked whether `sink.writer` was a DumpWriter), and asks
    it whether the statistics can come from the graph; the values are the forward hooks'."""
    from modeltap.capture.backend import RunRequest
    from modeltap.capture.compile import CompileBackend

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    x = torch.randn(2, 4)
    plain: dict[str, torch.Tensor] = {}
    handles = [
        module.register_forward_hook(
            lambda m, a, out, name=name: plain.__setitem__(name, out.detach().clone())
        )
        for name, module in model.named_children()
    ]
    with torch.no_grad():
        model(x)
    for handle in handles:
        handle.remove()
    sink = _DeclaredSink()
    names = [name for name, _ in model.named_children()]
    CompileBackend("eager").run(RunRequest(model, names, sink, (x,), {}))
    assert sink.asked == 1
    assert sink.finals and all(sink.finals)
    assert set(sink.tensors) == set(plain)
    for name, value in plain.items():
        torch.testing.assert_close(sink.tensors[name], value)
