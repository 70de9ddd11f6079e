import json
from xml.etree import ElementTree as ET

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from typer.testing import CliRunner

from modeltap.cli import app
from modeltap.diff import Tolerance, apply_map, compare, diff_dumps, parse_map
from modeltap.dumping import dump_model
from modeltap.loading import Inputs
from tests.fixtures.backends import OTHER_GRAPH

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, ["diff", *[str(a) for a in args]])


def copy_with(src, dst, change):
    """Write dst as src with `change(tensors)` applied, metadata kept: a hand-made candidate."""
    with safe_open(str(src), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    change(tensors)
    save_file(tensors, str(dst), metadata=meta)
    return dst


@pytest.fixture(scope="module")
def bert(bert_dir):
    from transformers import AutoTokenizer, BertModel

    model = BertModel.from_pretrained(bert_dir).eval()
    batch = dict(AutoTokenizer.from_pretrained(bert_dir)(["hello world"], return_tensors="pt"))
    return model, Inputs((), batch, {"texts": ["hello world"]})


@pytest.fixture
def ref(bert, tmp_path):
    model, inputs = bert
    return dump_model(model, inputs, tmp_path / "ref.safetensors")


def test_identical_dumps_pass(ref):
    result = invoke(ref, ref)
    assert result.exit_code == 0, result.output
    assert "PASS" in result.stdout


def test_one_changed_value_fails_and_is_named(ref, tmp_path):
    def change(t):
        t["encoder.layer.0.intermediate.dense"][0, 1, 2] += 0.5

    new = copy_with(ref, tmp_path / "new.safetensors", change)
    result = invoke(ref, new, "--json")
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert report["first_divergence"] == "encoder.layer.0.intermediate.dense"
    (failed,) = [p for p in report["pairs"] if p["status"] != "ok"]
    assert failed["out_count"] == 1 and failed["max_abs"] == pytest.approx(0.5, rel=1e-5)


def test_perturbed_weight_names_its_module_first_not_downstream(bert, ref, tmp_path):
    model, inputs = bert
    dense = model.encoder.layer[1].attention.output.dense
    saved = dense.weight.detach().clone()
    with torch.no_grad():
        dense.weight[0, 0] += 1.0
    try:
        new = dump_model(model, inputs, tmp_path / "new.safetensors")
    finally:
        with torch.no_grad():
            dense.weight.copy_(saved)
    report = diff_dumps(ref, new)
    assert not report.passed
    assert report.first_divergence.key == "encoder.layer.1.attention.output.dense"
    failed = [p.key for p in report.failed]
    assert "encoder.layer.1.output.LayerNorm" in failed  # downstream, but not first
    assert all(
        not k.startswith("encoder.layer.0") and not k.startswith("embeddings") for k in failed
    )
    result = invoke(ref, new)
    assert "first divergence: encoder.layer.1.attention.output.dense" in result.stdout


@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_metrics_match_an_independent_computation(kind):
    torch.manual_seed(0)
    b = torch.randn(50, 40)
    a = b + torch.randn(50, 40) * 1e-3
    args = (a, b) if kind == "torch" else (a.numpy(), b.numpy())
    pair = compare("k", "k", *args, Tolerance(atol=1e-4, rtol=1e-3))
    d, y = (a - b).double().abs(), b.double().abs()
    assert pair.max_abs == pytest.approx(float(d.max()), rel=1e-6)
    assert pair.mean_abs == pytest.approx(float(d.mean()), rel=1e-5)
    assert pair.max_rel == pytest.approx(float((d / y).max()), rel=1e-5)
    assert pair.mean_rel == pytest.approx(float((d / y).mean()), rel=1e-5)
    cos = torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0)
    assert pair.cosine == pytest.approx(float(cos), abs=1e-9)
    expected_out = int((~torch.isclose(a, b, rtol=1e-3, atol=1e-4)).sum())
    assert pair.out_count == expected_out and 0 < expected_out < a.numel()


