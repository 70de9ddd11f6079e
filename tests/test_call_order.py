"""`name` is a module's first call and `name@k` its k-th, in every backend and in the recorder.

The models call one module several times on different inputs: PerType runs `fc` once per type, in
the order of a set of strings (as Gemma3 and ModernBERT run `rotary_emb` once per layer type),
which CPython iterates in hash order and torch.compile in insertion order; ReuseLinear runs `fc`
twice, and the recorder sees it again in each accumulated micro-batch. The expected values come
from plain forward hooks and tensor hooks written here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from modeltap.capture import MemorySink, capture, split_key
from modeltap.capture.backend import RunRequest
from modeltap.capture.compile import compile_capture
from modeltap.capture.export import ExportBackend, export_program, module_names, skeleton
from modeltap.capture.fx import FxBackend
from modeltap.capture.order import matching
from modeltap.capture.torchscript import TorchScriptBackend, save_traced, script_skeleton
from modeltap.dumping import dump_model
from modeltap.loading import Inputs
from modeltap.loading.archive import load_pt2, load_torchscript, torchscript_outputs
from modeltap.record import record
from tests.fixtures.backends import OTHER_GRAPH, read_dump
from tests.fixtures.models import PerType, ReuseLinear, build_per_type


def plain_calls(model: torch.nn.Module, module: torch.nn.Module, *args) -> list[torch.Tensor]:
    """`module`'s output on each call of one forward, in call order, from a plain forward hook."""
    seen: list[torch.Tensor] = []
    handle = module.register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
    try:
        with torch.no_grad():
            model(*args)
    finally:
        handle.remove()
    return seen


def fc_calls(keys, value) -> list[torch.Tensor]:
    """The values of `fc`, `fc@1`, ... in the order of their numbers."""
    calls = sorted((split_key(k)[1], k) for k in keys if split_key(k)[::2] == ("fc", ""))
    assert [n for n, _ in calls] == list(range(len(calls)))
    return [value(k) for _, k in calls]


def _assert_calls(
    got: list[torch.Tensor], want: list[torch.Tensor], what: str, *, graph: bool = False
) -> None:
    """`graph`: the values come from another backend's graph, equal up to float32 rounding."""
    assert len(got) == len(want), what
    tol = OTHER_GRAPH if graph else {"rtol": 0, "atol": 0}
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, **tol, msg=f"{what}: fc@{k}")


def _backend(backend, tree, x) -> tuple[list[str], object]:
    names = [n or "__root__" for n, _ in tree.named_modules()]
    sink = MemorySink()
    done = backend.run(RunRequest(tree, names, sink, (x,), {}))
    rec = done.recorder
    return rec.order, lambda k: sink.tensors[rec.aliases.get(k, k)]


def test_per_type_calls_follow_this_process_set_order():
    """The expected values themselves: call k is the k-th type of `set(TYPES)` here."""
    model, (x,) = build_per_type()
    want = plain_calls(model, model.fc, x)
    with torch.no_grad():
        by_order = [model.fc(x * (1 + PerType.TYPES.index(t))) for t in set(PerType.TYPES)]
    _assert_calls(want, by_order, "plain hooks")
    assert len({float(w.sum()) for w in want}) == len(want)  # every call differs: a swap shows


def test_eager_dump_and_grads_number_calls_in_call_order(tmp_path: Path):
    model, (x,) = build_per_type()
    want = plain_calls(model, model.fc, x)
    cap = capture(model, x)  # the deferred hooks, named after the forward
    _assert_calls(fc_calls(cap.keys(), cap.__getitem__), want, "capture")
    stored, _ = read_dump(dump_model(model, Inputs((x,), {}, {}), tmp_path / "d.safetensors"))
    _assert_calls(fc_calls(stored, stored.__getitem__), want, "dump")


def test_compiled_calls_get_their_eager_numbers():
    """torch.compile iterates the set in insertion order: the compiled run calls `fc` in another
    order than eager Python, and each call still gets its eager number."""
    model, (x,) = build_per_type()
    want = plain_calls(model, model.fc, x)
    got, _ = compile_capture(model, x, backend="aot_eager")
    _assert_calls(fc_calls(got.keys(), got.__getitem__), want, "compile", graph=True)
    copied, info = compile_capture(
        model, x, backend="aot_eager", inputs=True, modules=["fc", "__root__"]
    )
    _assert_calls(fc_calls(copied.keys(), copied.__getitem__), want, "compile, inputs", graph=True)
    scales = [copied[f"fc{'' if k == 0 else f'@{k}'}:in.0"] / x for k in range(len(want))]
    order = [PerType.TYPES[round(float(s.mean())) - 1] for s in scales]
    assert order == list(set(PerType.TYPES))  # each call's inputs went with its output


