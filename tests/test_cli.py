import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from modeltap.cli import app
from modeltap.dump import load_dump

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def assert_clean_error(result, pattern, tmp_path=None):
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert pattern in lines[0]
    assert "Traceback" not in result.output
    if tmp_path is not None:
        assert not list(tmp_path.glob("*.safetensors*")) and not list(tmp_path.glob(".*tmp"))


def test_dump_then_show_render_the_same_tree(bert_dir, tmp_path):
    result = invoke("dump", bert_dir, "hello world", "the quick brown fox", "-o", "run.safetensors")
    assert result.exit_code == 0, result.output
    assert "encoder" in result.stdout and "layer.1" in result.stdout
    shown = invoke("show", "run.safetensors")
    assert shown.exit_code == 0
    assert shown.stdout == result.stdout
    dump = load_dump(tmp_path / "run.safetensors")
    assert json.loads(dump.metadata["inputs"])["texts"] == ["hello world", "the quick brown fox"]
    assert dump.metadata["model_class"] == "BertModel"


def test_dump_selection_and_default_name(bert_dir, tmp_path):
    result = invoke("dump", bert_dir, "hello", "--include", "encoder.layer.1.*", "--depth", "4")
    assert result.exit_code == 0, result.output
    written = load_dump(tmp_path / f"{bert_dir.name}.dump.safetensors")
    modules = {k.split(":")[0] for k in written.keys()}
    assert modules == {
        "encoder.layer.1.attention",
        "encoder.layer.1.intermediate",
        "encoder.layer.1.output",
    }


def test_json_goes_to_stdout_alone(bert_dir, tmp_path):
    result = invoke("dump", bert_dir, "hello", "--json", "--depth", "1", "-o", "d.safetensors")
    assert result.exit_code == 0
    report = json.loads(result.stdout)
    keys = [t["key"] for t in report["tensors"]]
    assert "embeddings" in keys and "__root__:last_hidden_state" in keys
    emb = next(t for t in report["tensors"] if t["key"] == "embeddings")
    stored = load_file(tmp_path / "d.safetensors")["embeddings"].double()
    assert emb["norm"] == pytest.approx(float(stored.norm()), rel=1e-6)


def test_input_file_and_inputs_capture(bert_dir, tmp_path):
    save_file({"input_ids": torch.tensor([[2, 10, 11, 3]])}, tmp_path / "in.safetensors")
    result = invoke(
        "dump",
        bert_dir,
        "--input-file",
        "in.safetensors",
        "--inputs",
        "--include",
        "encoder",
        "-o",
        "d.safetensors",
    )
    assert result.exit_code == 0, result.output
    dump = load_dump(tmp_path / "d.safetensors")
    assert "encoder:in.0" in dump and "encoder:last_hidden_state" in dump
    assert json.loads(dump.metadata["inputs"])["file"] == "in.safetensors"


def test_model_and_text_from_project_file(bert_dir, tmp_path):
    (tmp_path / "modeltap.toml").write_text(
        f'model = "{bert_dir}"\ntexts = ["hello"]\nout = "cfg.safetensors"\n[dump]\ndepth = 1\n'
    )
    result = invoke("dump")
    assert result.exit_code == 0, result.output
    assert {k.split(":")[0] for k in load_dump(tmp_path / "cfg.safetensors").keys()} == {
        "__root__",
        "embeddings",
        "encoder",
        "pooler",
    }


def test_stats_only_flag(bert_dir, tmp_path):
    result = invoke("dump", bert_dir, "hello", "--stats-only", "-o", "s.safetensors")
    assert result.exit_code == 0
    assert load_file(tmp_path / "s.safetensors") == {}
    assert "statistics only" in result.stdout


def test_ls_lists_modules_without_weights(bert_dir):
    result = invoke("ls", bert_dir, "--depth", "3")
    assert result.exit_code == 0, result.output
    assert "ModuleList" in result.stdout and result.stdout.count("BertLayer") == 2
    assert "intermediate" not in result.stdout


