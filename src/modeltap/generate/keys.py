"""Generation keys: step k's one-forward keys under `gen/step{k}/`."""

from __future__ import annotations

import re

STEP_PREFIX = "gen/step"
_STEP_KEY = re.compile(r"^gen/step(\d+)/(.*)$", re.S)
# The self-attention cache's new positions of one step, per layer: `gen/step{k}/cache:{i}.key`.
CACHE_MODULE = "cache"


def step_key(step: int, key: str) -> str:
    return f"{STEP_PREFIX}{step}/{key}"


def split_step(key: str) -> tuple[int, str] | None:
    """(step, one-forward key) of a generation key, None for any other key."""
    match = _STEP_KEY.match(key)
    return (int(match[1]), match[2]) if match else None