@pytest.mark.parametrize("case", ["finite", "zeros", "nan", "inf", "scaled", "complex"])
def test_numpy_and_torch_give_the_same_pair(case):
    """diff reads dumps as numpy arrays (no torch to import); compare gets tensors in memory.
    Both go through one code: every field must agree."""
    torch.manual_seed(1)
    b = torch.randn(30, 20)
    a = b + torch.randn(30, 20) * 1e-4
    tol = Tolerance(atol=1e-5, rtol=1e-4, min_cosine=0.999)
    if case == "zeros":
        b[::3] = 0.0
    elif case == "nan":
        a[1, 2] = b[1, 3] = b[4, 4] = a[4, 4] = float("nan")
    elif case == "inf":
        a[2, 2] = float("inf")
        b[2, 2] = float("inf")
        a[3, 3] = float("-inf")
    elif case == "scaled":
        tol = Tolerance(atol=0.0, rtol=0.0, scaled_atol=1e-4)
    elif case == "complex":
        a, b = torch.complex(a, b), torch.complex(b, a)
    with_torch = compare("k", "k", a, b, tol)
    with_numpy = compare("k", "k", a.numpy(), b.numpy(), tol)
    one, two = with_torch.to_json(), with_numpy.to_json()
    assert one.keys() == two.keys()
    for name, value in one.items():
        if isinstance(value, float):
            assert two[name] == pytest.approx(value, rel=1e-6, abs=1e-12), name
        else:
            assert two[name] == value, name
    assert with_torch.status == with_numpy.status


def test_bfloat16_dumps_are_read_exactly_without_torch(tmp_path):
    from modeltap.dump import load_dump

    torch.manual_seed(0)
    x = torch.randn(6, 7).to(torch.bfloat16)
    x[0, 0], x[0, 1] = float("nan"), float("-inf")
    save_file({"x": x, "h": x.to(torch.float16)}, tmp_path / "a.safetensors")
    dump = load_dump(tmp_path / "a.safetensors")
    array, name = dump.array("x")
    assert name == "bfloat16" and array.dtype.name == "float32"
    same = torch.from_numpy(array.copy()).view(torch.int32)
    assert torch.equal(same, x.float().view(torch.int32))  # to the bit, NaN's payload too
    assert dump.array("h")[1] == "float16"
    # A bf16 dump against a float32 one is a dtype difference, as with tensors.
    save_file({"x": x.float(), "h": x.to(torch.float16)}, tmp_path / "b.safetensors")
    report = diff_dumps(tmp_path / "a.safetensors", tmp_path / "b.safetensors", equal_nan=True)
    assert {p.key: p.status for p in report.pairs} == {"x": "dtype", "h": "ok"}
    upcast = diff_dumps(tmp_path / "a.safetensors", tmp_path / "b.safetensors", upcast=True)
    pair = next(p for p in upcast.pairs if p.key == "x")
    assert (pair.dtype, pair.other_dtype, pair.max_abs) == ("bfloat16", "float32", 0.0)


