"""`compare`: origins found by replay, checked against faults injected and errors computed here."""

import copy
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from modeltap.cli import app
from modeltap.compare import Options, compare_models, make_candidate, parse_against
from modeltap.diff import Tolerance, compare
from modeltap.loading import Inputs
from modeltap.selection import Selection, select_modules
from tests.fixtures import hf

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog"]
FAULTY = "encoder.layer.3.output.dense"
runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, ["compare", *[str(a) for a in args]])


def build_bert6(folder: Path) -> Path:
    """A tiny BERT with six layers, so that layers 4 and 5 come after a fault in layer 3."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=120,
        hidden_size=32,
        num_hidden_layers=6,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    BertModel(config).eval().save_pretrained(folder)
    hf.bert_tokenizer().save_pretrained(folder)
    return folder


def batch(folder: Path) -> dict:
    from transformers import AutoTokenizer

    return dict(AutoTokenizer.from_pretrained(folder)(TEXTS, return_tensors="pt", padding=True))


def dense_input(model, inputs: dict, name: str) -> torch.Tensor:
    seen = {}

    def hook(module, args, out):
        seen.setdefault("x", args[0])

    handle = model.get_submodule(name).register_forward_hook(hook)
    with torch.no_grad():
        model(**inputs)
    handle.remove()
    return seen["x"]


def with_fault(src: Path, dst: Path, factor: float) -> tuple[Path, int]:
    """A copy of `src` with one row of FAULTY's weight scaled by `factor`: the row whose output
    is largest on TEXTS, so that the fault is as visible as one row's can be."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(src).eval()
    out = model.get_submodule(FAULTY)(dense_input(model, batch(src), FAULTY))
    row = int(out.abs().amax(dim=(0, 1)).argmax())
    with torch.no_grad():
        model.get_submodule(FAULTY).weight[row] *= factor
    model.save_pretrained(dst)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (src / name).is_file():
            (dst / name).write_bytes((src / name).read_bytes())
    return dst, row


def expected_local_error(src: Path, faulted: Path) -> float:
    """Plain torch: the faulty Linear on the reference's own input, against the healthy one."""
    from transformers import AutoModel

    healthy = AutoModel.from_pretrained(src).eval()
    broken = AutoModel.from_pretrained(faulted).eval()
    x = dense_input(healthy, batch(src), FAULTY)
    with torch.no_grad():
        want = healthy.get_submodule(FAULTY)(x)
        got = torch.nn.functional.linear(
            x, broken.get_submodule(FAULTY).weight, broken.get_submodule(FAULTY).bias
        )
    return float((got - want).abs().max() / want.abs().max())


@pytest.fixture(scope="module")
def bert6(tmp_path_factory):
    return build_bert6(tmp_path_factory.mktemp("bert6"))


@pytest.fixture(scope="module")
def bert6_fault(bert6, tmp_path_factory):
    # +10%: this random model passes on little of a 1% row's error (about 1e-4 of max |b| after
    # the fault, within fp32's allowance for accumulated rounding); trained MiniLM passes 2e-3.
    return with_fault(bert6, tmp_path_factory.mktemp("bert6-fault"), 1.10)[0]


def check_fault_report(report: dict, expected: float) -> None:
    modules = {m["module"]: m for m in report["modules"]}
    assert [o["module"] for o in report["origins"]] == [FAULTY]
    assert report["origins"][0]["local_error"] == pytest.approx(expected, rel=1e-4)
    for parent in ("__root__", "encoder", "encoder.layer.3", "encoder.layer.3.output"):
        assert modules[parent]["verdict"] == "via_child", parent
    assert report["first_divergence"] == FAULTY
    for layer in ("encoder.layer.4", "encoder.layer.5"):
        assert modules[layer]["verdict"] == "inherited"
        inside = [m for name, m in modules.items() if name.startswith(layer + ".")]
        assert inside and all(m["verdict"] in ("inherited", "ok", "not_called") for m in inside)
    # Layers before the fault saw nothing.
    assert all(
        m["verdict"] in ("ok", "not_called")
        for name, m in modules.items()
        if name.startswith(("encoder.layer.0", "encoder.layer.1", "encoder.layer.2"))
    )
    assert report["counts"]["inherited"] == len(report["inherited"]) > 0
    assert not report["passed"]


