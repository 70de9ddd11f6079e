"""Big models: --device-map / --max-memory / --offload-folder and half precision.

References are computed here with plain transformers and accelerate: the placement accelerate's
`infer_auto_device_map` plans and transformers' `from_pretrained(device_map=...)` really loads,
hidden states and gradients of a model loaded without any placement.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from modeltap.cli import app
from modeltap.dump import load_dump
from modeltap.errors import InputError
from modeltap.loading.placement import check_dtype, parse_max_memory

accelerate = pytest.importorskip("accelerate")

runner = CliRunner()
TEXTS = ["hello world", "the quick brown fox"]
GUIDES = set("│├└─ ")


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def assert_clean_error(result, pattern, tmp_path):
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert pattern in lines[0], lines[0]
    assert not list(tmp_path.glob("*.safetensors*")) and not list(tmp_path.glob(".*tmp"))


def param_bytes(folder) -> int:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())


def meta_model(folder, dtype=torch.float32):
    from transformers import AutoConfig, AutoModel

    with torch.device("meta"):
        return AutoModel.from_config(AutoConfig.from_pretrained(folder), dtype=dtype)


def reference_plan(folder, cpu: int, dtype=torch.float32) -> dict[str, str]:
    """accelerate's plan for a CPU-only budget, as transformers asks for it."""
    from accelerate.utils import infer_auto_device_map

    model = meta_model(folder, dtype)
    return dict(
        infer_auto_device_map(
            model, max_memory={"cpu": cpu}, no_split_module_classes=model._no_split_modules
        )
    )


def device_of(name: str, device_map: dict[str, str]) -> str:
    """The entry covering `name`, or for a module split across devices, theirs joined by '+'."""
    covering = [k for k in device_map if k in ("", name) or name.startswith(k + ".")]
    if covering:
        return str(device_map[max(covering, key=len)])
    inside = [str(d) for k, d in device_map.items() if k.startswith(name + ".")]
    return "+".join(dict.fromkeys(inside))


def ls_rows(stdout: str) -> dict[str, list[str]]:
    """Full dotted module name -> the row's cells, rebuilt from the tree guides of `ls`."""
    rows, stack = {}, []
    for line in stdout.splitlines()[1:]:
        if not line.strip():
            break
        col = next(i for i, c in enumerate(line) if c not in GUIDES)
        depth = col // 3
        cells = line[col:].split()
        stack[depth:] = [cells[0]]
        rows[".".join(stack[1:]) or "__root__"] = cells
    return rows


def hidden_states(folder, dtype):
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(folder, dtype=dtype).eval()
    batch = AutoTokenizer.from_pretrained(folder)(TEXTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        return model(**batch, output_hidden_states=True)


# --- parsing and checks


def test_max_memory_is_parsed_into_bytes_per_device():
    assert parse_max_memory("0=20GiB,cpu=30GiB") == {0: 20 * 2**30, "cpu": 30 * 2**30}
    assert parse_max_memory("cpu=200MB") == {"cpu": 200 * 10**6}
    assert parse_max_memory("cuda:1=1.5GB, cpu=4096") == {1: 1_500_000_000, "cpu": 4096}
    assert parse_max_memory({0: "1KiB", "cpu": 100}) == {0: 1024, "cpu": 100}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("cpu", "is not DEVICE=SIZE"),
        ("gpu=1GB", "device 'gpu' is unknown"),
        ("cpu=lots", "is not a size"),
        ("cpu=1GB,cpu=2GB", "twice"),
    ],
)
def test_bad_max_memory_says_how_to_write_it(text, message):
    with pytest.raises(InputError, match=message):
        parse_max_memory(text)