def test_diff_command_never_imports_torch(ref, tmp_path):
    import subprocess
    import sys

    other = copy_with(
        ref,
        tmp_path / "b.safetensors",
        lambda t: t.__setitem__(next(iter(t)), next(iter(t.values())) + 1.0),
    )
    code = (
        "import sys\n"
        "from modeltap.cli import main\n"
        f"sys.argv = ['modeltap', 'diff', {str(ref)!r}, {str(other)!r}]\n"
        "try:\n    main()\n"
        "except SystemExit as e:\n    code = e.code\n"
        "print('torch' in sys.modules, code, file=sys.stderr)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stderr.split()[-2:] == ["False", "1"], out.stderr[-2000:]
    assert "DIFFERS" in out.stdout or "FIRST" in out.stdout


def test_nan_on_one_side_and_equal_nan(tmp_path):
    x = torch.tensor([[1.0, float("nan")], [3.0, 4.0]])
    save_file({"t": x}, tmp_path / "a.safetensors")
    save_file({"t": torch.tensor([[1.0, 2.0], [3.0, 4.0]])}, tmp_path / "b.safetensors")
    report = diff_dumps(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert report.pairs[0].nan_mismatch == 1 and not report.passed
    assert invoke(tmp_path / "a.safetensors", tmp_path / "a.safetensors").exit_code == 1
    assert (
        invoke(tmp_path / "a.safetensors", tmp_path / "a.safetensors", "--equal-nan").exit_code == 0
    )


def test_shape_and_dtype_mismatch_are_reported_not_crashes(tmp_path):
    save_file({"s": torch.ones(2, 3), "d": torch.ones(4)}, tmp_path / "a.safetensors")
    save_file(
        {"s": torch.ones(3, 2), "d": torch.ones(4, dtype=torch.float64)}, tmp_path / "b.safetensors"
    )
    report = diff_dumps(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert {p.key: p.status for p in report.pairs} == {"s": "shape", "d": "dtype"}
    upcast = diff_dumps(tmp_path / "a.safetensors", tmp_path / "b.safetensors", upcast=True)
    assert {p.key: p.status for p in upcast.pairs} == {"s": "shape", "d": "ok"}
    assert invoke(tmp_path / "a.safetensors", tmp_path / "b.safetensors").exit_code == 1


def test_missing_and_extra_keys_with_and_without_strict(ref, tmp_path):
    def change(t):
        t.pop("pooler.dense")
        t["extra"] = torch.zeros(2)

    new = copy_with(ref, tmp_path / "new.safetensors", change)
    lenient = invoke(ref, new, "--json")
    report = json.loads(lenient.stdout)
    assert lenient.exit_code == 0
    assert "pooler.dense" in report["only_a"] and report["only_b"] == ["extra"]
    assert invoke(ref, new, "--strict").exit_code == 1


def test_plain_safetensors_compare_by_key_without_order(tmp_path):
    save_file({"x": torch.ones(3), "y": torch.zeros(2)}, tmp_path / "a.safetensors")
    save_file({"x": torch.ones(3), "y": torch.ones(2)}, tmp_path / "b.safetensors")
    report = diff_dumps(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert [p.key for p in report.failed] == ["y"] and report.first_divergence is None
    result = invoke(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert result.exit_code == 1 and "no execution order" in result.stdout


def test_map_renames_across_a_prefix(tmp_path):
    save_file(
        {"bert.encoder": torch.ones(3), "cls.head": torch.ones(2)}, tmp_path / "a.safetensors"
    )
    save_file({"encoder": torch.ones(3)}, tmp_path / "b.safetensors")
    result = invoke(
        tmp_path / "a.safetensors",
        tmp_path / "b.safetensors",
        "--map",
        "bert.*=*",
        "--include",
        "bert.*",
        "--json",
    )
    report = json.loads(result.stdout)
    assert result.exit_code == 0
    assert [(p["key"], p["other"]) for p in report["pairs"]] == [("bert.encoder", "encoder")]
    assert report["only_a"] == [] and report["only_b"] == []


def test_traced_elsewhere_pairs_with_eager_across_output_structure(bert, bert_dir, tmp_path):
    """A plain torch.jit.trace keeps ModelOutputs and (tensor, None) tuples by position."""
    model, inputs = bert
    ids, mask = inputs.kwargs["input_ids"], inputs.kwargs["attention_mask"]
    torch.jit.save(torch.jit.trace(model, (ids, mask), strict=False), tmp_path / "plain.pt")
    save_file({"input_ids": ids, "attention_mask": mask}, tmp_path / "ids.safetensors")
    traced = tmp_path / "traced.safetensors"
    args = ["--input-file", str(tmp_path / "ids.safetensors"), "-o", str(traced)]
    assert runner.invoke(app, ["dump", str(tmp_path / "plain.pt"), *args]).exit_code == 0
    eager = dump_model(model, inputs, tmp_path / "eager.safetensors")

    # the trace is another graph: equal to eager up to float32 rounding, not to the bit
    tol = ["--atol", str(OTHER_GRAPH["atol"]), "--rtol", str(OTHER_GRAPH["rtol"])]
    result = invoke(eager, traced, "--json", *tol, "--junit", "r.xml")
    report = json.loads(result.stdout)
    assert result.exit_code == 0, result.output
    assert report["only_a"] == [] and report["only_b"] == []
    matches = {m["key"]: m["other"] for m in report["matches"]}
    assert all(m["match"] == "structural" for m in report["matches"])
    assert matches["encoder:last_hidden_state"] == "encoder"
    assert matches["encoder.layer.0.attention.self:0"] == "encoder.layer.0.attention.self"
    assert report["counts"]["structural"] == len(matches) == 5
    # what B holds under each paired key is what the eager module returned, by its own hooks
    seen = {}
    hooks = [
        m.register_forward_hook(lambda mod, i, o, name=name: seen.setdefault(name, o))
        for name, m in model.named_modules()
    ]
    with torch.no_grad():
        model(**inputs.kwargs)
    for h in hooks:
        h.remove()
    with safe_open(str(traced), framework="pt") as f:
        aliases = json.loads(f.metadata()["aliases"])
        for key, other in matches.items():
            module, _, part = key.partition(":")
            want = (
                seen[module].last_hidden_state if part == "last_hidden_state" else seen[module][0]
            )
            torch.testing.assert_close(f.get_tensor(aliases.get(other, other)), want, **OTHER_GRAPH)
    text = invoke(eager, traced).stdout
    assert "5 keys paired across named and positional outputs" in " ".join(text.split())
    case = next(c for c in ET.parse("r.xml").getroot() if c.find("properties") is not None)
    props = {p.get("name"): p.get("value") for p in case.iter("property")}
    assert props["match"] == "structural" and props["other"] == matches[case.get("name")]


def test_structural_pairing_needs_equal_shapes_and_one_positional_side(tmp_path):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    h, p = torch.randn(2, 3), torch.randn(2)
    named = {
        "__root__:pooler_output": p,  # the output's order, told by the recorded order below
        "__root__:hidden": h,
        "short:0": torch.ones(4),
        "named:x": torch.ones(2),
    }
    meta = {"format": "modeltap", "format_version": "1", "order": json.dumps(list(named))}
    save_file(named, a, metadata=meta)
    positional = {
        "__root__:1": h.clone(),
        "__root__:0": p.clone(),
        "short": torch.ones(5),
        "named:y": torch.ones(2),
    }
    save_file(positional, b)
    report = diff_dumps(a, b)
    assert report.matches == [
        ("__root__:pooler_output", "__root__:0", "structural"),
        ("__root__:hidden", "__root__:1", "structural"),
    ]
    assert [p.status for p in report.pairs] == ["ok", "ok"]
    assert sorted(report.only_a) == ["named:x", "short:0"]
    assert sorted(report.only_b) == ["named:y", "short"]
    assert diff_dumps(a, b, structural=False).pairs == []
    # without a recorded order, names are only sorted: several of them pair with nothing
    save_file(named, a)
    assert diff_dumps(a, b).matches == []
    # one named part needs no order
    save_file({"enc:last_hidden_state": h}, a)
    save_file({"enc": h.clone()}, b)
    assert diff_dumps(a, b).matches == [("enc:last_hidden_state", "enc", "structural")]


def test_map_file_renames_modules_and_keys(tmp_path):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    x = torch.randn(3)
    save_file({"bert.attn": x, "bert.attn.q": x + 1, "bert.attn@1:0": x + 2, "head:out": x + 3}, a)
    save_file(
        {
            "model.attention": x,
            "model.attention.q": x + 1,
            "model.attention@1:0": x + 2,
            "lm_head": x + 3,
        },
        b,
    )
    (tmp_path / "map.toml").write_text(
        '# A -> B\n[keys]\n"head:*" = "lm_head"\n[modules]\n"bert.attn" = "model.attention"\n'
    )
    result = invoke(a, b, "--map", tmp_path / "map.toml", "--json")
    report = json.loads(result.stdout)
    assert result.exit_code == 0, result.output
    assert report["only_a"] == [] and report["only_b"] == []
    assert {m["key"]: m["other"] for m in report["matches"]} == {
        "bert.attn": "model.attention",
        "bert.attn.q": "model.attention.q",
        "bert.attn@1:0": "model.attention@1:0",
        "head:out": "lm_head",
    }
    assert {p["match"] for p in report["pairs"]} == {"mapped"}
    assert "4 keys paired by --map" in invoke(a, b, "--map", tmp_path / "map.toml").stdout
    # the same as JSON, with a glob over module names
    (tmp_path / "map.json").write_text(
        json.dumps({"modules": {"*.attn": "model.attention"}, "keys": {"head:out": "lm_head"}})
    )
    with_glob = diff_dumps(a, b, rename=[str(tmp_path / "map.json")])
    assert not with_glob.only_a and not with_glob.only_b
    # a module's `*` stays within one dotted name; its calls, parts and children follow it
    (tmp_path / "prefix.json").write_text(json.dumps({"modules": {"b*": "model"}}))
    rules = parse_map([str(tmp_path / "prefix.json")])
    assert apply_map("bert.attn@1:0", rules) == "model.attn@1:0"
    assert apply_map("bertx", rules) == "model" and apply_map("abert", rules) == "abert"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (None, "no --map file"),
        ("[modules\n", "is not valid TOML"),
        ("[renames]\na = 'b'\n", "holds tables [keys] and/or [modules] only"),
        ("[keys]\na = 1\n", "[keys] maps names to names"),
        ("[modules]\na = '*'\n", "has more '*' than"),
    ],
)
def test_bad_map_files_exit_2_with_one_line(ref, tmp_path, text, message):
    path = tmp_path / "map.toml"
    if text is not None:
        path.write_text(text)
    result = invoke(ref, ref, "--map", path)
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert message in line and str(path) in line


def test_junit_counts(ref, tmp_path):
    def change(t):
        t["embeddings.word_embeddings"] += 1.0
        t.pop("pooler.dense")

    new = copy_with(ref, tmp_path / "new.safetensors", change)
    result = invoke(ref, new, "--junit", tmp_path / "report.xml", "--strict")
    assert result.exit_code == 1
    suite = ET.parse(tmp_path / "report.xml").getroot()
    cases = suite.findall("testcase")
    report = diff_dumps(ref, new, strict=True)
    assert int(suite.get("tests")) == len(cases) == len(report.pairs) + 1
    failed = [c.get("name") for c in cases if c.find("failure") is not None]
    assert int(suite.get("failures")) == len(failed) == len(report.failed) + 1
    assert "embeddings.word_embeddings" in failed and "pooler.dense" in failed
    assert "max abs" in cases[0].find("failure").get("message") or failed


def test_preset_from_configs_and_overrides(tmp_path):
    from pathlib import Path

    save_file({"x": torch.tensor([1.0, 2.0])}, tmp_path / "a.safetensors")
    save_file({"x": torch.tensor([1.001, 2.0])}, tmp_path / "b.safetensors")
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    assert invoke(a, b, "--preset", "exact").exit_code == 1
    assert invoke(a, b, "--preset", "bf16").exit_code == 0  # rtol 1.6e-2 from configs/
    presets = Path(__file__).resolve().parent.parent / "configs" / "tolerances.toml"
    assert "[bf16]" in presets.read_text()
    (tmp_path / "modeltap.toml").write_text(
        '[diff]\natol = 0.0\nrtol = 0.0\n[diff.overrides]\n"x" = { atol = 0.01 }\n'
    )
    assert invoke(a, b).exit_code == 0
    result = invoke(a, b, "--preset", "bf61")
    assert result.exit_code == 2 and "did you mean 'bf16'" in result.stderr


def test_a_cross_dtype_preset_compares_bfloat16_with_float32(tmp_path):
    """--preset bf16 is for a bfloat16 run against a float32 one: values compared, not dtypes."""
    ref = torch.linspace(-3, 3, 64)
    low = ref.to(torch.bfloat16)
    save_file({"x": low, "far": low + 1}, tmp_path / "bf16.safetensors")
    save_file({"x": ref, "far": ref.clone()}, tmp_path / "ref.safetensors")
    a, b = tmp_path / "bf16.safetensors", tmp_path / "ref.safetensors"
    result = invoke(a, b, "--preset", "bf16", "--json")
    pairs = {p["key"]: p for p in json.loads(result.stdout)["pairs"]}
    assert {k: p["status"] for k, p in pairs.items()} == {"x": "ok", "far": "differs"}
    want = (low.float() - ref).abs().max().item()  # bfloat16 rounding, computed here
    assert pairs["x"]["max_abs"] == pytest.approx(want, rel=1e-6) and want > 0
    assert result.exit_code == 1
    statuses = json.loads(invoke(a, b, "--preset", "bf16", "--no-upcast", "--json").stdout)
    assert {p["status"] for p in statuses["pairs"]} == {"dtype"}
    assert {
        p["status"] for p in json.loads(invoke(a, b, "--preset", "fp32", "--json").stdout)["pairs"]
    } == {"dtype"}


def test_different_inputs_are_a_warning(bert, ref, tmp_path):
    model, inputs = bert
    other = Inputs((), inputs.kwargs, {"texts": ["something else"]})
    new = dump_model(model, other, tmp_path / "new.safetensors")
    result = invoke(ref, new)
    assert result.exit_code == 0 and "warning: inputs differs" in result.stdout


@pytest.mark.parametrize("kind", ["truncated", "garbage", "missing"])
def test_unreadable_files_exit_2_cleanly(ref, tmp_path, kind):
    bad = tmp_path / "bad.safetensors"
    if kind == "truncated":
        bad.write_bytes(ref.read_bytes()[: len(ref.read_bytes()) // 2])
    elif kind == "garbage":
        bad.write_bytes(bytes(range(256)) * 8)
    result = invoke(ref, bad)
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and "Traceback" not in result.output


def test_bad_options_exit_2(ref, tmp_path):
    result = invoke(ref, ref, "--map", "nonsense")
    assert result.exit_code == 2 and "OLD=NEW" in result.stderr
    result = invoke(ref, ref, "--atol", "-1")
    assert result.exit_code == 2


def test_table_keeps_every_number_column_at_80_columns(ref, tmp_path):
    from rich.console import Console

    from modeltap.render import diff_table

    def change(t):
        for key in t:
            if key.startswith("encoder.layer.0.attention.output"):
                t[key] = t[key] * 2

    new = copy_with(ref, tmp_path / "new.safetensors", change)
    console = Console(width=80, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(diff_table(diff_dumps(ref, new), width=80))
    lines = console.export_text().splitlines()
    assert lines[0].split() == ["key", "status", "max", "abs", "max", "rel", "cosine", "out"]
    assert all(len(line) <= 80 for line in lines)
    assert "…" in lines[1] and lines[1].rstrip().endswith("%")  # key cut, numbers whole


def test_all_nan_pair_with_junit_says_nan_and_suggests_equal_nan(tmp_path):
    # A NaN model diffed with itself: no finite position at all, the case the CI recipe is for.
    save_file({"t": torch.full((2, 3), float("nan"))}, tmp_path / "n.safetensors")
    junit = tmp_path / "r.xml"
    result = invoke(tmp_path / "n.safetensors", tmp_path / "n.safetensors", "--junit", junit)
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert "NaN" in result.output and "--equal-nan" in result.output
    failure = ET.parse(junit).getroot().find("testcase/failure")
    assert "6 NaN mismatches" in failure.get("message")
    assert "--equal-nan" in failure.get("message")


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(5, 7),
        torch.zeros(4),
        torch.tensor([0.0, -3.0, 2.0]),
        torch.randn(6).bfloat16(),
        torch.tensor([1.0, float("inf")]),  # not finite: the passes decide
    ],
)
def test_equal_tensors_skip_the_passes_with_the_same_result(tensor, monkeypatch):
    """Two equal tensors are compared without the metric passes: every field as the passes
    would fill it (checked by turning the shortcut off)."""
    from dataclasses import asdict

    import modeltap.diff.pairs

    tol = Tolerance(atol=1e-6, rtol=1e-3, scaled_atol=0.05, min_cosine=0.999)
    fast = compare("a", "b", tensor, tensor.clone(), tol)
    monkeypatch.setattr(modeltap.diff.pairs, "_identical", lambda *args: False)
    slow = compare("a", "b", tensor, tensor.clone(), tol)
    assert asdict(fast) == asdict(slow)
    assert fast.ok


def test_of_limit_is_each_pairs_margin_to_its_own_rule():
    """`of_limit`: max |a - b| / (atol + scaled_atol * max|b| + rtol * |b|), computed here; above
    1 exactly when an element is out of tolerance. `margin` adds the cosine's share."""
    from modeltap.diff import margin

    torch.manual_seed(0)
    b = torch.randn(64, 16)
    a = b + 1e-3 * torch.randn(64, 16)
    for tol in (Tolerance(1e-8, 1e-5), Tolerance(1e-5, 1e-2, scaled_atol=1e-3), Tolerance(0, 0)):
        pair = compare("a", "b", a, b, tol)
        limit = tol.atol + tol.scaled_atol * b.abs().max() + tol.rtol * b.abs()
        expected = float(((a - b).abs().double() / limit.double()).max())
        assert pair.of_limit == pytest.approx(expected, rel=1e-5)
        assert (pair.of_limit > 1) == (not pair.ok)
    loose = Tolerance(1.0, 0.0, min_cosine=0.9999)
    pair = compare("a", "b", a, b, loose)
    x, y = a.flatten().double(), b.flatten().double()
    cosine = float(x @ y / (x.norm() * y.norm()))
    assert pair.of_limit < 1 and pair.ok
    assert margin(pair, loose) == pytest.approx((1 - cosine) / (1 - 0.9999), rel=1e-3)
    nan = b.clone()
    nan[0, 0] = float("nan")
    assert compare("a", "b", b, nan, Tolerance()).of_limit == float("inf")


def _run_index(folder, norms: dict[str, float]) -> None:
    """A run folder of one recorded step whose keys have these norms (absmax alike)."""
    folder.mkdir()
    start = {"event": "start", "rank": 0, "world_size": 1, "backend": "none", "every": 1}
    keys = {k: {"norm": v, "absmax": v} for k, v in norms.items()}
    step = {"event": "step", "step": 0, "file": "step000000.rank0.safetensors", "full": False,
            "keys": keys}  # fmt: skip
    lines = [json.dumps(start), json.dumps(step)]
    (folder / "index.rank0.jsonl").write_text("\n".join(lines) + "\n")


def test_run_diff_names_the_key_farthest_past_its_own_limit(tmp_path):
    """A key near zero differs by half of itself, well inside atol; another by 1e-3 of itself,
    ten times its limit: the step's worst key is the second (it was the first)."""
    _run_index(tmp_path / "a", {"tiny": 1e-13, "big": 10.01, "same": 3.0})
    _run_index(tmp_path / "b", {"tiny": 2e-13, "big": 10.0, "same": 3.0})
    atol, rtol = 1e-8, 1e-5

    def of_limit(a: float, b: float) -> float:
        return abs(a - b) / (atol + rtol * abs(b))

    assert of_limit(1e-13, 2e-13) < 1 < of_limit(10.01, 10.0)
    result = runner.invoke(app, ["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json"])
    assert result.exit_code == 1, result.output
    step = json.loads(result.stdout)["steps"][0]
    assert step["failed"] == ["big"] and step["worst"] == "big"
    assert step["worst_of_limit"] == pytest.approx(of_limit(10.01, 10.0), rel=1e-9)
    text = runner.invoke(app, ["diff", str(tmp_path / "a"), str(tmp_path / "b")]).stdout
    header = next(line for line in text.splitlines() if "step rank" in line)
    assert "|a-b| / (atol + rtol*|b|)" in header
    row = next(line for line in text.splitlines() if line.split()[:2] == ["0", "0"])
    assert row.split()[-1] == "big" and "tiny" not in text


@pytest.mark.parametrize("tol", [Tolerance(1e-3, 1e-2), Tolerance(0.0, 0.0), Tolerance(0.1, 0.0)])
def test_one_number_against_another_is_torch_isclose(tol):
    """`close`, the rule every diff of statistics applies (generation steps without tensors, run
    folders), is torch.isclose on one number, infinities and NaN included (equal_nan=False, but
    NaN matches NaN: a statistic that is NaN on both sides did not change)."""
    from modeltap.diff.tolerance import close

    inf, nan = float("inf"), float("nan")
    values = [0.0, 1.0, 1.0005, 1.02, -1.0, 1e-9, 100.0, 100.5, inf, -inf, nan]
    for x in values:
        for y in values:
            expected = bool(
                torch.isclose(
                    torch.tensor(x, dtype=torch.float64),
                    torch.tensor(y, dtype=torch.float64),
                    rtol=tol.rtol,
                    atol=tol.atol,
                    equal_nan=True,
                )
            )
            assert close(x, y, tol) == expected, (x, y)
    assert close(None, None, tol) and not close(1.0, None, tol)


def test_a_generation_step_by_statistics_fails_a_norm_that_is_infinite_on_one_side():
    """A step compared by statistics (one side kept no tensors): a norm that overflowed on the
    reference's side only is out of tolerance, as torch.isclose(1.0, inf) says (it passed, with
    rtol > 0, while the step used its own copy of the rule)."""
    from types import SimpleNamespace

    from modeltap.diff.generations import _by_statistics

    def side(norm):
        stats = SimpleNamespace(norm=norm, mean=0.5, absmax=2.0)
        return SimpleNamespace(keys=lambda: ["k"], stats_for=lambda key: stats)

    tol = Tolerance(1e-5, 1.3e-6)
    assert not bool(torch.isclose(torch.tensor(1.0), torch.tensor(float("inf")), 1.3e-6, 1e-5))
    step = _by_statistics(0, side(1.0), side(float("inf")), tol)
    assert (step.compared, step.failed, step.first) == (1, 1, "k")
    assert _by_statistics(0, side(1.0), side(1.0 + 1e-7), tol).failed == 0


def test_the_diff_verb_judges_two_dumps_as_torch_does(tmp_path):
    """`modeltap.diff(a, b, preset=...)` on two dumps of a model whose weight moved by a known
    amount: the verdict is torch.allclose's under the preset's tolerance, and the largest error
    is max |a - b| of the outputs computed here with plain torch."""
    import modeltap
    from modeltap.config import read_preset

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    x = torch.randn(3, 8)
    inputs = Inputs((x,), {}, {})
    ref = dump_model(model.eval(), inputs, tmp_path / "ref.safetensors")
    with torch.no_grad():
        out_b = model(x)
        model[2].weight[1, 2] += 1e-3
        out_a = model(x)
    new = dump_model(model, inputs, tmp_path / "new.safetensors")

    fp32 = read_preset("fp32")
    report = modeltap.diff(new, ref, preset="fp32")
    assert report.passed is torch.allclose(out_a, out_b, atol=fp32["atol"], rtol=fp32["rtol"])
    assert not report.passed and report.first_divergence.key == "2"
    (last,) = [p for p in report.pairs if p.key == "2"]
    assert last.max_abs == pytest.approx(float((out_a - out_b).abs().max()), rel=1e-5)
    assert [p.key for p in report.failed] == ["2"]  # the layers before it are untouched
    loose = modeltap.diff(new, ref, preset="fp32", atol=1e-2)
    assert loose.passed is torch.allclose(out_a, out_b, atol=1e-2, rtol=fp32["rtol"]) is True
    assert modeltap.diff(new, ref, overrides={"2": {"atol": 1e-2}}, preset="fp32").passed


def test_the_diff_verb_is_the_package_whichever_import_comes_first(tmp_path):
    """`modeltap.diff` is one object, the package and the verb: a submodule imported first
    (which binds the package on `modeltap`) leaves the verb callable, and the package's names
    reachable as attributes."""
    import subprocess
    import sys

    code = (
        "import modeltap.diff.dumps, modeltap, inspect; import modeltap.diff as d; "
        "from modeltap import diff; "
        "print(d is diff is modeltap.diff, callable(diff), diff.diff_dumps.__name__, "
        "list(inspect.signature(diff).parameters)[:3], 'torch' in __import__('sys').modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    expected = ["True", "True", "diff_dumps", "['a',", "'b',", "'preset']", "False"]
    assert out.stdout.split() == expected
    code = "import modeltap; print(callable(modeltap.diff), 'diff' in modeltap.__all__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"]  # the facade names it before any import of it


def test_the_diff_verb_refuses_dump_options_for_run_folders(tmp_path):
    import modeltap
    from modeltap.errors import InputError

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with pytest.raises(InputError, match="include can't apply to run folders"):
        modeltap.diff(tmp_path / "a", tmp_path / "b", include=["x*"])
    with pytest.raises(InputError, match="not one of each"):
        modeltap.diff(tmp_path / "a", tmp_path / "b" / "x.safetensors")
