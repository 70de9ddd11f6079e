import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from modeltap.capture import capture, hooks, make_key, split_key
from modeltap.errors import SelectionError
from tests.fixtures.models import InPlace, PerType, ReuseLinear, Structured, Wrapped, build_per_type

ROOT = Path(__file__).resolve().parent.parent


def test_key_round_trip():
    for module, call, part in [
        ("a.b", 0, ""),
        ("a.b", 2, ""),
        ("__root__", 0, "0.z"),
        ("x", 1, "in.0"),
    ]:
        assert split_key(make_key(module, call, part)) == (module, call, part)


def test_reused_module_gets_one_key_per_call_in_order():
    torch.manual_seed(0)
    m = ReuseLinear().eval()
    x = torch.randn(2, 4)
    cap = capture(m, x)
    first = m.fc(x)
    second = m.fc(torch.relu(first))
    assert cap.order == ["fc", "fc@1", "__root__"]
    assert torch.equal(cap["fc"], first)
    assert torch.equal(cap["fc@1"], second)
    assert cap.aliases == {"__root__": "fc@1"}


def test_value_is_taken_when_the_module_returns_despite_later_in_place_ops():
    torch.manual_seed(0)
    m = InPlace().eval()
    x = torch.randn(3, 4)
    with torch.no_grad():
        a_out = m.a(x)  # independent computation of each step
        b_out = m.b(a_out + 1.0)
    cap = capture(m, x)
    assert torch.equal(cap["a"], a_out)
    assert torch.equal(cap["b"], b_out)
    assert (b_out < 0).any(), "the test needs negative values that ReLU(inplace) overwrites"
    assert torch.equal(cap["act"], torch.relu(b_out))


def test_structured_outputs_are_flattened_and_non_tensors_skipped():
    torch.manual_seed(0)
    m = Structured().eval()
    x = torch.randn(2, 4)
    cap = capture(m, x)
    y = m.fc(x)
    assert set(cap.keys()) == {"fc", "__root__:0", "__root__:1.double", "__root__:2.0"}
    assert torch.allclose(cap["__root__:1.double"], y * 2)
    assert torch.allclose(cap["__root__:2.0"], y.sum())
    assert cap.skipped == {"__root__:1.count": "int"}


def test_eval_dropout_and_wrappers_are_aliases_of_one_tensor():
    m = Wrapped().eval()
    cap = capture(m, torch.randn(2, 4))
    assert cap.aliases == {"inner.1": "inner.0", "inner": "inner.0", "__root__": "inner.0"}
    assert list(cap.tensors) == ["inner.0"]


def test_train_mode_dropout_is_a_new_tensor():
    m = Wrapped()
    cap = capture(m, torch.randn(2, 4), train_mode=True, seed=0)
    assert "inner.1" in cap.tensors
    assert m.training  # restored


def test_inputs_captured_on_request():
    m = Wrapped().eval()
    x = torch.randn(2, 4)
    cap = capture(m, x, inputs=True, modules=["inner.0"])
    assert torch.equal(cap["inner.0:in.0"], x)


def test_hooks_come_off_and_model_is_bit_identical(bert_dir):
    from transformers import BertModel

    model = BertModel.from_pretrained(bert_dir).train()
    ids = torch.tensor([[2, 10, 11, 12, 3]])
    model.eval()
    with torch.no_grad():
        before = model(input_ids=ids).last_hidden_state
    model.train()
    capture(model, input_ids=ids)
    assert model.training and all(m.training for m in model.modules())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    model.eval()
    with torch.no_grad():
        after = model(input_ids=ids).last_hidden_state
    assert torch.equal(before, after)


def test_hooks_come_off_when_forward_fails():
    m = Wrapped()
    with pytest.raises(RuntimeError), hooks(m, ["inner.0"], _NullSink()):
        m(torch.randn(2, 5))  # wrong width
    assert not any(mod._forward_hooks for mod in m.modules())


def test_unknown_module_name():
    with pytest.raises(SelectionError, match="did you mean 'inner.0'"):
        with hooks(Wrapped(), ["innr.0"], _NullSink()):
            pass


def test_bert_layers_equal_hidden_states(bert_dir):
    from transformers import AutoTokenizer, BertModel

    model = BertModel.from_pretrained(bert_dir).eval()
    tok = AutoTokenizer.from_pretrained(bert_dir)
    batch = tok(["hello world", "the quick brown fox"], return_tensors="pt", padding=True)
    with torch.no_grad():
        ref = model(**batch, output_hidden_states=True)
    cap = capture(model, **batch)
    assert torch.equal(cap["embeddings"], ref.hidden_states[0])
    for i in range(model.config.num_hidden_layers):
        assert torch.equal(cap[f"encoder.layer.{i}"], ref.hidden_states[i + 1])
    assert torch.equal(cap["__root__:last_hidden_state"], ref.last_hidden_state)
    # BertModel: a layer's output module, its LayerNorm and the layer are one tensor.
    assert cap.aliases["encoder.layer.0.output"] == "encoder.layer.0.output.LayerNorm"
    assert cap.aliases["encoder.layer.0"] == "encoder.layer.0.output.LayerNorm"


