"""Settings files and presets: the settings merged in this order, later wins:

defaults < --config FILE < ./modeltap.toml or [tool.modeltap] < MODELTAP_* env < flags.

A TOML file holds keys for every command at its top level and per-command keys in a table named
after the command (`[dump]`), which win over the top level.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from modeltap.config.settings import FIELDS as _FIELDS
from modeltap.config.settings import TYPES as _TYPES
from modeltap.config.settings import Settings
from modeltap.errors import InputError
from modeltap.selection import suggest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

COMMANDS = ("dump", "grads", "diff", "show", "ls", "compare", "export", "generate")
PROJECT_FILE = "modeltap.toml"


def _check(values: Mapping[str, Any], where: str) -> dict[str, Any]:
    checked: dict[str, Any] = {}
    for key, value in values.items():
        name = key.replace("-", "_")
        if name not in _FIELDS:
            guess = suggest(name, _FIELDS)
            keys = "see docs/reference/configuration.md for the keys"
            hint = f"did you mean '{guess}'?" if guess else keys
            raise InputError(f"{where}: unknown setting '{key}'; {hint}")
        expected = _TYPES.get(name, str)
        ok = isinstance(value, expected) and not (expected is int and isinstance(value, bool))
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            ok, value = True, float(value)
        if expected is list:
            ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
        if expected is dict:
            value = _check_overrides(value, f"{where}: '{key}'")
        if not ok:
            raise InputError(
                f"{where}: '{key}' must be "
                f"{'a list of strings' if expected is list else expected.__name__}"
                f", got {value!r}"
            )
        checked[name] = value
    return checked


def _check_overrides(value: Any, where: str) -> dict[str, dict[str, float]]:
    """`{glob = {atol = .., rtol = ..}}`: per-key tolerances for diff."""
    if not isinstance(value, Mapping):
        raise InputError(f'{where} must be a table of globs, e.g. "pooler.*" = {{ atol = 1e-3 }}')
    checked = {}
    for glob, tol in value.items():
        if (
            not isinstance(tol, Mapping)
            or not set(tol) <= {"atol", "rtol"}
            or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in tol.values()
            )
        ):
            raise InputError(f"{where}: '{glob}' must be {{ atol = number, rtol = number }}")
        checked[glob] = {k: float(v) for k, v in tol.items()}
    return checked


def _table(data: Mapping[str, Any], command: str, where: str) -> dict[str, Any]:
    top = {k: v for k, v in data.items() if k not in COMMANDS}
    section = data.get(command, {})
    if not isinstance(section, Mapping):
        raise InputError(f"{where}: [{command}] must be a table")
    return {**_check(top, where), **_check(section, f"{where} [{command}]")}


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise InputError(f"can't read config '{path}' ({exc.strerror}); check --config") from exc
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"config '{path}' is not valid TOML ({exc}); fix it") from exc


def project_config(cwd: Path) -> tuple[dict[str, Any], str] | None:
    """./modeltap.toml, else [tool.modeltap] of ./pyproject.toml, if either exists."""
    own = cwd / PROJECT_FILE
    if own.is_file():
        return read_toml(own), str(own)
    pyproject = cwd / "pyproject.toml"
    if pyproject.is_file():
        tool = read_toml(pyproject).get("tool", {}).get("modeltap")
        if isinstance(tool, Mapping):
            return dict(tool), f"{pyproject} [tool.modeltap]"
    return None


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name in _FIELDS:
        raw = env.get(f"MODELTAP_{name.upper()}")
        if raw is None or _TYPES.get(name) in (list, dict):
            continue
        kind = _TYPES.get(name, str)
        try:
            if kind is bool:
                if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                    raise ValueError(raw)
                values[name] = raw.lower() in ("1", "true", "yes")
            else:
                values[name] = kind(raw)
        except ValueError as exc:
            raise InputError(
                f"MODELTAP_{name.upper()}={raw!r} is not a valid {kind.__name__}; fix or unset it"
            ) from exc
    return values


def load_settings(
    command: str,
    *,
    config_file: str | os.PathLike[str] | None = None,
    flags: Mapping[str, Any] | None = None,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> Settings:
    """Merge every source; `flags` holds only what the user typed (None and [] mean unset)."""
    merged: dict[str, Any] = {}
    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise InputError(f"no config file '{path}'; check --config")
        merged.update(_table(read_toml(path), command, str(path)))
    project = project_config(cwd or Path.cwd())
    if project is not None:
        merged.update(_table(project[0], command, project[1]))
    merged.update(_from_env(os.environ if env is None else env))
    merged.update({k: v for k, v in (flags or {}).items() if v is not None and v != []})
    return Settings(**merged)


TOLERANCE_FILE = "tolerances.toml"
TOLERANCE_KEYS = ("atol", "rtol", "scaled_atol", "min_cosine")
# compare's allowance for rounding accumulated from module to module; a preset may hold it
ACCUMULATED_KEY = "accumulated_scaled_atol"
# What a preset may hold besides tolerances: `upcast = true` for presets made to compare dtypes,
# and compare's allowance.
PRESET_KEYS = (*TOLERANCE_KEYS, "upcast", ACCUMULATED_KEY)


def config_dirs(cwd: Path | None = None) -> list[Path]:
    """Folders whose tolerances.toml replaces the shipped one: $MODELTAP_CONFIGS, ./configs."""
    dirs = []
    if os.environ.get("MODELTAP_CONFIGS"):
        dirs.append(Path(os.environ["MODELTAP_CONFIGS"]))
    dirs.append((cwd or Path.cwd()) / "configs")
    return dirs


def shipped_presets() -> Any:
    """The tolerances.toml inside the package (importlib.resources: a wheel, a zip or a checkout
    alike), the one read when no folder of `config_dirs` holds one."""
    from importlib.resources import files

    return files("modeltap") / TOLERANCE_FILE


def _presets(cwd: Path | None) -> tuple[dict[str, Any], str]:
    """(the presets, where they came from): the first tolerances.toml of `config_dirs`, else the
    shipped one."""
    for folder in config_dirs(cwd):
        path = folder / TOLERANCE_FILE
        if path.is_file():
            return read_toml(path), str(path)
    if os.environ.get("MODELTAP_CONFIGS"):  # asked for, so not silently the shipped ones
        raise InputError(
            f"MODELTAP_CONFIGS={os.environ['MODELTAP_CONFIGS']!r} holds no {TOLERANCE_FILE}; "
            "add one there or unset it"
        )
    shipped = shipped_presets()
    return tomllib.loads(shipped.read_text(encoding="utf-8")), f"modeltap's own {TOLERANCE_FILE}"


def preset_names(cwd: Path | None = None) -> list[str]:
    """The names of the tolerance presets in force (a user's tolerances.toml, else modeltap's)."""
    return list(_presets(cwd)[0])


def read_preset(name: str, cwd: Path | None = None) -> dict[str, Any]:
    """Every value of preset `name`: its tolerances and, if it says so, `upcast`."""
    presets, where = _presets(cwd)
    if name not in presets:
        guess = suggest(name, presets)
        hint = f"did you mean '{guess}'?" if guess else "choose one of " + ", ".join(presets)
        raise InputError(f"no tolerance preset '{name}' in {where}; {hint}")
    values = _check(presets[name], f"{where} [{name}]")
    if not set(values) <= set(PRESET_KEYS):
        raise InputError(f"{where} [{name}]: a preset holds only " + ", ".join(PRESET_KEYS))
    return values


def tolerance_preset(name: str, cwd: Path | None = None) -> dict[str, float]:
    """atol/rtol (and scaled_atol, min_cosine when set) of preset `name`."""
    return {k: v for k, v in read_preset(name, cwd).items() if k in TOLERANCE_KEYS}


def tolerance_values(
    s: Settings, *, atol: float | None = None, rtol: float | None = None, preset: str | None = None
) -> dict[str, Any]:
    """Tolerances by precedence: settings files and env < preset < --atol/--rtol."""
    values: dict[str, Any] = {
        "atol": s.atol,
        "rtol": s.rtol,
        "scaled_atol": s.scaled_atol,
        "min_cosine": s.min_cosine,
    }
    if preset:
        values.update({k: v for k, v in tolerance_preset(preset).items() if k in TOLERANCE_KEYS})
    values.update({k: v for k, v in {"atol": atol, "rtol": rtol}.items() if v is not None})
    if values["atol"] < 0 or values["rtol"] < 0 or values["scaled_atol"] < 0:
        raise InputError("--atol, --rtol and scaled_atol must be 0 or more")
    return values


def accumulated_allowance(s: Settings, preset: str | None = None) -> float:
    """compare's `accumulated_scaled_atol` by precedence: settings files and env < preset."""
    value = s.accumulated_scaled_atol
    if preset:
        value = float(read_preset(preset).get(ACCUMULATED_KEY, value))
    if value < 0:
        raise InputError(f"{ACCUMULATED_KEY} must be 0 or more")
    return value
