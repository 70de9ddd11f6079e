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
