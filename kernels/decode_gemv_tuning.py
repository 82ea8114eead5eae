"""Tiles of the decode GEMV kernels (``decode_gemv.py``) as data: ``decode_gemv_tuning.json``, keyed by GPU
name, layer shape (H, I) and routed pairs T*K, written by ``benchmarks/tune_decode_gemv.py``.

Legend: T tokens, K top-k, H hidden, I expert intermediate.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from moe_offload.kernels.fused_moe_tuning import device_name, shape_key, tiles_key

GEMV_TUNING_PATH = Path(__file__).with_name("decode_gemv_tuning.json")


def _pow2(x: int) -> bool:
    return x >= 1 and not x & (x - 1)


@dataclass(frozen=True)
class GemvTiles:
    """Tiles of one GEMV kernel: output rows and K columns per step of a program, warps."""

    block_n: int
    block_k: int
    num_warps: int = 4

    def __post_init__(self):
        if not _pow2(self.block_n) or not _pow2(self.block_k) or self.block_k < 32 or self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"invalid tiles {self}: block_n a power of two, block_k a power of two >= 32 "
                             "(whole scale blocks of 16), num_warps a power of two <= 16")


@dataclass(frozen=True)
class GemvConfig:
    """``block_m`` pairs of one row per gate_up program (1: one pair each, no alignment launch),
    plus the tiles of the two kernels; ``down_per_pair``: the down projection as one program per (pair,
    BLOCK_N outputs) into fp32 partials, then a fixed-order sum over each token's pairs (kernel 2b);
    ``split_x``: x's even and odd columns copied apart first (kernel 0b)."""

    block_m: int
    gate_up: GemvTiles
    down: GemvTiles
    down_per_pair: bool = False
    split_x: bool = False

    def __post_init__(self):
        if not _pow2(self.block_m) or self.block_m > 16:
            raise ValueError(f"block_m={self.block_m}: must be a power of two in [1, 16] (registers per program)")

    @classmethod
    def from_dict(cls, d: dict, where: str = "config") -> "GemvConfig":
        try:
            if not isinstance(d, dict):
                raise TypeError(f"a config is a JSON object, got {type(d).__name__}")
            flags = {k: d.get(k, False) for k in ("down_per_pair", "split_x")}
            for k, v in flags.items():
                if not isinstance(v, bool):
                    raise TypeError(f"{k} must be true or false, got {v!r}")
            return cls(int(d["block_m"]), GemvTiles(**d["gate_up"]), GemvTiles(**d["down"]), **flags)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{where}: bad decode-gemv config {d!r} ({exc}); expected "
                             '{"block_m": int, "gate_up": {"block_n", "block_k", "num_warps"}, "down": {...}, '
                             '"down_per_pair", "split_x": bool (optional)}') from exc

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class GemvShapeEntry:
    """One (device, shape) entry: the largest T*K for which "auto" picks this kernel, and tiles
    by T*K bucket (the smallest bucket >= T*K, else the largest)."""

    gemv_max_pairs: int
    buckets: dict

    def config(self, pairs: int) -> GemvConfig:
        for m, cfg in self.buckets.items():
            if pairs <= m:
                return cfg
        return next(reversed(self.buckets.values()))


@functools.lru_cache(maxsize=4)
def load_gemv_tuning(path: str | Path = GEMV_TUNING_PATH) -> dict:
    """``{device: {shape key or "default": GemvShapeEntry}}``; raises ValueError naming a bad key."""
    path = Path(path)
    data = json.loads(path.read_text())
    if data.get("schema") != 1 or not isinstance(data.get("devices"), dict):
        raise ValueError(f"{path}: expected {{'schema': 1, 'devices': {{...}}}}, got keys {sorted(data)}")
    table = {}
    for dev, shapes in data["devices"].items():
        table[dev] = {}
        for shape, entry in shapes.items():
            where = f"{path}: devices[{dev!r}][{shape!r}]"
            if not isinstance(entry.get("gemv_max_pairs"), int) or not entry.get("buckets"):
                raise ValueError(f"{where}: needs an int 'gemv_max_pairs' and non-empty 'buckets'")
            buckets = {}
            for m, cfg in entry["buckets"].items():
                if not str(m).isdigit():
                    raise ValueError(f"{where}['buckets'][{m!r}]: bucket keys are max routed pairs (T*K) as integers")
                buckets[int(m)] = GemvConfig.from_dict(cfg, f"{where}['buckets'][{m!r}]")
            table[dev][shape] = GemvShapeEntry(entry["gemv_max_pairs"], dict(sorted(buckets.items())))
    if "default" not in table.get("default", {}):
        raise ValueError(f"{path}: needs devices['default']['default'] (the fallback entry)")
    return table


def gemv_entry(device: torch.device, hidden: int, inter: int) -> GemvShapeEntry:
    """The tuning entry of ``device`` and shape (H, I): the device's (or its ``SAME_DIE`` GPU's), else "default"; the shape's, else
    that device's "default", else the global default."""
    table = load_gemv_tuning()
    shapes = table[tiles_key(device_name(device), table, "decode_gemv_tuning.json")]
    return shapes.get(shape_key(hidden, inter)) or shapes.get("default") or table["default"]["default"]


def gemv_config_for(device: torch.device, hidden: int, inter: int, pairs: int) -> GemvConfig:
    """Tiles for a call with layer shape (H, I) and ``pairs`` = T*K routed pairs."""
    return gemv_entry(device, hidden, inter).config(pairs)
