"""The option declarations and the settings built from them.

`settings`: the `Settings` dataclass, whose fields are the options (flag, type, default, help,
panel); `files`: TOML files, MODELTAP_* variables and tolerance presets, merged by
`load_settings`. Each module is imported when one of its names is first used: the CLI's
declarations need `settings` only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from modeltap._lazy import lazy_names

if TYPE_CHECKING:
    from modeltap.config.declare import CliOption, option
    from modeltap.config.files import (
        ACCUMULATED_KEY,
        COMMANDS,
        PRESET_KEYS,
        PROJECT_FILE,
        TOLERANCE_FILE,
        TOLERANCE_KEYS,
        accumulated_allowance,
        config_dirs,
        load_settings,
        preset_names,
        project_config,
        read_preset,
        read_toml,
        shipped_presets,
        tolerance_preset,
        tolerance_values,
        tomllib,
    )
    from modeltap.config.settings import Settings

_HOMES = {
    **dict.fromkeys(["CliOption", "option"], "declare"),
    "Settings": "settings",
    **dict.fromkeys(
        [
            "ACCUMULATED_KEY",
            "COMMANDS",
            "PRESET_KEYS",
            "PROJECT_FILE",
            "TOLERANCE_FILE",
            "TOLERANCE_KEYS",
            "accumulated_allowance",
            "config_dirs",
            "load_settings",
            "preset_names",
            "project_config",
            "read_preset",
            "read_toml",
            "shipped_presets",
            "tolerance_preset",
            "tolerance_values",
            "tomllib",
        ],
        "files",
    ),
}
__getattr__ = lazy_names(__name__, _HOMES)

# _HOMES declares the names; the imports under TYPE_CHECKING repeat them for type checkers
# (tests/test_architecture.py checks that they match).
__all__ = sorted(_HOMES)