def test_exported_traced_and_fx_calls_keep_the_eager_numbers(tmp_path: Path):
    model, (x,) = build_per_type()
    want = plain_calls(model, model.fc, x)
    torch.export.save(export_program(model, (x,), {}), tmp_path / "p.pt2")
    program = load_pt2(tmp_path / "p.pt2")
    keys, value = _backend(ExportBackend(program), skeleton(module_names(program)), x)
    _assert_calls(fc_calls(keys, value), want, "export", graph=True)
    save_traced(model, (x,), {}, tmp_path / "p.pt")
    script = load_torchscript(tmp_path / "p.pt")
    ts = TorchScriptBackend(script, outputs=torchscript_outputs(tmp_path / "p.pt"))
    keys, value = _backend(ts, script_skeleton(script), x)
    _assert_calls(fc_calls(keys, value), want, "torchscript", graph=True)
    keys, value = _backend(FxBackend(), torch.fx.symbolic_trace(model), x)
    _assert_calls(fc_calls(keys, value), want, "fx")


def test_recorder_numbers_calls_across_accumulated_micro_batches(tmp_path: Path):
    """Two micro-batches of a model that runs `fc` twice: `fc` .. `fc@3` in call order, each
    with its own output and its own gradient."""
    torch.manual_seed(0)
    model = ReuseLinear().train()
    batches = [torch.randn(3, 4, generator=torch.Generator().manual_seed(i)) for i in (1, 2)]

    outputs: list[torch.Tensor] = []
    grads: dict[int, torch.Tensor] = {}

    def keep(module, args, out):
        k = len(outputs)
        outputs.append(out.detach().clone())
        out.register_hook(lambda g: grads.__setitem__(k, g.detach().clone()))

    handle = model.fc.register_forward_hook(keep)
    for x in batches:
        (model(x) ** 2).sum().backward()
    handle.remove()
    model.zero_grad()

    with record(model, tmp_path / "run", every=1, stats_only=False, params=False) as rec:
        for x in batches:
            (model(x) ** 2).sum().backward()
        rec.step()
    stored, meta = read_dump(tmp_path / "run" / "step000000.rank0.safetensors")
    _assert_calls(fc_calls(stored, stored.__getitem__), outputs, "record")
    assert [k for k in stored if k.startswith("grad/fc")] and len(grads) == 4
    for k, g in grads.items():
        key = "grad/fc" if k == 0 else f"grad/fc@{k}"
        torch.testing.assert_close(stored[key], g, rtol=0, atol=0, msg=key)


@pytest.mark.parametrize(
    ("got", "eager", "want"),
    [
        ([1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [0, 1, 2]),
        ([3.0, 1.0, 2.01], [1.0, 2.0, 3.0], [2, 0, 1]),  # compiled values are close, not equal
        ([1.0, 1.0], [1.0, 1.0], None),  # two calls alike: no telling which is which
        ([1.0, 9.0], [1.0, 2.0], None),  # a call that is no eager call (dropout in training)
        ([1.0, 2.0], [1.0, 2.0, 3.0], None),  # another number of calls
    ],
)
def test_calls_match_eager_ones_only_when_each_is_unmistakable(got, eager, want):
    def calls(values):
        return [[torch.tensor([v])] for v in values]

    assert matching(calls(got), calls(eager)) == want


def test_statistics_of_calls_match_the_nearest_eager_call():
    """Summaries lie closer together than values: ModernBERT's two rotary tables differ by 0.04
    in their cos mean (under SAME_CALL), so only the nearest rule tells the swapped calls apart;
    a tie is no match."""
    global_cos = [torch.tensor([0.8492, -0.9900, 1.0])]
    local_cos = [torch.tensor([0.8132, -0.9900, 1.0])]
    compiled = [local_cos, global_cos]  # the compiled run made them the other way round
    eager = [[t + 1e-7 for t in global_cos], [t - 1e-7 for t in local_cos]]
    assert matching(compiled, eager) is None
    assert matching(compiled, eager, nearest=True) == [1, 0]
    assert matching([global_cos, global_cos], [global_cos, global_cos], nearest=True) is None