def test_gpt2_cache_output_is_skipped_not_a_crash(gpt2_dir):
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(gpt2_dir).eval()
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        ref = model(input_ids=ids)
    cap = capture(model, input_ids=ids)
    assert torch.equal(cap["__root__:logits"], ref.logits)
    assert "DynamicCache" in cap.skipped.values()


class _NullSink:
    def tensor(self, key, tensor):
        pass

    def alias(self, key, target):
        pass


def test_hooks_only_keep_outputs_during_the_forward_and_name_them_after():
    """Issue #12: naming, flattening, aliases and the sink run after the forward, not in it."""
    from modeltap.capture import hooks
    from modeltap.capture.recorder import MemorySink

    seen_during: list[int] = []

    class Listing(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 4)

        def forward(self, x):
            parts = [self.a(x)]
            seen_during.append(len(sink.tensors))
            parts.append(self.b(parts[0]))  # a list the model grows after a module returned it
            return parts

    class Outer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Listing()

        def forward(self, x):
            parts = self.inner(x)
            parts.append(parts[1] * 2)
            parts[0].mul_(3)  # in place, after `inner` returned it
            return parts[2]

    torch.manual_seed(0)
    model, x = Outer().eval(), torch.randn(2, 4)
    sink = MemorySink()
    with hooks(model, ["inner", "inner.a"], sink, deferred=True) as recorder:
        with torch.no_grad():
            model(x)
        assert seen_during == [0] and not recorder.order  # nothing named inside the forward
        recorder.drain()
    # The list as `inner` returned it: two parts, not the three it had when the forward ended.
    assert recorder.order == ["inner.a", "inner:0", "inner:1"]
    assert recorder.aliases == {"inner:0": "inner.a"}
    assert recorder.changed == {"inner.a", "inner:0"}  # what capture() takes again, copied

    captured = capture(model, x, modules=["inner", "inner.a"])
    with torch.no_grad():
        a = model.inner.a(x)
        b = model.inner.b(a)
    assert torch.equal(captured["inner.a"], a) and torch.equal(captured["inner:1"], b)
    assert captured.keys() == ["inner.a", "inner:0", "inner:1"]


def test_a_returned_parameter_comes_back_as_a_plain_tensor():
    # Outputs are handed back as they are (no detach needed under no_grad), except what is not a
    # plain tensor or still requires grad: a module that returns its Parameter, frozen or not.
    class Give(torch.nn.Module):
        def __init__(self, requires_grad: bool) -> None:
            super().__init__()
            self.p = torch.nn.Parameter(torch.arange(3.0), requires_grad=requires_grad)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.p

    class Top(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.frozen, self.trained = Give(False), Give(True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.frozen(x) + self.trained(x) + x

    top = Top()
    cap = capture(top, torch.zeros(3))
    for name in ("frozen", "trained"):
        assert type(cap[name]) is torch.Tensor and not cap[name].requires_grad, name
        assert torch.equal(cap[name], getattr(top, name).p.detach())
    assert torch.equal(cap["__root__"], 2 * torch.arange(3.0))


def _types_in_call_order(path: Path) -> list[str]:
    """Which type each call `fc`, `fc@1`, ... of a PerType dump was for, read from its values."""
    model, (x,) = build_per_type()
    with safe_open(str(path), "pt") as f:
        aliases = json.loads(f.metadata().get("aliases", "{}"))
        calls = [k for k in json.loads(f.metadata()["order"]) if split_key(k)[0] == "fc"]
        values = [f.get_tensor(aliases.get(k, k)) for k in calls]
    with torch.no_grad():
        by_type = {t: model.fc(x * (1 + i)) for i, t in enumerate(PerType.TYPES)}
    return [next(t for t, v in by_type.items() if torch.equal(v, value)) for value in values]


def test_the_command_calls_modules_in_the_same_order_in_every_process(tmp_path):
    """A set of strings iterates in the process' hash order: the command pins the hash seed, so
    `fc` is the same call in every run (it is `rotary_emb` in Gemma3 and ModernBERT)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    seed0 = subprocess.run(
        [sys.executable, "-c", f"print(' '.join(set({PerType.TYPES!r})))"],
        env={**env, "PYTHONHASHSEED": "0"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for run in range(2):
        out = tmp_path / f"{run}.safetensors"
        dump = ["dump", "tests.fixtures.models:build_per_type", "-o", str(out)]
        subprocess.run(
            [sys.executable, "-m", "modeltap", *dump], env=env, capture_output=True, check=True
        )
        assert _types_in_call_order(out) == seed0