def test_fault_in_tiny_bert_is_the_only_origin(bert6, bert6_fault):
    result = invoke(bert6, bert6_fault, *TEXTS, "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert report["schema"] == "modeltap.compare/3"
    check_fault_report(report, expected_local_error(bert6, bert6_fault))
    table = invoke(bert6, bert6_fault, *TEXTS)
    assert table.exit_code == 1
    lines = table.stdout.splitlines()
    assert "1. encoder.layer.3.output.dense" in table.stdout
    assert "first divergence: encoder.layer.3.output.dense" in table.stdout
    assert max(len(line) for line in lines) <= 80


@pytest.mark.slow
def test_fault_in_minilm_is_the_only_origin(minilm_dir, tmp_path):
    faulted, _ = with_fault(minilm_dir, tmp_path / "faulted", 1.01)
    result = invoke(minilm_dir, faulted, *TEXTS, "--json")
    assert result.exit_code == 1, result.output
    check_fault_report(json.loads(result.stdout), expected_local_error(minilm_dir, faulted))


@pytest.mark.slow
def test_bf16_preset_passes_minilm_and_catches_a_fault(minilm_dir, tmp_path):
    healthy = invoke(minilm_dir, *TEXTS, "--against", "bf16", "--json")
    assert healthy.exit_code == 0, healthy.output
    report = json.loads(healthy.stdout)
    assert report["preset"] == "bf16" and report["passed"] and not report["origins"]
    assert report["counts"]["replayed"] > 40
    # +1% on one row is below bf16's own rounding on MiniLM (see configs/tolerances.toml); +10%
    # is a fault bf16 can't explain.
    faulted, _ = with_fault(minilm_dir, tmp_path / "faulted", 1.10)
    result = invoke(minilm_dir, faulted, *TEXTS, "--against", "bf16", "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert report["candidate"]["dtype"] == "bfloat16"
    assert [o["module"] for o in report["origins"]] == [FAULTY]


# The sentences of issue #23: MiniLM's sdpa and eager attention differ by 1.6e-5 somewhere,
# beyond fp32's atol of 1e-5, by rounding passed on from module to module.
ISSUE_TEXTS = ["hello world", "a second, longer sentence"]


def sdpa_vs_eager_error(folder: Path, texts: list[str]) -> float:
    """Plain transformers: max |eager - sdpa| / max |sdpa| of the last hidden state."""
    from transformers import AutoModel, AutoTokenizer

    inputs = AutoTokenizer.from_pretrained(folder)(texts, return_tensors="pt", padding=True)
    outs = []
    for impl in ("sdpa", "eager"):
        model = AutoModel.from_pretrained(folder, attn_implementation=impl).eval()
        with torch.no_grad():
            outs.append(model(**inputs).last_hidden_state)
    sdpa, eager = outs
    return float((eager - sdpa).abs().max() / sdpa.abs().max())


def with_row_fault(monkeypatch, module: str, row: tuple[int, int]) -> None:
    """Candidates built by the CLI get +1% on one row of `module`'s output (a forward hook)."""
    import modeltap.compare

    build = modeltap.compare.make_candidate

    def faulty(*args, **kwargs):
        candidate = build(*args, **kwargs)

        def hook(mod, inputs, out):
            out = out.clone()
            out[row] *= 1.01
            return out

        candidate.get_submodule(module).register_forward_hook(hook)
        return candidate

    monkeypatch.setattr(modeltap.compare, "make_candidate", faulty)


def row_fault_error(folder: Path, texts: list[str], module: str, row: tuple[int, int]) -> float:
    """Plain torch: 1% of that row of the module's output, over max |output|."""
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(folder).eval()
    inputs = AutoTokenizer.from_pretrained(folder)(texts, return_tensors="pt", padding=True)
    seen = {}
    handle = model.get_submodule(module).register_forward_hook(
        lambda mod, args, out: seen.setdefault("out", out)
    )
    with torch.no_grad():
        model(**inputs)
    handle.remove()
    out = seen["out"]
    return float((out[row] * 1.01 - out[row]).abs().max() / out.abs().max())


def check_eager_verdicts(folder: Path, texts: list[str], module: str, monkeypatch) -> None:
    """attn:eager passes a healthy model (exit 0); +1% on one row of `module` fails (exit 1),
    with `module` as the only origin."""
    healthy = invoke(folder, *texts, "--against", "attn:eager", "--json")
    assert healthy.exit_code == 0, healthy.output
    report = json.loads(healthy.stdout)
    assert report["passed"] and not report["origins"] and report["first_divergence"] is None
    assert report["preset"] == "fp32" and report["inherited"] == []
    assert report["tolerance"]["scaled_atol"] == 0.0
    assert report["accumulated_tolerance"]["scaled_atol"] == 1e-4
    # The run really differs: its root's cumulative error is the one plain transformers finds.
    root = next(m for m in report["modules"] if m["module"] == "__root__")
    assert root["cumulative_error"] == pytest.approx(sdpa_vs_eager_error(folder, texts), rel=1e-3)
    assert root["cumulative_error"] > 0

    row = (0, 1)
    with_row_fault(monkeypatch, module, row)
    faulty = invoke(folder, *texts, "--against", "attn:eager", "--json")
    assert faulty.exit_code == 1, faulty.output
    report = json.loads(faulty.stdout)
    assert [o["module"] for o in report["origins"]] == [module]
    expected = row_fault_error(folder, texts, module, row)
    assert report["origins"][0]["local_error"] == pytest.approx(expected, rel=1e-3)
    assert report["first_divergence"] == module
    text = invoke(folder, *texts, "--against", "attn:eager")
    assert text.exit_code == 1 and text.stdout.startswith("FAIL")
    assert f"1. {module}" in text.stdout


def test_eager_attention_passes_a_healthy_tiny_bert(bert_dir, monkeypatch):
    module = "encoder.layer.1.attention.output.dense"
    check_eager_verdicts(bert_dir, ISSUE_TEXTS, module, monkeypatch)


@pytest.mark.slow
def test_eager_attention_passes_minilm(minilm_dir, monkeypatch):
    """Issue #23: `compare MiniLM ... --against attn:eager` printed FAIL (exit 1) with no origin."""
    check_eager_verdicts(
        minilm_dir, ISSUE_TEXTS, "encoder.layer.3.attention.output.dense", monkeypatch
    )


def test_a_variant_that_changes_nothing_is_said_so(bert_dir):
    """Issue #23: a PASS with nothing differing said "largest local error 0 in pooler.dense"."""
    result = invoke(bert_dir, *TEXTS, "--against", "fp32")
    assert result.exit_code == 0, result.output
    assert "largest" not in result.stdout
    assert "no local error: every output equal bit for bit" in result.stdout
    assert "no cumulative error: every output equal bit for bit" in result.stdout
    assert "warning: --against fp32 changes nothing: the model already runs float32" in (
        " ".join(result.stdout.split())
    )
    report = json.loads(invoke(bert_dir, *TEXTS, "--against", "fp32", "--json").stdout)
    assert len(report["warnings"]) == 1 and "changes nothing" in report["warnings"][0]
    assert all(m["local_error"] in (0.0, None) for m in report["modules"])
    # Every module has the same keys, note and replay_note null when there is none.
    assert {frozenset(m) for m in report["modules"]} == {frozenset(report["modules"][0])}
    assert {"note", "replay_note"} <= set(report["modules"][0])
    assert report["modules"][0]["note"] is None
    # A variant that changes something has no warning.
    other = json.loads(invoke(bert_dir, *TEXTS, "--against", "bf16", "--json").stdout)
    assert other["warnings"] == []


def wrong_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Eager attention with a softmax at 1.5x the temperature it should have."""
    from transformers.models.bert.modeling_bert import eager_attention_forward

    return eager_attention_forward(
        module, query, key, value, attention_mask, scaling=1.5 * scaling, **kwargs
    )


def test_attention_implementations(bert_dir):
    """attn:eager passes; an attention function at the wrong temperature makes each
    self-attention an origin, and the root one too: transformers builds no mask for an
    attention function it has no mask function for, so the candidate's own root code hands its
    encoder no padding mask (a stand-in that ignored its input hid that)."""
    from transformers import AttentionInterface

    same = invoke(bert_dir, *TEXTS, "--against", "attn:eager", "--json")
    assert same.exit_code == 0, same.output
    report = json.loads(same.stdout)
    assert report["preset"] == "fp32" and report["passed"]
    assert report["candidate"]["variant"] == "attn:eager"

    AttentionInterface.register("modeltap_test_wrong", wrong_attention)
    wrong = invoke(bert_dir, *TEXTS, "--against", "attn:modeltap_test_wrong", "--json")
    assert wrong.exit_code == 1, wrong.output
    found = json.loads(wrong.stdout)
    origins = {o["module"] for o in found["origins"]}
    assert origins == {"__root__", *(f"encoder.layer.{i}.attention.self" for i in range(2))}
    # The root's local error, in plain transformers: its reference encoder and pooler on its
    # reference embeddings, with no attention mask.
    from transformers import AutoModel

    model = AutoModel.from_pretrained(bert_dir).eval()
    seen = {}
    handle = model.embeddings.register_forward_hook(lambda m, a, out: seen.setdefault("x", out))
    with torch.no_grad():
        want = model(**batch(bert_dir))
        handle.remove()
        hidden = model.encoder(seen["x"], attention_mask=None).last_hidden_state
        pooled = model.pooler(hidden)
    expected = max(
        float((got - ref).abs().max() / ref.abs().max())
        for got, ref in ((hidden, want.last_hidden_state), (pooled, want.pooler_output))
    )
    (root,) = [m for m in found["modules"] if m["module"] == "__root__"]
    assert root["local_error"] == pytest.approx(expected, rel=1e-3)


class Jitter(torch.nn.Module):
    """A module that is not a function of its inputs: it adds a little noise on every call."""

    def forward(self, x):
        return x + 1e-3 * torch.rand_like(x)


def test_replay_validation_flags_a_nondeterministic_module(bert_dir):
    from transformers import AutoModel

    model = AutoModel.from_pretrained(bert_dir).eval()
    model.encoder.layer[1].intermediate.intermediate_act_fn = Jitter()
    candidate = make_candidate(model, parse_against("attn:eager"), shared=True)
    modules = select_modules(model, Selection())
    report = compare_models(
        model,
        candidate,
        Inputs((), batch(bert_dir), {}),
        modules,
        Path.cwd(),
        options=Options(tolerance=Tolerance(atol=1e-5, rtol=1.3e-6)),
    )
    flagged = [m.name for m in report.invalid]
    # The module itself, and every module that calls it: none reproduces its own output.
    assert "encoder.layer.1.intermediate.intermediate_act_fn" in flagged
    assert "encoder.layer.1" in flagged and "encoder.layer.0" not in flagged
    assert all(name.startswith(("encoder.layer.1", "encoder", "__root__")) for name in flagged)
    by_name = {m.name: m for m in report.modules}
    assert by_name["encoder.layer.1.intermediate.intermediate_act_fn"].verdict == "replay_invalid"
    assert not any(m.origin for m in report.invalid)
    assert by_name["encoder.layer.0.output.dense"].verdict == "ok"


def test_checkpoints_differing_in_one_layer(bert_dir, tmp_path):
    from transformers import AutoModel

    model = AutoModel.from_pretrained(bert_dir).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for module in model.encoder.layer[1].modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0.0, 0.02)
    model.save_pretrained(tmp_path / "other")
    result = invoke(bert_dir, tmp_path / "other", *TEXTS, "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    origins = [o["module"] for o in report["origins"]]
    assert origins and all(name.startswith("encoder.layer.1.") for name in origins)
    assert report["first_divergence"].startswith("encoder.layer.1.")
    assert report["counts"]["inherited"] > 0  # the pooler, at least


def test_an_error_from_outside_the_selection_fails_with_no_origin(bert_dir, tmp_path):
    """Only encoder.layer.1 is selected; layer 0 differs. Layer 1's own code is exact, so there
    is no origin, but its output carries more than rounding: FAIL, and the heading says why."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(bert_dir).eval()
    with torch.no_grad():
        model.encoder.layer[0].output.dense.weight.mul_(1.2)
    model.save_pretrained(tmp_path / "other")
    result = invoke(bert_dir, tmp_path / "other", *TEXTS, "--include", "encoder.layer.1", "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert report["origins"] == [] and report["inherited"] == ["encoder.layer.1"]
    (layer,) = report["modules"]
    # Its cumulative error, from plain transformers: both models, their own hooks.
    outs = []
    for folder in (tmp_path / "other", bert_dir):
        seen = {}
        plain = AutoModel.from_pretrained(folder).eval()
        plain.encoder.layer[1].register_forward_hook(
            lambda mod, args, out, seen=seen: seen.setdefault(
                "out", out[0] if isinstance(out, tuple) else out
            )
        )
        with torch.no_grad():
            plain(**batch(bert_dir))
        outs.append(seen["out"])
    expected = float((outs[0] - outs[1]).abs().max() / outs[1].abs().max())
    assert expected > 2 * report["accumulated_tolerance"]["scaled_atol"]
    assert layer["cumulative_error"] == pytest.approx(expected, rel=1e-4)
    heading = invoke(bert_dir, tmp_path / "other", *TEXTS, "--include", "encoder.layer.1")
    assert "no origin: every module's own error is within tolerance, yet the" in heading.stdout


def build_other_bert(folder: Path, **changes) -> Path:
    """hf.build_bert's tiny BERT with some of its config changed."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = dict(
        vocab_size=120,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    BertModel(BertConfig(**{**config, **changes})).eval().save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    ("changes", "first"),
    [
        (
            {"hidden_size": 48},
            "'embeddings.word_embeddings.weight' is [120, 48] in it, [120, 32] in '",
        ),
        ({"num_hidden_layers": 3}, "it has a module 'encoder.layer.2' that"),
        ({"num_hidden_layers": 1}, "module 'encoder.layer.1' has no counterpart in it"),
    ],
)
def test_another_architecture_is_refused(bert_dir, tmp_path, changes, first):
    """Issue #23: MiniLM against bert-base ran, and reported 9 origins and 51 replay errors."""
    other = build_other_bert(tmp_path / "other", **changes)
    result = invoke(bert_dir, other, *TEXTS)
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    message = result.stderr.strip()
    assert "\n" not in message and "Traceback" not in message
    assert message.startswith(f"error: '{other}' is not the architecture of '{bert_dir}': ")
    assert first in message
    # With --against too: the second checkpoint's variant is no more its architecture.
    with_variant = invoke(bert_dir, other, *TEXTS, "--against", "bf16")
    assert with_variant.exit_code == 2 and first in with_variant.stderr


def test_out_dir_keeps_dumps_that_diff_reads_the_same(bert6, bert6_fault, tmp_path):
    out = tmp_path / "run"
    junit = tmp_path / "r.xml"
    result = invoke(bert6, bert6_fault, *TEXTS, "--out-dir", out, "--junit", junit, "--json")
    assert result.exit_code == 1
    report = json.loads((out / "report.json").read_text())
    assert report == json.loads(result.stdout)
    again = runner.invoke(
        app, ["diff", str(out / "candidate.safetensors"), str(out / "reference.safetensors")]
    )
    # diff with the tolerance compare judged the cumulative errors with (fp32, widened)
    widened = str(report["accumulated_tolerance"]["scaled_atol"])
    again_json = runner.invoke(
        app,
        ["diff", str(out / "candidate.safetensors"), str(out / "reference.safetensors"), "--json"]
        + ["--preset", "fp32"],
        env={"MODELTAP_SCALED_ATOL": widened},
    )
    assert again.exit_code == 1
    diffed = json.loads(again_json.stdout)
    assert diffed["first_divergence"] == report["cumulative"]["first_divergence"]
    assert diffed["counts"]["failed"] == report["cumulative"]["counts"]["failed"]
    xml = junit.read_text()
    assert 'name="modeltap compare"' in xml and "module encoder.layer.3.output.dense: origin" in xml


def test_stats_only_keeps_no_tensors(bert6, bert6_fault, tmp_path):
    out = tmp_path / "run"
    result = invoke(bert6, bert6_fault, *TEXTS, "--out-dir", out, "--stats-only", "--json")
    assert result.exit_code == 1
    assert [o["module"] for o in json.loads(result.stdout)["origins"]] == [FAULTY]
    assert sorted(p.name for p in out.iterdir()) == [
        "candidate.safetensors",
        "reference.safetensors",
        "report.json",
    ]
    shown = runner.invoke(app, ["show", str(out / "candidate.safetensors")])
    assert shown.exit_code == 0 and "statistics only" in shown.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["hello", "--against", "bf61"], "did you mean 'bf16'?"),
        (["hello"], "'hello' was taken for the CANDIDATE model"),
        ([], "nothing to compare with"),
        (["--against", "bf16"], "nothing to run on"),
        (["hello", "--against", "attn:nonsense"], "attn:nonsense can't be used"),
        (["hello", "--against", "bf16", "--preset", "bf61"], "no tolerance preset 'bf61'"),
    ],
)
def test_errors_are_one_clean_line(bert_dir, args, message):
    result = invoke(bert_dir, *args)
    assert result.exit_code == 2, result.output
    assert message in result.stderr and "Traceback" not in result.output


