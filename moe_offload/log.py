"""Structured logging: stable event names plus key=value fields, as text or one JSON object per line.

Every record carries ``rank`` and ``world_size``. ``event(...)`` logs on every rank (warnings about a
rank's own state); ``info_rank0(...)`` logs informational events from rank 0 only; ``log_once(key, ...)``
logs an event at most once per process for a given key (one event per fallback reason).
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from typing import Any

LOGGER_NAME = "moe_offload"
_logger = logging.getLogger(LOGGER_NAME)

_rank = 0
_world_size = 1
_once_lock = threading.Lock()
_once_keys: set[str] = set()


def set_rank(rank: int, world_size: int) -> None:
    """Record this process's TP rank and world size; every later record carries them."""
    global _rank, _world_size
    _rank, _world_size = int(rank), int(world_size)


def rank_info() -> tuple[int, int]:
    return _rank, _world_size


def _fmt_value(value: Any) -> str:
    text = str(value)
    if text == "" or any(c in text for c in ' ="\n'):
        return json.dumps(text)
    return text


class TextFormatter(logging.Formatter):
    """``LEVEL event=name key=value ...`` (values with spaces are JSON-quoted)."""

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "event_fields", None)
        if fields is None:
            fields = {"event": "message", "msg": record.getMessage(), "rank": _rank, "world_size": _world_size}
        body = " ".join(f"{k}={_fmt_value(v)}" for k, v in fields.items())
        return f"{record.levelname} {body}"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``{"level": ..., "event": ..., fields...}``."""

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "event_fields", None)
        if fields is None:
            fields = {"event": "message", "msg": record.getMessage(), "rank": _rank, "world_size": _world_size}
        return json.dumps({"level": record.levelname, **fields}, default=str)


def configure(level: str = "INFO", fmt: str = "text", stream=None) -> None:
    """Install one handler on the ``moe_offload`` logger (replacing an earlier one of ours)."""
    for h in list(_logger.handlers):
        if getattr(h, "_moe_offload", False):
            _logger.removeHandler(h)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler._moe_offload = True  # type: ignore[attr-defined]
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    _logger.addHandler(handler)
    _logger.setLevel(level.upper())
    _logger.propagate = True


def event(name: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log event ``name`` with ``fields`` on this rank (rank and world_size are added)."""
    record_fields = {"event": name, **fields, "rank": _rank, "world_size": _world_size}
    _logger.log(level, "%s", name, extra={"event_fields": record_fields})


def info_rank0(name: str, **fields: Any) -> None:
    """Informational event logged by rank 0 only."""
    if _rank == 0:
        event(name, logging.INFO, **fields)


def warning(name: str, **fields: Any) -> None:
    event(name, logging.WARNING, **fields)


def log_once(key: str, name: str, level: int = logging.WARNING, **fields: Any) -> bool:
    """Log ``name`` the first time ``key`` is seen in this process; return True if it was logged."""
    with _once_lock:
        if key in _once_keys:
            return False
        _once_keys.add(key)
    event(name, level, **fields)
    return True


def reset_once_keys() -> None:
    """Forget the once-per-process keys (tests; a host that re-initialises the runtime)."""
    with _once_lock:
        _once_keys.clear()