def test_show_plain_safetensors(tmp_path):
    save_file({"w": torch.tensor([[3.0, 4.0]])}, tmp_path / "plain.safetensors")
    result = invoke("show", "plain.safetensors", "--json")
    assert result.exit_code == 0
    (entry,) = json.loads(result.stdout)["tensors"]
    assert entry["key"] == "w" and entry["norm"] == pytest.approx(5.0)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["./missing-model", "hi"], "no folder './missing-model'"),
        (["{empty}", "hi"], "has no config.json"),
        (["{bare}", "hi"], "no tokenizer"),
        (["{bert}"], "nothing to run on"),
        (["{bert}", "--input-file", "absent.safetensors"], "no input file"),
        (["{bert}", "--input-file", "{garbage}"], "can't read input file"),
        (["{bert}", "--input-file", "{misnamed}"], "input 'input_idz'"),
        (["{bert}", "hi", "--include", "encoder.layr.0"], "did you mean 'encoder.layer.0'"),
        (["{bert}", "hi", "--include", "decoder.*"], "matches no module"),
        (["{bert}", "hi", "-o", "garbage.safetensors/d.safetensors"], "is a file"),
        (["{bert}", "hi", "-o", "d.safetensors", "--max-length", "0"], "--max-length"),
        (["{bert}", "hi", "--model-class", "AutoNope"], "not a transformers model class"),
        (["org/not-cached", "hi"], "not in the Hugging Face cache"),
        ([], "no MODEL given"),
    ],
)
def test_dump_errors_are_one_clean_line(args, message, bert_dir, tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    from tests.fixtures.hf import build_bert

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    (tmp_path / "empty").mkdir()
    save_file({"input_idz": torch.tensor([[1, 2]])}, tmp_path / "mis.safetensors")
    (tmp_path / "garbage.safetensors").write_bytes(b"garbage")
    names = {
        "{bert}": str(bert_dir),
        "{empty}": str(tmp_path / "empty"),
        "{garbage}": "garbage.safetensors",
        "{misnamed}": "mis.safetensors",
    }
    if "{bare}" in args:
        names["{bare}"] = str(build_bert(tmp_path / "bare", with_tokenizer=False))
    before = set(tmp_path.iterdir())
    result = invoke("dump", *[names.get(a, a) for a in args])
    assert_clean_error(result, message)
    new = {p for p in set(tmp_path.iterdir()) - before if p.name != "bare"}
    assert not new, f"left files behind: {new}"


def test_show_errors(tmp_path):
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 3)
    assert_clean_error(invoke("show", "junk.safetensors"), "not a readable safetensors file")
    assert_clean_error(invoke("show", "absent.safetensors"), "no file")


def test_debug_env_shows_the_traceback(monkeypatch):
    monkeypatch.setenv("MODELTAP_DEBUG", "1")
    result = invoke("show", "absent.safetensors")
    assert result.exit_code != 0 and result.exception is not None


def test_help_does_not_import_torch():
    code = (
        "import sys; from modeltap.cli import app; "
        "print(*(m in sys.modules for m in ('torch', 'numpy', 'modeltap.record.recording', "
        "'modeltap.capture.eager', 'modeltap.loading.inputs')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False"] * 5
    # `modeltap.record` and `modeltap.capture` are their packages made callable, with the verbs'
    # signatures; the recorder and the hooks still come only with the first call (or signature).
    code = (
        "import sys, inspect, modeltap; r, c = modeltap.record, modeltap.capture; "
        "print(r.__name__, c.__name__, *(m in sys.modules for m in ('torch', "
        "'modeltap.record.recording', 'modeltap.capture.eager'))); "
        "print(*list(inspect.signature(r).parameters)[:3]); "
        "print(*list(inspect.signature(c).parameters)[:3]); "
        "from modeltap.capture import capture, split_key; print(capture.__module__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == [
        "modeltap.record modeltap.capture False False False",
        "model out_dir every",
        "model args modules",
        "modeltap.capture.eager",
    ]
    help_run = subprocess.run(
        [sys.executable, "-m", "modeltap", "--help"], capture_output=True, text=True, check=True
    )
    assert "dump" in help_run.stdout


def test_lazy_packages_name_nothing_after_one_of_their_modules():
    # Importing a submodule binds it on its package, over a lazy name of the same name.
    import importlib
    import pkgutil

    for package in ("modeltap.capture", "modeltap.diff", "modeltap.loading", "modeltap.record"):
        module = importlib.import_module(package)
        submodules = {info.name for info in pkgutil.iter_modules(module.__path__)}
        assert not submodules & set(module.__all__), package
        for name in module.__all__:
            assert getattr(module, name) is not None
    from modeltap.capture import eager, hooks

    assert callable(hooks) and hooks is eager.hooks