def test_bf16_on_a_gpu_without_it_is_refused_before_loading(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla T4")
    with pytest.raises(InputError, match=r"Tesla T4\) does not support bfloat16; use --dtype"):
        check_dtype("bfloat16", "cuda")
    check_dtype("float16", "cuda")
    check_dtype("bfloat16", "cpu")


# --- ls: the plan


def test_ls_shows_accelerates_plan_and_what_loading_really_does(bert_dir, tmp_path):
    from transformers import AutoModel

    budget = param_bytes(bert_dir)
    expected = reference_plan(bert_dir, budget)
    assert set(expected.values()) == {"cpu", "disk"}  # the budget really splits the model
    loaded = AutoModel.from_pretrained(
        bert_dir, device_map="auto", max_memory={"cpu": budget}, offload_folder=tmp_path / "off"
    )
    assert dict(loaded.hf_device_map) == expected

    result = invoke("ls", bert_dir, "--device-map", "auto", "--max-memory", f"cpu={budget}")
    assert result.exit_code == 0, result.output
    rows = ls_rows(result.stdout)
    names = [n for n, _ in meta_model(bert_dir).named_modules() if n]
    assert set(rows) == {"__root__", *names}
    for name in names:
        assert rows[name][-1] == device_of(name, expected), name
    assert rows["__root__"][-1] == "cpu+disk"

    # bytes per device: every parameter and buffer counted where the plan puts it
    per_device: dict[str, int] = {}
    model = meta_model(bert_dir)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        device = device_of(name, expected)
        per_device[device] = per_device.get(device, 0) + t.numel() * t.element_size()
    footer = result.stdout.split("\n\n")[-1]
    for device, size in per_device.items():
        line = next(x for x in footer.splitlines() if x.split()[0] == device)
        assert line.split()[1:] == [f"{size / 1024:.1f}", "KiB"], line


def test_ls_plan_follows_the_dtype(bert_dir):
    budget = param_bytes(bert_dir) // 2  # fp32 would not fit; bf16 halves every layer
    expected = reference_plan(bert_dir, budget, torch.bfloat16)
    result = invoke(
        "ls", bert_dir, "--device-map", "auto", "--max-memory", f"cpu={budget}",
        "--dtype", "bfloat16", "-d", "3",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = ls_rows(result.stdout)
    for name in ("embeddings", "encoder.layer.0", "encoder.layer.1", "pooler"):
        assert rows[name][-1] == device_of(name, expected)


def test_ls_without_device_map_is_unchanged(bert_dir):
    result = invoke("ls", bert_dir, "-d", "1")
    assert result.exit_code == 0
    assert result.stdout.splitlines()[0].split() == ["module", "class", "params"]


# --- dump and grads under offload


@pytest.fixture(scope="module")
def offloaded_and_plain(bert_dir, tmp_path_factory):
    """One dump through accelerate's placement (CPU + disk), one plain, of the same inputs."""
    folder = tmp_path_factory.mktemp("offload")
    budget = param_bytes(bert_dir)
    plain = runner.invoke(app, ["dump", str(bert_dir), *TEXTS, "-o", str(folder / "plain.st")])
    assert plain.exit_code == 0, plain.output
    placed = runner.invoke(
        app,
        ["dump", str(bert_dir), *TEXTS, "-o", str(folder / "placed.st"),
         "--device-map", "auto", "--max-memory", f"cpu={budget}",
         "--offload-folder", str(folder / "off")],
    )  # fmt: skip
    assert placed.exit_code == 0, placed.output
    return folder / "plain.st", folder / "placed.st", reference_plan(bert_dir, budget)


def test_offloaded_dump_has_the_plain_dumps_keys_and_values(offloaded_and_plain):
    plain, placed, plan = offloaded_and_plain
    with safe_open(str(plain), "pt") as a, safe_open(str(placed), "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        assert len(list(a.keys())) > 20
        for key in a.keys():
            assert torch.equal(a.get_tensor(key), b.get_tensor(key)), key
        meta = b.metadata()
    # the placement really offloaded, and every tensor's device is recorded
    assert json.loads(meta["device_map"]) == plan and "disk" in plan.values()
    assert meta["device"] == "cpu"
    devices = json.loads(meta["devices"])
    assert set(devices) == set(load_dump(placed).stored) and set(devices.values()) == {"cpu"}


def test_offloaded_dump_equals_plain_transformers_hidden_states(bert_dir, offloaded_and_plain):
    _, placed, _ = offloaded_and_plain
    reference = hidden_states(bert_dir, torch.float32)
    dump = load_dump(placed)
    assert torch.equal(dump["embeddings"], reference.hidden_states[0])
    for i in range(2):
        assert torch.equal(dump[f"encoder.layer.{i}"], reference.hidden_states[i + 1])
    assert torch.equal(dump["__root__:last_hidden_state"], reference.last_hidden_state)


def test_hooks_coexist_with_accelerates_and_come_off(bert_dir, tmp_path):
    from accelerate.hooks import AlignDevicesHook

    from modeltap.dumping import dump_model
    from modeltap.loading import load_model, load_tokenizer, text_inputs

    budget = {"cpu": param_bytes(bert_dir)}
    loaded = load_model(
        str(bert_dir), device_map="auto", max_memory=budget, offload_folder=tmp_path / "off"
    )
    model = loaded.model
    aligned = {
        n
        for n, m in model.named_modules()
        if isinstance(getattr(m, "_hf_hook", None), AlignDevicesHook)
    }
    assert "encoder.layer.1.output.dense" in aligned
    assert any(p.device.type == "meta" for p in model.parameters())  # offloaded weights
    inputs = text_inputs(load_tokenizer(bert_dir), TEXTS)
    dump = load_dump(dump_model(model, inputs, tmp_path / "d.safetensors"))
    assert "encoder.layer.1.output.dense" in dump
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert aligned == {
        n
        for n, m in model.named_modules()
        if isinstance(getattr(m, "_hf_hook", None), AlignDevicesHook)
    }


@pytest.mark.parametrize("share", [1.0, 0.6])  # part on CPU, part on disk; all of it on disk
def test_grads_under_offload_equal_plain_autograd(bert_dir, tmp_path, share):
    from transformers import AutoModel, AutoTokenizer

    budget = int(param_bytes(bert_dir) * share)
    result = invoke(
        "dump", bert_dir, *TEXTS, "--grads", "-o", "g.safetensors", "--device-map", "auto",
        "--max-memory", f"cpu={budget}", "--offload-folder", tmp_path / "off",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    dump = load_dump(tmp_path / "g.safetensors")
    placed = json.loads(dump.metadata["device_map"])
    assert placed == reference_plan(bert_dir, budget) and "disk" in placed.values()

    # the reference: every module's tensor output on a plain model, and autograd.grad of the sum of
    # last_hidden_state (the default loss) with respect to all of them
    model = AutoModel.from_pretrained(bert_dir).eval()
    batch = dict(AutoTokenizer.from_pretrained(bert_dir)(TEXTS, return_tensors="pt", padding=True))
    found = {}
    handles = [
        m.register_forward_hook(lambda m, a, o, n=n: found.__setitem__(n, o))
        for n, m in model.named_modules()
        if n
    ]
    try:
        y = model(**batch).last_hidden_state
    finally:
        for h in handles:
            h.remove()
    names = [n for n, o in found.items() if isinstance(o, torch.Tensor) and o.requires_grad]
    expected = torch.autograd.grad(
        y, [found[n] for n in names], torch.ones_like(y), allow_unused=True
    )
    compared = 0
    for name, grad in zip(names, expected, strict=True):
        if grad is not None:
            torch.testing.assert_close(dump[f"grad/{name}"], grad, rtol=1e-6, atol=1e-7)
            compared += 1
    assert compared >= 30
    assert "encoder.layer.1" in names and "embeddings.position_embeddings" in names


# --- half precision


@pytest.mark.parametrize("placed", [False, True])
def test_bf16_dump_is_bf16_and_equals_plain_bf16_hidden_states(bert_dir, tmp_path, placed):
    args = ["dump", bert_dir, *TEXTS, "--dtype", "bfloat16", "-o", "bf16.safetensors"]
    if placed:
        budget = param_bytes(bert_dir) // 2
        args += ["--device-map", "auto", "--max-memory", f"cpu={budget}"]
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    path = tmp_path / "bf16.safetensors"
    with safe_open(str(path), "pt") as f:
        float_keys = [k for k in f.keys() if f.get_slice(k).get_dtype() != "I64"]
        assert float_keys and all(f.get_slice(k).get_dtype() == "BF16" for k in float_keys)
    dump = load_dump(path)
    if placed:
        assert "disk" in json.loads(dump.metadata["device_map"]).values()
    assert dump.metadata["dtype"] == "bfloat16"
    reference = hidden_states(bert_dir, torch.bfloat16)
    assert reference.last_hidden_state.dtype == torch.bfloat16
    assert torch.equal(dump["embeddings"], reference.hidden_states[0])
    for i in range(2):
        assert torch.equal(dump[f"encoder.layer.{i}"], reference.hidden_states[i + 1])
    assert torch.equal(dump["__root__:last_hidden_state"], reference.last_hidden_state)
    # statistics are taken in float32 or wider: within float32 rounding of float64 arithmetic on
    # the bf16 values (bf16 arithmetic would be off by ~1e-3)
    x = reference.last_hidden_state.double()
    stats = dump.stats_for("__root__:last_hidden_state")
    assert stats.dtype == "bfloat16"
    assert stats.norm == pytest.approx(float(x.norm()), rel=1e-6)
    assert stats.std == pytest.approx(float(x.std()), rel=1e-5)


# --- errors: one line that names the fix, exit 2, no file


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_gpu(bert_dir, tmp_path):
    result = invoke("dump", bert_dir, "hello", "--device", "cuda", "-o", "x.safetensors")
    assert_clean_error(result, "use --device cpu", tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_gpu_budget_without_gpu(bert_dir, tmp_path):
    result = invoke(
        "dump", bert_dir, "hello", "--device-map", "auto", "--max-memory", "0=1GiB", "-o", "x.st"
    )
    assert_clean_error(result, "give only cpu=SIZE", tmp_path)


def test_budget_below_the_largest_layer_cannot_run_even_offloaded(bert_dir, tmp_path):
    result = invoke(
        "dump", bert_dir, "hello", "--device-map", "auto", "--max-memory", "cpu=1000", "-o", "x.st"
    )
    assert_clean_error(result, "can't hold the largest layer (encoder.layer.0", tmp_path)
    assert "give cpu at least 33.4 KiB" in result.stderr
    listed = invoke("ls", bert_dir, "--device-map", "auto", "--max-memory", "cpu=1000")
    assert_clean_error(listed, "can't hold the largest layer", tmp_path)


def test_offload_folder_not_writable(bert_dir, tmp_path):
    (tmp_path / "a-file").write_text("")
    result = invoke(
        "dump", bert_dir, "hello", "--device-map", "auto",
        "--offload-folder", tmp_path / "a-file" / "off", "-o", "x.st",
    )  # fmt: skip
    assert_clean_error(result, "is not writable", tmp_path)
    assert "--offload-folder" in result.stderr


def test_bf16_on_a_gpu_without_it_fails_before_loading(bert_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla T4")
    result = invoke(
        "dump", bert_dir, "hello", "--device", "cuda", "--dtype", "bfloat16", "-o", "x.st"
    )
    assert_clean_error(result, "does not support bfloat16; use --dtype float16", tmp_path)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-memory", "cpu=1GB"], "add --device-map auto"),
        (["--offload-folder", "off"], "add --device-map auto"),
        (["--device-map", "auto", "--max-memory", "cpu:1GB"], "is not DEVICE=SIZE"),
        (["--device-map", "auto", "--device", "cuda"], "not both"),
        (
            ["--device-map", "auto", "--max-memory", "cpu=90000", "--grads", "--params"],
            "drop --params",
        ),
        (["--config", "bad.toml"], "--device-map 'everywhere' is not one of auto, balanced"),
    ],
)
def test_placement_option_errors(bert_dir, tmp_path, args, message):
    (tmp_path / "bad.toml").write_text('device_map = "everywhere"\n')
    assert_clean_error(invoke("dump", bert_dir, "hello", *args, "-o", "x.st"), message, tmp_path)


def test_device_map_without_accelerate_names_the_extra(bert_dir, tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "accelerate", None)
    result = invoke("dump", bert_dir, "hello", "--device-map", "auto", "-o", "x.st")
    assert_clean_error(result, "pip install 'modeltap[big]'", tmp_path)


# --- GPU (skipped without CUDA)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("how", [["--device", "cuda"], ["--device-map", "auto"]])
def test_cuda_dump_matches_cpu_float32_within_the_cross_device_preset(bert_dir, tmp_path, how):
    from modeltap.config import tolerance_preset

    tol = tolerance_preset("cross-device")
    cpu = invoke("dump", bert_dir, *TEXTS, "-o", "cpu.safetensors")
    gpu = invoke("dump", bert_dir, *TEXTS, *how, "-o", "gpu.safetensors")
    assert cpu.exit_code == 0 and gpu.exit_code == 0, gpu.output
    a, b = load_dump(tmp_path / "cpu.safetensors"), load_dump(tmp_path / "gpu.safetensors")
    assert a.keys() == b.keys()
    for key in a.stored:
        torch.testing.assert_close(b[key], a[key], atol=tol["atol"], rtol=tol["rtol"])
    devices = set(json.loads(b.metadata["devices"]).values())
    assert devices == {"cuda:0"}


@cuda
def test_cuda_with_cpu_offload_records_both_devices(bert_dir, tmp_path):
    # 3/4 of the weights' bytes on the GPU: accelerate keeps room for the largest layer there,
    # so at 1/2 transformers 5.17 put the whole tiny model on the CPU
    budget = param_bytes(bert_dir) * 3 // 4
    result = invoke(
        "dump", bert_dir, *TEXTS, "-o", "g.safetensors", "--device-map", "auto",
        "--max-memory", f"0={budget},cpu=1GiB",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    dump = load_dump(tmp_path / "g.safetensors")
    placed = set(json.loads(dump.metadata["device_map"]).values())
    assert placed == {"0", "cpu"}
    assert re.fullmatch(r"cuda:0", dump.metadata["device"])


def test_grads_on_an_offloaded_model_leave_it_as_it_was(bert_dir, tmp_path):
    from modeltap.dumping import dump_model
    from modeltap.grads import GradSpec
    from modeltap.loading import load_model, load_tokenizer, text_inputs

    loaded = load_model(str(bert_dir), device_map="auto", max_memory={"cpu": 60000})
    model = loaded.model
    before = {n: p.requires_grad for n, p in model.named_parameters()}
    assert all(before.values())
    inputs = text_inputs(load_tokenizer(bert_dir), TEXTS)
    dump = load_dump(dump_model(model, inputs, tmp_path / "g.st", grads=GradSpec()))
    assert "grad/embeddings.word_embeddings" in dump
    assert {n: p.requires_grad for n, p in model.named_parameters()} == before
    with pytest.raises(InputError, match="drop --params"):
        dump_model(model, inputs, tmp_path / "p.st", grads=GradSpec(params=True))
    assert not (tmp_path / "p.st").exists() and not list(tmp_path.glob(".*tmp"))


def test_pickle_checkpoint_offloaded_to_disk_needs_a_folder(bert_dir, tmp_path):
    """Weights that are not safetensors can't be read in place: transformers resaves them."""
    import shutil

    from safetensors.torch import load_file

    folder = tmp_path / "bert-bin"
    shutil.copytree(bert_dir, folder)
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    args = ["dump", folder, "hello", "--device-map", "auto", "--max-memory", "cpu=60000"]
    assert_clean_error(invoke(*args, "-o", "x.st"), "give a folder with --offload-folder", tmp_path)
    result = invoke(*args, "--offload-folder", tmp_path / "off", "-o", "x.safetensors")
    assert result.exit_code == 0, result.output
    assert list((tmp_path / "off").glob("encoder.layer.1.*"))


def test_inputs_go_where_accelerate_runs_the_first_module():
    from types import SimpleNamespace

    from torch import nn

    from modeltap.loading.placement import input_device

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    assert input_device(model) == torch.device("cpu")
    model[1]._hf_hook = SimpleNamespace(execution_device=1)
    assert input_device(model) == torch.device("cuda:1")
    model._hf_hook = SimpleNamespace(execution_device="cuda:0")  # dispatch_model's main device
    assert input_device(model) == torch.device("cuda:0")
    with torch.device("meta"):
        assert input_device(nn.Linear(2, 2)) == torch.device("cpu")


def test_ls_plan_keeps_tied_weights_together_as_loading_does(gpt2_dir, tmp_path):
    from accelerate.utils import infer_auto_device_map
    from transformers import AutoConfig, AutoModelForCausalLM

    budget = int(param_bytes(gpt2_dir) * 0.9)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(gpt2_dir))
    expected = dict(
        infer_auto_device_map(
            meta, max_memory={"cpu": budget}, no_split_module_classes=meta._no_split_modules
        )
    )
    assert expected["lm_head"] == expected["transformer.wte"] == "cpu"
    assert "disk" in expected.values()
    loaded = AutoModelForCausalLM.from_pretrained(
        gpt2_dir, device_map="auto", max_memory={"cpu": budget}, offload_folder=tmp_path / "off"
    )
    assert dict(loaded.hf_device_map) == expected
    result = invoke(
        "ls", gpt2_dir, "--model-class", "AutoModelForCausalLM", "--device-map", "auto",
        "--max-memory", f"cpu={budget}",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = ls_rows(result.stdout)
    for name in expected:
        assert rows[name][-1] == device_of(name, expected), name


def test_placement_read_from_the_weights_agrees_with_transformers_map(bert_dir, tmp_path):
    """Where a transformers version keeps no `hf_device_map`, the dump's device_map comes from
    where each module's weights are: it must say what transformers' own map says (CPU + disk)."""
    from modeltap.loading import load_model
    from modeltap.loading.hf import placed

    budget = param_bytes(bert_dir)  # some modules in memory, the rest on disk
    model = load_model(str(bert_dir), device_map="auto", max_memory={"cpu": budget},
                       offload_folder=str(tmp_path / "off")).model  # fmt: skip
    hf_map = model.hf_device_map
    assert set(hf_map.values()) == {"cpu", "disk"}
    got = placed(model)
    assert got and set(got.values()) == {"cpu", "disk"}
    for name, where in got.items():
        owner = max((m for m in hf_map if m in ("", name) or name.startswith(m + ".")), key=len)
        assert where == hf_map[owner], name
