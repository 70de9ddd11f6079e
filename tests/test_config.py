from pathlib import Path

import pytest

from modeltap.config import load_settings
from modeltap.errors import InputError


def test_precedence_defaults_file_project_env_flags(tmp_path):
    preset = tmp_path / "preset.toml"
    preset.write_text('depth = 2\ndevice = "cpu"\nseed = 5\ndtype = "float16"\n[dump]\ndepth = 3\n')
    (tmp_path / "modeltap.toml").write_text('model = "m"\nseed = 6\ntexts = ["hi"]\n')
    env = {"MODELTAP_SEED": "7", "MODELTAP_DTYPE": "bfloat16"}
    s = load_settings("dump", config_file=preset, cwd=tmp_path, env=env, flags={"dtype": "float32"})
    assert s.depth == 3  # [dump] beats the preset's top level
    assert s.model == "m" and s.texts == ["hi"]  # project file
    assert s.seed == 7  # env beats project file
    assert s.dtype == "float32"  # flag beats env
    assert s.dead_threshold == 0.0 and s.include == []  # defaults


def test_pyproject_tool_table(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[project]\nname="x"\n[tool.modeltap]\nmodel = "p"\n')
    assert load_settings("dump", cwd=tmp_path, env={}).model == "p"


def test_unset_flags_do_not_override(tmp_path):
    (tmp_path / "modeltap.toml").write_text('include = ["encoder.*"]\n')
    s = load_settings("dump", cwd=tmp_path, env={}, flags={"include": [], "depth": None})
    assert s.include == ["encoder.*"]


def test_bad_settings_name_the_fix(tmp_path):
    (tmp_path / "modeltap.toml").write_text("detph = 3\n")
    with pytest.raises(InputError, match="unknown setting 'detph'; did you mean 'depth'"):
        load_settings("dump", cwd=tmp_path, env={})
    (tmp_path / "modeltap.toml").write_text('depth = "three"\n')
    with pytest.raises(InputError, match="'depth' must be int"):
        load_settings("dump", cwd=tmp_path, env={})
    (tmp_path / "modeltap.toml").write_text("depth = [\n")
    with pytest.raises(InputError, match="not valid TOML"):
        load_settings("dump", cwd=tmp_path, env={})
    (tmp_path / "modeltap.toml").unlink()
    with pytest.raises(InputError, match="MODELTAP_DEPTH"):
        load_settings("dump", cwd=tmp_path, env={"MODELTAP_DEPTH": "x"})
    with pytest.raises(InputError, match="no config file"):
        load_settings("dump", cwd=tmp_path, env={}, config_file=tmp_path / "nope.toml")


def test_shipped_presets_load(tmp_path):
    configs = Path(__file__).resolve().parent.parent / "configs"
    presets = sorted(p for p in configs.glob("*.toml") if p.name != "tolerances.toml")
    assert presets
    for preset in presets:
        load_settings("dump", config_file=preset, cwd=tmp_path, env={})


def test_every_tolerance_preset_loads(tmp_path):
    import tomllib

    from modeltap.config import PRESET_KEYS, read_preset, shipped_presets

    names = list(tomllib.loads(shipped_presets().read_text(encoding="utf-8")))
    assert {"exact", "fp32", "tf32", "bf16", "fp16", "cross-device"} <= set(names)
    assert read_preset("exact", cwd=tmp_path) == {"atol": 0.0, "rtol": 0.0}
    for name in names:
        assert {"atol", "rtol"} <= set(read_preset(name, cwd=tmp_path)) <= set(PRESET_KEYS)
    assert read_preset("bf16", cwd=tmp_path)["upcast"] is True
    assert "upcast" not in read_preset("fp32", cwd=tmp_path)


def test_configs_tolerances_is_the_shipped_file(tmp_path):
    """configs/tolerances.toml is the copy users edit; the program reads the package's."""
    from modeltap.config import shipped_presets

    configs = Path(__file__).resolve().parent.parent / "configs" / "tolerances.toml"
    assert configs.read_text() == shipped_presets().read_text(encoding="utf-8")


def test_files_read_at_run_time_come_from_the_package_not_the_checkout(tmp_path):
    """An installed wheel has no checkout: nothing may be found relative to the source tree."""
    from importlib.resources import files

    import modeltap
    from modeltap.config import config_dirs, tolerance_preset

    assert config_dirs(tmp_path) == [tmp_path / "configs"]  # not the checkout's configs/
    package = Path(modeltap.__file__).parent
    for source in package.rglob("*.py"):  # no path built from a module's own location
        assert "__file__" not in source.read_text(), source
    assert (files("modeltap") / "tolerances.toml").is_file()
    assert tolerance_preset("bf16", cwd=tmp_path)["scaled_atol"] == 5e-2
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tolerances.toml").write_text("[bf16]\natol = 1.0\nrtol = 0.0\n")
    assert tolerance_preset("bf16", cwd=tmp_path) == {"atol": 1.0, "rtol": 0.0}


def test_modeltap_configs_without_presets_is_an_error(tmp_path, monkeypatch):
    from modeltap.config import tolerance_preset

    (tmp_path / "mine").mkdir()
    monkeypatch.setenv("MODELTAP_CONFIGS", str(tmp_path / "mine"))
    with pytest.raises(InputError, match="holds no tolerances.toml; add one there or unset it"):
        tolerance_preset("bf16", cwd=tmp_path)
    (tmp_path / "mine" / "tolerances.toml").write_text("[bf16]\natol = 2.0\nrtol = 0.0\n")
    assert tolerance_preset("bf16", cwd=tmp_path) == {"atol": 2.0, "rtol": 0.0}


# The types TOML values and MODELTAP_* variables are checked against, as config.py listed them by
# hand before they came from the fields' annotations (any field not here: str).
_LISTED_TYPES = {
    **dict.fromkeys(["texts", "images", "audio", "include", "exclude", "map", "wrt"], list),
    "overrides": dict,
    **dict.fromkeys(
        "chat inputs stats_only hist trust_remote_code allow_missing_weights train_mode equal_nan "
        "upcast strict grads params use_cache compile fullgraph dynamic do_sample full kv "
        "ops bisect".split(),
        bool,
    ),
    **dict.fromkeys(
        "depth seed max_length jacobian_norm max_inflight_mb max_new_tokens num_beams "
        "top_k".split(),
        int,
    ),
    **dict.fromkeys(
        "dead_threshold atol rtol vanishing exploding scaled_atol min_cosine "
        "accumulated_scaled_atol temperature top_p".split(),
        float,
    ),
}


def test_setting_types_come_from_the_field_annotations():
    import dataclasses

    from modeltap.config import Settings
    from modeltap.config.settings import TYPES

    names = [f.name for f in dataclasses.fields(Settings)]
    assert TYPES == {name: _LISTED_TYPES.get(name, str) for name in names}


def test_every_field_is_a_toml_key_and_an_environment_variable(tmp_path):
    import dataclasses

    from modeltap.config import Settings
    from modeltap.config.settings import TYPES

    samples = {int: ("3", 3), float: ("0.5", 0.5), bool: ("yes", True), str: ("x", "x")}
    for f in dataclasses.fields(Settings):
        kind = TYPES[f.name]
        if kind in samples:
            raw, value = samples[kind]
            env = {f"MODELTAP_{f.name.upper()}": raw}
            assert getattr(load_settings("dump", cwd=tmp_path, env=env), f.name) == value, f.name
            toml = f"{f.name} = {value!r}\n".replace("True", "true").replace("'", '"')
        elif kind is list:
            toml, value = f'{f.name} = ["a"]\n', ["a"]
        else:
            toml, value = f'{f.name} = {{ "x.*" = {{ atol = 1 }} }}\n', {"x.*": {"atol": 1.0}}
        (tmp_path / "modeltap.toml").write_text("[dump]\n" + toml)  # `grads` is also a table
        assert getattr(load_settings("dump", cwd=tmp_path, env={}), f.name) == value, f.name


def _built_command(**kwargs):
    """A typer app whose one command is built by `cli.options.command` from declarations, and
    the calls its body received."""
    import typer

    from modeltap.cli.options import command

    app = typer.Typer(add_completion=False)
    calls = []

    names = "model depth include out dtype stats_only json_out config".split()

    @app.command(**kwargs)
    @command("dump", *names)
    def dump(s, given, **cli):
        """Run."""
        calls.append((s, given, cli))

    return app, calls


def test_a_command_is_built_from_the_declarations(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MODELTAP_DEPTH", raising=False)
    app, calls = _built_command()
    runner = CliRunner()
    args = ["m", "-d", "2", "-i", "a.*", "-i", "b", "-o", "x.st", "--dtype", "bfloat16", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    s, given, cli = calls[-1]
    assert (s.model, s.depth, s.include) == ("m", 2, ["a.*", "b"])
    assert (s.out, s.dtype) == ("x.st", "bfloat16")
    assert type(s.out) is str and type(s.dtype) is str and s.stats_only is False
    assert given["stats_only"] is None and given["depth"] == 2  # what was typed, None if not
    assert cli == {"json_out": True}
    # precedence: config file < env < flags; a flag not given leaves the others in force
    (tmp_path / "c.toml").write_text("depth = 5\nstats_only = true\n")
    monkeypatch.setenv("MODELTAP_DEPTH", "4")
    assert runner.invoke(app, ["m", "-c", "c.toml"]).exit_code == 0
    s = calls[-1][0]
    assert (s.depth, s.stats_only, s.dtype) == (4, True, "float32")
    args = ["m", "-c", "c.toml", "--depth", "1", "--with-tensors"]
    assert runner.invoke(app, args).exit_code == 0
    assert (calls[-1][0].depth, calls[-1][0].stats_only) == (1, False)
    bad = runner.invoke(app, ["m", "--dtype", "float8"])
    assert bad.exit_code == 2 and "float8" in bad.output


def test_a_built_commands_parameters_are_the_declarations_in_order():
    import dataclasses

    from typer.main import get_command

    from modeltap.config import Settings

    app, _ = _built_command()
    params = {p.name: p for p in get_command(app).params}
    order = ["model", "depth", "include", "out", "dtype", "stats_only", "json_out", "config"]
    assert list(params) == order
    for f in dataclasses.fields(Settings):
        if f.name in params:
            declared = f.metadata["cli"]
            assert params[f.name].help == declared.help, f.name
            assert getattr(params[f.name], "rich_help_panel", None) == declared.panel, f.name
    assert params["include"].opts == ["--include", "-i"] and params["include"].multiple
    assert params["stats_only"].secondary_opts == ["--with-tensors"]