COMMANDS = ["dump", "grads", "show", "ls", "diff", "compare", "export"]


@pytest.mark.parametrize("command", COMMANDS)
def test_help_reads_well_at_80_columns(command):
    result = runner.invoke(app, [command, "--help"], terminal_width=80, env={"COLUMNS": "80"})
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, "\n".join(lines)
    # Typer's rich help swallowed `[default: ...]`, showed `<bool>` for flags, cut names.
    assert "<bool>" not in result.stdout and "list[str]" not in result.stdout
    assert "…" not in result.stdout and "..." not in result.stdout.split("Usage")[0]
    assert "[default:" in result.stdout or command in ("show",)


def test_dump_help_groups_options_in_panels():
    text = runner.invoke(app, ["dump", "--help"], terminal_width=80).stdout
    headings = [line.rstrip(":") for line in text.splitlines() if line and not line[0].isspace()]
    for panel in ("Arguments", "Inputs", "Selection", "Loading", "Output", "Gradients"):
        assert panel in headings, headings
    gradients = text.split("\nGradients:")[1]
    assert "--target" in gradients and "--target" not in text.split("\nGradients:")[0]
    assert "[default: float32]" in text


def test_sigterm_mid_dump_leaves_no_file(bert_dir, tmp_path, monkeypatch):
    import os
    import signal

    from modeltap.dump import DumpWriter

    original = DumpWriter.tensor
    calls = []

    def terminated_midway(self, key, tensor, **kwargs):
        calls.append(key)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # as `timeout` or a CI cancel would
        return original(self, key, tensor, **kwargs)

    monkeypatch.setattr(DumpWriter, "tensor", terminated_midway)
    result = invoke("dump", bert_dir, "hello world", "-o", "d.safetensors")
    assert result.exit_code == 128 + signal.SIGTERM, result.output
    assert "interrupted; nothing was written" in result.stderr
    assert not list(tmp_path.glob("*.safetensors")) and not list(tmp_path.glob(".*"))
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handler restored


def test_full_disk_is_one_line_exit_2_and_no_file(bert_dir, tmp_path, monkeypatch):
    import errno

    from modeltap.dump import DumpWriter

    def no_space(self, key, tensor, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DumpWriter, "tensor", no_space)
    result = invoke("dump", bert_dir, "hello world", "-o", "d.safetensors")
    assert_clean_error(result, "no space left", tmp_path)
    assert "-o/--out" in result.stderr


def test_input_longer_than_positions_names_max_length(bert_dir, tmp_path):
    long_text = " ".join(["hello world"] * 100)  # > 64 positions of the tiny BERT
    assert_clean_error(
        invoke("dump", bert_dir, long_text, "-o", "d.safetensors"), "at most 64 tokens", tmp_path
    )
    result = invoke("dump", bert_dir, long_text, "--max-length", "64", "-o", "d.safetensors")
    assert result.exit_code == 0, result.output
    inputs = json.loads(load_dump(tmp_path / "d.safetensors").metadata["inputs"])
    assert inputs["tensors"]["input_ids"] == [1, 64] and inputs["max_length"] == 64


def test_config_example_writes_into_a_new_folder(bert_dir, tmp_path):
    (tmp_path / "modeltap.toml").write_text(
        f'model = "{bert_dir}"\n[dump]\ntexts = ["hello"]\nout = "runs/first.safetensors"\n'
    )
    result = invoke("dump")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "runs" / "first.safetensors").is_file()


def test_errors_that_need_no_weights_come_before_loading(bert_dir, tmp_path, monkeypatch):
    import modeltap.loading

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(modeltap.loading, "load_model", no_loading)
    (tmp_path / "garbage.safetensors").write_bytes(b"garbage")
    assert_clean_error(
        invoke("dump", bert_dir, "hi", "--include", "encoder.layr.0"), "did you mean"
    )
    assert_clean_error(
        invoke("dump", bert_dir, "--input-file", "garbage.safetensors"), "can't read input file"
    )


class Note:
    """Any class of the user's: unpickling it would run code."""


