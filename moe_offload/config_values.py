"""How the config's byte sizes and the cache budget are written: ``parse_bytes`` ('12GiB', '1.5GB', an int of
bytes) and ``Budget`` (a fraction of experts, '37%', a byte size, '300 slots' or 'auto').

The config models (config.py, which re-exports both) validate ``cache.budget``, ``cache.auto_reserve`` and
``prefill.dequant_chunk_bytes`` with these; budget.py turns a ``Budget`` into slots.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_BYTES_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b|b)\s*$", re.IGNORECASE)
_SLOTS_RE = re.compile(r"^\s*([0-9]+)\s*slots?\s*$", re.IGNORECASE)
_PCT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*%\s*$")


def parse_bytes(text: str | int) -> int:
    """``'12GiB'`` -> 12 * 2**30; plain integers are bytes."""
    if isinstance(text, int):
        return text
    m = _BYTES_RE.match(str(text))
    if not m:
        raise ValueError(f"{text!r} is not a byte size; use e.g. '512MiB', '12GiB', '1.5GB'")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


class Budget(BaseModel):
    """Device memory budget for the expert cache (slots + the two prefill staging layers).

    kind: ``fraction`` (of all experts' bytes), ``bytes``, ``slots`` (slot count on top of staging)
    or ``auto`` (free device memory minus ``cache.auto_reserve``).
    """

    model_config = ConfigDict(frozen=True)
    kind: Literal["fraction", "bytes", "slots", "auto"]
    value: float = 0.0

    @classmethod
    def parse(cls, raw: Any) -> "Budget":
        if isinstance(raw, Budget):
            return raw
        if isinstance(raw, bool):
            raise ValueError("a budget is not a boolean")
        if isinstance(raw, (int, float)):
            if 0 < raw <= 1:
                return cls(kind="fraction", value=float(raw))
            raise ValueError(f"{raw!r}: a number is a fraction of experts in (0, 1]; write '{raw} slots' or a byte size")
        text = str(raw).strip()
        if text.lower() == "auto":
            return cls(kind="auto")
        if m := _PCT_RE.match(text):
            pct = float(m.group(1))
            if not 0 < pct <= 100:
                raise ValueError(f"{text!r}: a percentage must be in (0, 100]")
            return cls(kind="fraction", value=pct / 100)
        if m := _SLOTS_RE.match(text):
            return cls(kind="slots", value=float(m.group(1)))
        if _BYTES_RE.match(text):
            return cls(kind="bytes", value=float(parse_bytes(text)))
        try:
            return cls.parse(float(text))
        except ValueError:
            pass
        raise ValueError(
            f"{text!r} is not a budget; accepted: a fraction of experts in (0, 1] (0.37, '37%'), "
            "a byte size ('12GiB'), a slot count ('300 slots') or 'auto'"
        )
