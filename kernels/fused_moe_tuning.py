"""Tile configs of the fused NVFP4 MoE kernels: data (``fused_moe_tuning.json``, written by
``benchmarks/tune_fused_moe.py``), keyed by device name, shape (H, I) and the number of routed pairs."""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

TUNING_PATH = Path(__file__).with_name("fused_moe_tuning.json")


# ---------------------------------------------------------------------------------------------
# Tile configs (data, not literals: see fused_moe_tuning.json)


@dataclass(frozen=True)
class KernelTiles:
    """Tiles of one of the two GEMM kernels: N/K tile, M-block grouping, warps, pipeline stages, and an optional
    cap on registers per thread (``maxnreg``, ptxas' register limit; None: the compiler's choice). The cap
    exists for the decode kernels: at T = 64 the swapped gate_up kernel is bound by instruction issue with 25 %
    occupancy, 8 CTAs per SM limited by its 128 registers per thread (Nsight Compute on the H200,
    benchmarks/results/HISTORY.md "b18b0cc"). Its shared memory (17.4 KB per CTA at 3 stages) allowed 9 CTAs there, so
    a cap buys warps only together with fewer stages or smaller tiles; a cap too low spills. The tuner measures the
    combinations."""

    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    maxnreg: int | None = None

    def __post_init__(self):
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n={self.block_n}: must be a power of two >= 16 (tl.dot minimum)")
        if self.block_k < 32 or self.block_k & (self.block_k - 1):
            raise ValueError(f"block_k={self.block_k}: must be a power of two >= 32 (two K/2 dots, each >= 16)")
        if self.group_m < 1 or self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"invalid tiles {self}: group_m >= 1, num_warps a power of two <= 16, num_stages >= 1")
        if self.maxnreg is not None and not (isinstance(self.maxnreg, int) and 32 <= self.maxnreg <= 255
                                             and self.maxnreg % 8 == 0):
            raise ValueError(f"maxnreg={self.maxnreg!r}: a multiple of 8 in [32, 255], or null (the compiler's choice)")

    def launch_options(self) -> dict:
        """Triton launch options of these tiles (``maxnreg`` only when set)."""
        opts = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        if self.maxnreg is not None:
            opts["maxnreg"] = self.maxnreg
        return opts

    def to_dict(self) -> dict:
        d = asdict(self)
        if d["maxnreg"] is None:  # tables written before the option stay as they were
            del d["maxnreg"]
        return d