def test_pickled_input_file_gets_modeltaps_own_hint(bert_dir, tmp_path):
    torch.save({"input_ids": torch.tensor([[1, 2]]), "note": Note()}, "x.pt")
    result = invoke("dump", bert_dir, "--input-file", "x.pt", "-o", "d.safetensors")
    assert_clean_error(result, "never unpickles", tmp_path)
    assert "weights_only" not in result.stderr and "safetensors" in result.stderr


def test_max_inflight_flag(bert_dir, tmp_path):
    inline = invoke("dump", bert_dir, "hello", "--max-inflight", "0", "-o", "a.safetensors")
    assert inline.exit_code == 0, inline.output
    threaded = invoke("dump", bert_dir, "hello", "--max-inflight", "1", "-o", "b.safetensors")
    assert threaded.exit_code == 0, threaded.output
    a, b = load_file(tmp_path / "a.safetensors"), load_file(tmp_path / "b.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert_clean_error(
        invoke("dump", bert_dir, "hello", "--max-inflight", "-1", "-o", "c.safetensors"),
        "--max-inflight",
    )
    assert not (tmp_path / "c.safetensors").exists()


def test_ls_of_a_folder_opens_only_the_config(bert_dir):
    code = f"""
import os, sys
root = os.path.realpath({str(bert_dir)!r})
opened = set()
def hook(event, args):
    if event == "open" and isinstance(args[0], str) and os.path.realpath(args[0]).startswith(root):
        opened.add(os.path.basename(args[0]))
sys.addaudithook(hook)
from typer.testing import CliRunner
import modeltap.errors
from modeltap.cli import app
result = CliRunner().invoke(app, ["ls", root])
print(result.exit_code, sorted(opened))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "0 ['config.json']"


NOWHERE = "/proc/modeltap-nope"  # the kernel refuses new folders here, even to root


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["dump", "{bert}", "hi", "-o", f"{NOWHERE}/x.safetensors"], "-o/--out"),
        (["grads", "{bert}", "hi", "-o", f"{NOWHERE}/sub/x.safetensors"], "-o/--out"),
        (["export", "{bert}", "hi", "-o", f"{NOWHERE}/x.pt2"], "-o/--out"),
        (["export", "{bert}", "hi", "-o", f"{NOWHERE}/x.pt"], "-o/--out"),
        (["diff", "a.safetensors", "a.safetensors", "--junit", f"{NOWHERE}/j.xml"], "--junit"),
        (["compare", "{bert}", "hi", "-a", "bf16", "--junit", f"{NOWHERE}/j.xml"], "--junit"),
        (["compare", "{bert}", "hi", "-a", "bf16", "--out-dir", NOWHERE], "--out-dir"),
    ],
)
def test_an_output_folder_that_cannot_be_made_fails_before_loading(
    args, flag, bert_dir, tmp_path, monkeypatch
):
    import modeltap.loading

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the output path was checked")

    monkeypatch.setattr(modeltap.loading, "load_model", no_loading)
    save_file({"x": torch.ones(2)}, tmp_path / "a.safetensors")
    before = set(tmp_path.iterdir())
    result = invoke(*[str(bert_dir) if a == "{bert}" else a for a in args])
    assert_clean_error(result, "can't be made")
    assert f"change {flag}" in result.stderr
    assert set(tmp_path.iterdir()) == before


@pytest.mark.parametrize("name", ["a.pt2", "a.pt"])
def test_export_makes_a_missing_output_folder(name, bert_dir, tmp_path):
    result = invoke("export", bert_dir, "hello", "-o", f"sub/dir/{name}")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "sub" / "dir" / name).is_file()
    assert not list((tmp_path / "sub" / "dir").glob(".*tmp*"))


def test_the_output_check_leaves_no_folder_behind(bert_dir, tmp_path, monkeypatch):
    import modeltap.loading

    def failing_load(*args, **kwargs):
        raise modeltap.errors.InputError("stop here")

    monkeypatch.setattr(modeltap.loading, "load_model", failing_load)
    assert_clean_error(invoke("dump", bert_dir, "hi", "-o", "new/deeper/x.safetensors"), "stop")
    assert not (tmp_path / "new").exists()


FACTORY = "tests.fixtures.backends:build_nested"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["dump", "{bert}", "hi", "--fullgraph"], "--fullgraph can't apply without --compile"),
        (
            ["dump", "{bert}", "hi", "--compile-backend", "aot_eager", "--no-fullgraph"],
            "--compile-backend and --no-fullgraph can't apply without --compile",
        ),
        (["dump", "{bert}", "hi", "-t", "pooler"], "--target can't apply without --grads"),
        (["dump", "{bert}", "hi", "--no-params"], "--no-params can't apply without --grads"),
        (
            ["dump", "{bert}", "hi", "--device", "cpu", "--device-map", "auto"],
            "give --device cpu or --device-map auto, not both",
        ),
        (
            ["grads", "{bert}", "hi", "--device", "cpu", "--device-map", "auto"],
            "give --device cpu or --device-map auto, not both",
        ),
        (["dump", FACTORY, "--revision", "main"], "--revision can't apply to"),
        (["dump", FACTORY, "--model-class", "AutoModel"], "--model-class can't apply to"),
        (["grads", FACTORY, "--revision", "main"], "--revision can't apply to"),
        (["dump", "{bert}", "hi", "--allow-pickle"], "--allow-pickle can't apply to"),
        (["dump", FACTORY, "--dtype", "bfloat16"], "run on cpu in float32"),
        (["grads", "{bert}", "hi", "--probes", "gaussian"], "add --jacobian-norm K or drop"),
        (["dump", FACTORY, "--max-length", "3"], "--max-length can't apply without TEXT"),
        (["grads", FACTORY, "--tokenizer", "{bert}"], "--tokenizer can't apply without TEXT"),
        (["dump", "m.pt2", "--grads"], "gradients need the eager model"),
        (["grads", "m.pt"], "gradients need the eager model"),
        (["dump", "m.pt2", "--compile"], "an archive runs as it is"),
        (["ls", "{bert}", "--dtype", "bfloat16"], "--dtype can't apply without --device-map"),
        (["ls", "{bert}", "--allow-pickle"], "--allow-pickle can't apply to"),
        (["ls", FACTORY, "--revision", "main"], "--revision can't apply to"),
        (["ls", FACTORY, "--trust-remote-code"], "--trust-remote-code can't apply to"),
        (["export", "{bert}", "hi", "-o", "a.pt", "--static"], "--static can't apply to a Torch"),
        (["export", "m.pt2", "hi"], "'m.pt2' is an archive already"),
        (["export", FACTORY, "--model-class", "AutoModel"], "--model-class can't apply to"),
    ],
)
def test_an_option_that_cannot_apply_is_refused_before_loading(
    args, message, bert_dir, tmp_path, monkeypatch
):
    import modeltap.loading
    import modeltap.loading.archive
    import modeltap.loading.factory

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(modeltap.loading, "load_model", no_loading)
    monkeypatch.setattr(modeltap.loading, "load_meta_model", no_loading)
    monkeypatch.setattr(modeltap.loading.factory, "load_factory", no_loading)
    monkeypatch.setattr(modeltap.loading.archive, "archive_kind", no_loading)
    result = invoke(*[str(bert_dir) if a == "{bert}" else a for a in args])
    assert_clean_error(result, message, tmp_path)


def test_export_help_offers_only_what_export_takes():
    result = invoke("export", "--help")
    assert result.exit_code == 0
    text = " ".join(result.stdout.split())
    model_line = text[text.index("MODEL Hugging Face") : text.index("TEXT Sentences")]
    assert model_line.endswith("config.json, or pkg.module:factory. ")


def _modules_after(args, tmp_path, names):
    """Which of `names` a whole `modeltap ARGS` process imported (its stdout, then the list)."""
    code = (
        "import sys\nfrom modeltap.cli import main\n"
        f"sys.argv = ['modeltap', *{[str(a) for a in args]!r}]\n"
        "try:\n    main()\nexcept SystemExit as exc:\n    code = exc.code\nelse:\n    code = 0\n"
        f"print('exit', code, *(m for m in {list(names)!r} if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, check=True
    )
    *out, last = done.stdout.splitlines()
    _, code, *imported = last.split()
    return "\n".join(out), int(code), imported


def test_help_builds_no_command_and_imports_neither_rich_nor_config(tmp_path):
    # the ten commands' options (typer reads each signature) and the modules they come from
    # were a third of `--help`'s time
    modules = ["modeltap.cli.dump", "modeltap.cli.show", "modeltap.config", "rich.console"]
    out, code, imported = _modules_after(["--help"], tmp_path, modules)
    assert code == 0 and imported == []
    commands = out.split("Commands:")[1].split("\n\n")[0]  # then the line naming the docs
    listed = [line.split()[0] for line in commands.splitlines() if line.strip()]
    order = "dump generate grads show ls diff compare export report replay"
    assert listed == order.split()


def test_the_command_list_is_each_commands_own_docstring():
    import importlib
    import inspect

    from typer.main import get_command_name

    from modeltap.cli.app import COMMANDS

    for module, _ in COMMANDS.values():
        importlib.import_module(module)
    registered = {
        info.name or get_command_name(info.callback.__name__): info.callback
        for info in app.registered_commands
    }
    assert set(registered) == set(COMMANDS)
    for name, (module, summary) in COMMANDS.items():
        doc = inspect.getdoc(registered[name]).split("\n\n")[0]
        assert " ".join(doc.split()) == summary, name
        assert registered[name].__module__ == module


def test_show_and_diff_leave_pydantic_out_and_read_their_options(tmp_path):
    # typer checks every option of the command that runs with a pydantic TypeAdapter, given or
    # not: importing pydantic alone was 0.05-0.1 s of `show`
    save_file({"w": torch.tensor([[3.0, 4.0]])}, tmp_path / "a.safetensors")
    save_file({"w": torch.tensor([[3.0, 4.001]])}, tmp_path / "b.safetensors")
    show = ["show", "a.safetensors", "--json"]
    out, code, imported = _modules_after(show, tmp_path, ["pydantic"])
    assert code == 0 and imported == []
    assert json.loads(out)["tensors"][0]["norm"] == pytest.approx(5.0)
    diff = ["diff", "a.safetensors", "b.safetensors", "--include", "w", "--json"]
    out, code, imported = _modules_after(
        [*diff, "--atol", "1e-2", "--rtol", "0"], tmp_path, ["pydantic"]
    )
    assert code == 0 and imported == [] and json.loads(out)["passed"] is True
    out, code, _ = _modules_after([*diff, "--atol", "1e-4", "--rtol", "0"], tmp_path, [])
    assert code == 1 and json.loads(out)["passed"] is False
    # a value that is no number still gets typer's own message
    result = invoke("diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors", "--atol", "x")
    assert result.exit_code == 2 and "Invalid value for '--atol'" in result.stderr
    result = invoke("show", tmp_path / "absent.safetensors", "--rank", "1")
    assert result.exit_code == 2 and "no file" in result.stderr


def test_the_groups_commands_build_on_first_look():
    # click's own way in (`group.commands[name]`), before anything imported the command
    code = (
        "from typer.main import get_command\nfrom modeltap.cli import app\n"
        "print(*sorted(o for p in get_command(app).commands['diff'].params for o in p.opts))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "--atol" in done.stdout.split()


def test_a_mistyped_command_is_named(tmp_path):
    result = invoke("shwo", tmp_path)
    assert result.exit_code == 2 and "Did you mean 'show'?" in result.output


# --- #29: missing weights, and hints that name only options the command has ------------------


def test_generate_on_minilm_without_an_lm_head_is_refused(minilm_dir, tmp_path):
    import transformers

    # transformers' own loading info: the LM head it would draw at random
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        minilm_dir, output_loading_info=True
    )
    names = dict(model.named_parameters(remove_duplicate=False))
    expected = sorted(set(info["missing_keys"]) & names.keys())
    assert type(model).__name__ == "BertLMHeadModel" and len(expected) == 6
    result = invoke("generate", minilm_dir, "hello world", "-o", "g.safetensors")
    assert_clean_error(result, "--model-class", tmp_path)
    assert "6 parameter(s)" in result.stderr and "--allow-missing-weights" in result.stderr
    allowed = invoke(
        "generate", minilm_dir, "hello world", "--max-new-tokens", "1", "-o", "g.safetensors",
        "--allow-missing-weights",
    )  # fmt: skip
    assert allowed.exit_code == 0, allowed.output
    notes = [line for line in allowed.stderr.splitlines() if "randomly initialised" in line]
    assert len(notes) == 1 and "6 parameter(s) of BertLMHeadModel" in notes[0]
    meta = load_dump(tmp_path / "g.safetensors").metadata
    assert json.loads(meta["missing_weights"]) == expected


def _missing_weights_runs(bert):
    head = ("--model-class", "AutoModelForMaskedLM")
    return {
        "dump": ["dump", bert, "hello", *head],
        "grads": ["grads", bert, "hello", *head],
        "export": ["export", bert, "hello", *head],
        "compare": ["compare", bert, "hello", "--against", "bf16", *head],
        "generate": ["generate", bert, "hello", "--max-new-tokens", "1"],
    }


@pytest.mark.parametrize("command", ["dump", "grads", "export", "compare", "generate"])
def test_every_loading_command_refuses_missing_weights_unless_allowed(bert_dir, tmp_path, command):
    args = _missing_weights_runs(bert_dir)[command]
    out = ["-o", str(tmp_path / "x.pt2" if command == "export" else tmp_path / "x.safetensors")]
    refused = invoke(*args, *(out if command != "compare" else []))
    assert_clean_error(refused, "--allow-missing-weights", tmp_path)
    assert "randomly" in refused.stderr or "random weights" in refused.stderr
    allowed = invoke(*args, *(out if command != "compare" else []), "--allow-missing-weights")
    assert allowed.exit_code in (0, 1), allowed.output  # compare: 1 when bf16 is off
    assert "error" not in allowed.stderr
    if command in ("dump", "grads", "generate"):
        meta = load_dump(tmp_path / "x.safetensors").metadata
        assert json.loads(meta["missing_weights"])[0].startswith("cls.predictions")


def _flags(command: str) -> set[str]:
    """Every option name the command has, from click's own parameter list."""
    from typer.main import get_command

    params = get_command(app).commands[command].params
    return {opt for p in params for opt in (*p.opts, *p.secondary_opts) if opt.startswith("--")}


