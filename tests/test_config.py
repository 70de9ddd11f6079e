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
    from modeltap.config import read_toml, tolerance_preset

    configs = Path(__file__).resolve().parent.parent / "configs"
    names = list(read_toml(configs / "tolerances.toml"))
    assert {"exact", "fp32", "tf32", "bf16", "fp16", "cross-device"} <= set(names)
    assert tolerance_preset("exact", cwd=tmp_path) == {"atol": 0.0, "rtol": 0.0}
    for name in names:
        assert (
            {"atol", "rtol"}
            <= set(tolerance_preset(name, cwd=tmp_path))
            <= {
                "atol",
                "rtol",
                "scaled_atol",
                "min_cosine",
                "accumulated_scaled_atol",
            }
        )
