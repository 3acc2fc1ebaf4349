"""Operator logs: one line per event, `key=value` fields, run id and step when known."""

from __future__ import annotations

import logging
import sys
from typing import Any

_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


def setup_logging(level: int = logging.INFO) -> None:
    root = logging.getLogger("rlserve")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT))
        root.addHandler(handler)
        root.setLevel(level)
        root.propagate = False


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    text = str(value)
    return f'"{text}"' if (" " in text or not text) else text


def event(logger: logging.Logger, name: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log `event=<name> k=v ...` on one line; None fields are left out."""
    parts = [f"event={name}"] + [f"{k}={_fmt(v)}" for k, v in fields.items() if v is not None]
    logger.log(level, " ".join(parts))