def test_help_says_what_compare_takes():
    """Issue #23: --help offered archives and factories, and diff's --atol/--rtol defaults."""
    text = " ".join(runner.invoke(app, ["compare", "--help"], terminal_width=80).stdout.split())
    assert "pkg.module:factory" not in text and "not a .pt2 or .pt archive, nor a factory" in text
    assert "1e-8" not in text and "1e-5" not in text
    assert text.count("wins over the preset's [default: the preset's]") == 2
    assert "[default: bf16 or fp16 for those variants, cross-device for cuda" in text
    assert "Rename the candidate's module names to MODEL's" in text
    assert "With --out-dir: the dumps kept there hold statistics only" in text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["pkg.module:factory", "hi", "--against", "bf16"], "MODEL 'pkg.module:factory' is an"),
        (["model.pt2", "hi", "--against", "bf16"], "MODEL 'model.pt2' is an archive or a factory"),
        (["BERT", "model.pt2", "hi"], "CANDIDATE 'model.pt2' is an archive or a factory"),
        (["BERT", "hi", "--against", "bf16", "--stats-only"], "give --out-dir DIR"),
    ],
)
def test_what_compare_cannot_take_is_refused(bert_dir, tmp_path, args, message):
    (tmp_path / "model.pt2").write_bytes(b"")
    args = [str(bert_dir) if a == "BERT" else a for a in args]
    args = [str(tmp_path / a) if a == "model.pt2" else a for a in args]
    message = message.replace("'model.pt2'", f"'{tmp_path / 'model.pt2'}'")
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert message in result.stderr and "Traceback" not in result.output
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_against_cuda(bert_dir):
    result = invoke(bert_dir, *TEXTS, "--against", "cuda", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["candidate"]["device"].startswith("cuda")


def test_accumulated_allowance_comes_from_the_preset(tmp_path, monkeypatch):
    from modeltap.config import Settings, accumulated_allowance, tolerance_values

    monkeypatch.delenv("MODELTAP_CONFIGS", raising=False)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tolerances.toml").write_text(
        "[a]\natol = 1e-5\nrtol = 0.0\naccumulated_scaled_atol = 3e-4\n"
        "[b]\natol = 0.0\nrtol = 0.0\n"
    )
    monkeypatch.chdir(tmp_path)
    s = Settings(accumulated_scaled_atol=2e-5)
    assert accumulated_allowance(s, "a") == 3e-4
    assert accumulated_allowance(s, "b") == 2e-5  # the preset has none: the settings'
    # diff's tolerance never holds it: a Tolerance has no such field
    assert "accumulated_scaled_atol" not in tolerance_values(s, preset="a")
    assert Tolerance(**tolerance_values(s, preset="a")).atol == 1e-5
    # and it widens only cumulative errors, to at least that scaled_atol
    options = Options(tolerance=Tolerance(atol=1e-5, rtol=0.0), accumulated_scaled_atol=3e-4)
    assert options.accumulated(options.tolerance) == Tolerance(1e-5, 0.0, scaled_atol=3e-4)
    wide = Tolerance(atol=0.0, rtol=0.0, scaled_atol=0.05)
    assert options.accumulated(wide) == wide