@dataclass(frozen=True)
class FusedMoeConfig:
    """Tiles of one fused-MoE call: ``block_m`` rows per block (shared by both kernels: it sets the
    padding of ``moe_align``), the tiles of the gate_up and down kernels, and which kernel pair runs:
    ``swap_ab`` False the ``fused_moe.py`` kernels (activations as the dot's left operand), True those of
    ``fused_moe_swap.py`` (the dequantized weight tile as the left operand). ``faster_than_dequant``: the
    tuner measured these kernels faster than dequant + grouped_mm at this bucket (``compute/auto.py`` reads
    it; entries may also carry the two times, ``ms`` and ``dequant_ms``, as a record)."""

    block_m: int
    gate_up: KernelTiles
    down: KernelTiles
    swap_ab: bool = False
    faster_than_dequant: bool = False

    def __post_init__(self):
        if self.block_m < 16 or self.block_m & (self.block_m - 1):
            raise ValueError(f"block_m={self.block_m}: must be a power of two >= 16 (tl.dot minimum)")

    @classmethod
    def from_dict(cls, d: dict, where: str = "config") -> "FusedMoeConfig":
        try:
            unknown = set(d) - {"block_m", "gate_up", "down", "swap_ab", "faster_than_dequant", "ms", "dequant_ms"}
            if unknown:
                raise KeyError(f"unknown keys {sorted(unknown)}")
            return cls(block_m=int(d["block_m"]), gate_up=KernelTiles(**d["gate_up"]), down=KernelTiles(**d["down"]),
                       swap_ab=bool(d.get("swap_ab", False)), faster_than_dequant=bool(d.get("faster_than_dequant", False)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"{where}: bad fused-MoE config {d!r} ({exc}); expected "
                '{"block_m": int, "gate_up": {"block_n", "block_k", "group_m", "num_warps", "num_stages", "maxnreg" (optional)}, '
                '"down": {...}, '
                '"swap_ab": bool, "faster_than_dequant": bool (both optional)}'
            ) from exc

    def to_dict(self) -> dict:
        return {"block_m": self.block_m, "gate_up": self.gate_up.to_dict(), "down": self.down.to_dict(),
                "swap_ab": self.swap_ab, "faster_than_dequant": self.faster_than_dequant}


#: GPUs built on the same die as a tuned one (same SMs, registers, shared memory and instruction set; the tile choice
#: is a property of the SM, not of the memory bandwidth or clocks): a tile table without an entry of their own uses
#: that GPU's before its ``default`` (the untuned starting point). The GH100 die: every H100 and H200 variant and
#: GH200. Measured: on an H100 SXM, the untuned defaults ran the decode MoE at ~4 x the H200 tiles' time (README).
SAME_DIE = {
    "NVIDIA H100 80GB HBM3": "NVIDIA H200",
    "NVIDIA H100 PCIe": "NVIDIA H200",
    "NVIDIA H100 NVL": "NVIDIA H200",
    "NVIDIA H100": "NVIDIA H200",
    "NVIDIA H200 NVL": "NVIDIA H200",
    "NVIDIA GH200 480GB": "NVIDIA H200",
    "NVIDIA GH200 144G HBM3e": "NVIDIA H200",
}

_BORROWED: set[tuple[str, str]] = set()
#: the tuner that writes a GPU's own entry into each shipped table
TUNERS = {"fused_moe_tuning.json": "benchmarks/tune_fused_moe.py", "decode_moe_tuning.json": "benchmarks/tune_decode_moe.py",
          "decode_gemv_tuning.json": "benchmarks/tune_decode_gemv.py", "dequant_tuning.json": "benchmarks/tune_dequant.py"}


def tiles_key(name: str, keys, table: str) -> str:
    """The key of a tile table (``keys``: its device names) that a device named ``name`` uses: its own, else the
    ``SAME_DIE`` GPU's (logged once per table and device as ``tuning_borrowed``), else ``"default"``."""
    if name in keys:
        return name
    sibling = SAME_DIE.get(name)
    if sibling in keys:
        if (table, name) not in _BORROWED:
            _BORROWED.add((table, name))
            from moe_offload import log

            tuner = TUNERS.get(table, "the table's tuner in benchmarks/")
            log.event("tuning_borrowed", table=table, device=name, tiles_of=sibling,
                      detail=f"no tiles measured on this GPU; using those of the same die ({tuner} on this GPU "
                             "measures its own)")
        return sibling
    return "default"


def shape_key(hidden: int, inter: int) -> str:
    """Key of a layer shape in the tuning table, e.g. ``H2048_I768``."""
    return f"H{hidden}_I{inter}"


class TuningTable:
    """``devices -> shape key (or "default") -> max routed pairs M (str int) -> FusedMoeConfig``.

    Lookup: the device's entry, else its ``SAME_DIE`` GPU's, else ``"default"``; the shape's entry, else that device's
    ``"default"``; then the smallest M bucket >= M, else the largest bucket."""

    def __init__(self, devices: dict[str, dict[str, dict[int, FusedMoeConfig]]], source: str = "<memory>"):
        if "default" not in devices or "default" not in devices["default"]:
            raise ValueError(f"{source}: the tuning table needs devices['default']['default'] (the fallback entry)")
        self.devices = devices
        self.source = source
        self.file = Path(source).name  # the table's name in ``tuning_borrowed`` events

    @classmethod
    def from_json(cls, data: dict, source: str = "<memory>") -> "TuningTable":
        if data.get("schema") != 1 or not isinstance(data.get("devices"), dict):
            raise ValueError(f"{source}: expected {{'schema': 1, 'devices': {{...}}}}, got keys {sorted(data)}")
        devices: dict[str, dict[str, dict[int, FusedMoeConfig]]] = {}
        for dev, shapes in data["devices"].items():
            devices[dev] = {}
            for shape, buckets in shapes.items():
                if not buckets:
                    raise ValueError(f"{source}: devices[{dev!r}][{shape!r}] has no M buckets")
                parsed = {}
                for m, cfg in buckets.items():
                    where = f"{source}: devices[{dev!r}][{shape!r}][{m!r}]"
                    if not str(m).isdigit():
                        raise ValueError(f"{where}: bucket keys are max routed pairs (T*K) as integers")
                    parsed[int(m)] = FusedMoeConfig.from_dict(cfg, where)
                devices[dev][shape] = dict(sorted(parsed.items()))
        return cls(devices, source)

    def to_json(self) -> dict:
        return {
            "schema": 1,
            "devices": {
                dev: {shape: {str(m): cfg.to_dict() for m, cfg in b.items()} for shape, b in shapes.items()}
                for dev, shapes in self.devices.items()
            },
        }

    def lookup(self, device_name: str, hidden: int, inter: int, pairs: int) -> FusedMoeConfig:
        shapes = self.devices[tiles_key(device_name, self.devices, self.file)]
        buckets = shapes.get(shape_key(hidden, inter)) or shapes.get("default") or self.devices["default"]["default"]
        for m, cfg in buckets.items():
            if pairs <= m:
                return cfg
        return next(reversed(buckets.values()))


@functools.lru_cache(maxsize=4)
def load_tuning(path: str | Path = TUNING_PATH) -> TuningTable:
    """Read a tuning table (default: the one shipped next to this module)."""
    path = Path(path)
    with open(path) as f:
        return TuningTable.from_json(json.load(f), str(path))


@functools.lru_cache(maxsize=16)
def device_name(device: torch.device) -> str:
    """Tuning-table key of a device: the CUDA device name (e.g. ``NVIDIA H200``) or ``cpu``."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def config_for(device: torch.device, hidden: int, inter: int, pairs: int) -> FusedMoeConfig:
    """Tiles for a call on ``device`` with layer shape (H, I) and ``pairs`` = T*K routed pairs."""
    return load_tuning().lookup(device_name(device), hidden, inter, pairs)