@pytest.fixture(scope="module")
def media_models(tmp_path_factory):
    import numpy as np

    from tests.fixtures.media import build_clip, build_vit, write_image

    root = tmp_path_factory.mktemp("media-models")
    build_vit(root / "vit")
    build_clip(root / "clip")
    write_image(root / "cat.png", 16, 16)
    (root / "notes.jpg").write_text("not an image")
    (root / "photos").mkdir()
    np.save(root / "ids.npy", np.zeros(3))
    return root


def _hint_cases(root: Path, bert: Path, gpt2: Path) -> list[list]:
    vit, clip, cat = root / "vit", root / "clip", root / "cat.png"
    run_on = {
        "dump": ["dump", vit],
        "grads": ["grads", vit],
        "compare": ["compare", vit, "--against", "bf16"],
        "generate": ["generate", gpt2],
    }
    cases = []
    for command, head in run_on.items():
        for value in ("missing.jpg", root / "notes.jpg", root / "photos", root / "ids.npy"):
            cases.append([*head, value])
        text_model = gpt2 if command == "generate" else bert
        cases.append([head[0], text_model, cat, *head[2:]])  # an image for a text-only model
    cases.append(["generate", vit, cat])  # no generating class for ViT
    cases += list(_missing_weights_runs(bert).values())
    cases += [["dump", clip, "a cat"], ["grads", clip, "a cat"]]
    cases.append(["compare", clip, "a cat", "--against", "bf16"])
    return cases


def test_every_hint_names_an_option_its_command_has(media_models, bert_dir, gpt2_dir, tmp_path):
    """The errors #29 found naming --text where generate and compare have none, and those
    around them: each `--flag` in an error is one of the command's options, in its --help."""
    import re

    seen = set()
    for args in _hint_cases(media_models, bert_dir, gpt2_dir):
        command = args[0]
        result = invoke(*args)
        assert result.exit_code == 2, (args, result.output)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (args, result.stderr)
        named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", lines[0]))
        assert named <= _flags(command), (args, lines[0], named - _flags(command))
        help_text = invoke(command, "--help").stdout
        assert all(flag in help_text for flag in named), (args, named)
        seen |= named
    # the cases do reach the hints: dump's name --text, compare's --input-file, and so on
    assert {"--text", "--input-file", "--images-dir", "--model-class"} <= seen
    assert {"--allow-missing-weights", "--processor"} <= seen
    assert not list(tmp_path.glob("*.safetensors")) and not list(tmp_path.glob("*.pt2"))