def test_scale_relative_tolerance():
    """|a - b| <= atol + rtol |b| + scaled_atol max|b|, and a floor on the cosine."""
    b = torch.tensor([100.0, 1.0, 0.0, -50.0])
    a = b + torch.tensor([0.0, 0.5, 0.5, 0.0])  # 0.5 = 0.5% of max |b|
    assert compare("a", "b", a, b, Tolerance(atol=0, rtol=0.01)).out_count == 2
    assert compare("a", "b", a, b, Tolerance(atol=0, rtol=0, scaled_atol=0.006)).ok
    tight = compare("a", "b", a, b, Tolerance(atol=0, rtol=0, scaled_atol=0.004))
    assert tight.out_count == 2
    assert tight.max_scaled == pytest.approx(0.5 / 100)
    flipped = torch.tensor([-100.0, 1.0, 0.0, 50.0])
    loose = Tolerance(atol=1e3, rtol=0)
    cosine = float(torch.nn.functional.cosine_similarity(flipped, b, dim=0))
    assert compare("a", "b", flipped, b, loose).ok
    low = compare("a", "b", flipped, b, Tolerance(atol=1e3, rtol=0, min_cosine=0.99))
    assert low.status == "differs" and low.cosine == pytest.approx(cosine)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["export", "compile"])
def test_backends_replay_at_the_depth_asked(bert6, bert6_fault, backend):
    result = invoke(bert6, bert6_fault, *TEXTS, "--against", backend, "--depth", "3", "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert report["replay"]["depth"] == 3 and backend in report["replay"]["note"]
    assert report["candidate"]["variant"] == backend
    assert [o["module"] for o in report["origins"]] == ["encoder.layer.3"]
    modules = {m["module"]: m for m in report["modules"]}
    assert modules["encoder.layer.4"]["verdict"] == "inherited"
    assert modules["encoder.layer.2"]["verdict"] == "ok"


def test_backends_need_a_depth(bert_dir):
    result = invoke(bert_dir, "hello", "--against", "export")
    assert result.exit_code == 2
    assert "--against export replays at one depth: give --depth N" in result.stderr


class Block(torch.nn.Module):
    """Two selected children (a small MLP), then its own code: a residual add and a LayerNorm
    written with F.layer_norm, so that only the block itself can err in it."""

    def __init__(self, width: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(width))
        self.bias = torch.nn.Parameter(0.1 * torch.randn(width))
        self.eps = eps

    def forward(self, x):
        h = self.down(torch.nn.functional.gelu(self.up(x)))
        return torch.nn.functional.layer_norm(x + h, x.shape[-1:], self.weight, self.bias, self.eps)


class Stack(torch.nn.Module):
    def __init__(self, block: type[torch.nn.Module] = Block, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([block(width), block(width)])
        self.head = torch.nn.Linear(width, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def compare_stack(reference, candidate, x, tolerance):
    return compare_models(
        reference,
        candidate,
        Inputs((x,), {}, {}),
        select_modules(reference, Selection()),
        Path.cwd(),
        options=Options(tolerance=tolerance),
    )


def test_a_parents_local_error_is_its_own_codes():
    """A candidate whose first block's LayerNorm has another eps, and whose `up` weights are
    0.3% off (within tolerance): the block is the only origin, and its local error is that of
    its own code alone (the residual add and the LayerNorm on the reference's input and its
    children's reference outputs), not that of the whole block with its children."""
    reference = Stack().eval()
    candidate = copy.deepcopy(reference)
    candidate.blocks[0].eps = 0.1
    with torch.no_grad():
        candidate.blocks[0].up.weight *= 1.003
    torch.manual_seed(1)
    x = torch.randn(3, 5, 16)
    report = compare_stack(reference, candidate, x, Tolerance(atol=0, rtol=0, scaled_atol=0.01))
    by_name = {m.name: m for m in report.modules}
    assert [m.name for m in report.origins] == ["blocks.0"]
    assert by_name["blocks.0"].replay == "short_circuit"
    assert by_name["blocks.0.up"].verdict == "ok" and by_name["blocks.0.up"].local_error > 1e-3
    assert by_name["blocks.0.down"].verdict == "ok"
    assert by_name["blocks.1"].local_error == 0.0  # the same code on the same inputs
    assert by_name["__root__"].holds_origin and not by_name["__root__"].origin

    block = reference.blocks[0]
    with torch.no_grad():
        h = block.down(torch.nn.functional.gelu(block.up(x)))  # the children's reference outputs
        want = block(x)
        got = torch.nn.functional.layer_norm(x + h, (16,), block.weight, block.bias, 0.1)
        whole = candidate.blocks[0](x)  # the block with its children computed again
    expected = float((got - want).abs().max() / want.abs().max())
    assert by_name["blocks.0"].local_error == pytest.approx(expected, rel=1e-5)
    whole_error = float((whole - want).abs().max() / want.abs().max())
    assert whole_error != pytest.approx(expected, rel=1e-4)


class InPlaceBlock(torch.nn.Module):
    """Changes its child's output in place after the child returned it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(width, width)

    def forward(self, x):
        h = self.inner(x)
        h += x
        return torch.tanh(h)


def test_a_child_output_changed_in_place_falls_back_to_a_full_replay():
    reference = Stack(InPlaceBlock).eval()
    candidate = copy.deepcopy(reference)
    with torch.no_grad():
        candidate.blocks[0].inner.weight[0] *= 1.5  # a fault in the in-place block's child
    torch.manual_seed(1)
    report = compare_stack(reference, candidate, torch.randn(3, 16), Tolerance(atol=1e-5))
    by_name = {m.name: m for m in report.modules}
    for name in ("blocks.0", "blocks.1"):
        block = by_name[name]
        # A stand-in would hand the replay `inner`'s output with the residual already added in.
        assert block.replay == "full" and block.valid, name
        assert "output was changed in place" in block.replay_note
        assert report.to_json()["full_replay"][name] == block.replay_note
    assert by_name["head"].replay == "leaf" and by_name["__root__"].replay == "short_circuit"
    from modeltap.render import compare_heading

    assert "; 2 in full (children computed again" in compare_heading(report).plain
    # Replayed in full, the block measures its child's error too: it is not an origin.
    assert [m.name for m in report.origins] == ["blocks.0.inner"]
    assert by_name["blocks.0"].verdict == "via_child" and by_name["blocks.0"].local_out
    assert by_name["blocks.1"].verdict == "inherited"


class CountingLinear(torch.nn.Linear):
    calls = 0

    def forward(self, x):
        CountingLinear.calls += 1
        return super().forward(x)


class CountingBlock(Block):
    def __init__(self, width: int) -> None:
        super().__init__(width)
        self.up = CountingLinear(width, 2 * width)


def test_short_circuited_children_are_not_computed_again():
    """Each `up` runs in the reference's forward, in the candidate's, and in its own two
    replays (reference and candidate): its parents' replays (the block, the root) don't run it."""
    reference = Stack(CountingBlock).eval()
    candidate = make_candidate(reference, parse_against(None), shared=True)
    CountingLinear.calls = 0
    report = compare_stack(reference, candidate, torch.randn(3, 16), Tolerance())
    assert report.passed
    assert CountingLinear.calls == 2 * 4
    assert {m.replay for m in report.modules if m.name.startswith("blocks.")} == {
        "short_circuit",
        "leaf",
    }
    assert type(reference.blocks[0].up).forward is CountingLinear.forward
    assert "forward" not in vars(reference.blocks[0].up)  # the stand-ins are gone
    assert "forward" not in vars(candidate.blocks[0].up)
