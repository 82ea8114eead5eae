"""Lazy, validated reads from an HF checkpoint dir (config.json + one or many safetensors files).

Headers are parsed and checked against the file size when the reader opens (a truncated or corrupt
file is an error naming the file); tensors are read on demand through ``safe_open`` slices, so a
TP rank reads only its bytes. ``bytes_read`` and ``reads`` count what was read.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from moe_offload import log
from moe_offload.checkpoint.families import (ModelGeometry, expert_count_error, geometry_from_config,
                                              layers_past_config, resolve_naming)

_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "U8": torch.uint8, "I8": torch.int8, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_HEADER_LIMIT = 100 * 2**20
#: weight files in pickle formats (refused: unpickling runs code)
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class CheckpointError(ValueError):
    """The checkpoint is missing something or is malformed; the message names the file and tensor."""


def _read_header(path: Path) -> dict[str, Any]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header); re-download or re-create it")
        (n,) = struct.unpack("<Q", raw)
        if n > _HEADER_LIMIT or 8 + n > size:
            raise CheckpointError(f"{path}: corrupt safetensors header (length {n}, file {size} bytes); re-download or re-create it")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path}: corrupt safetensors header ({exc}); re-download or re-create it") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object); re-download or re-create it")
    header.pop("__metadata__", None)
    for name, v in header.items():
        ok = (isinstance(v, dict) and isinstance(v.get("dtype"), str) and isinstance(v.get("shape"), list)
              and all(isinstance(d, int) and d >= 0 for d in v["shape"]) and isinstance(v.get("data_offsets"), list)
              and len(v["data_offsets"]) == 2 and all(isinstance(o, int) for o in v["data_offsets"]))
        if not ok:
            raise CheckpointError(f"{path}: corrupt safetensors header entry for tensor {name!r} ({v!r:.120}); "
                                  "re-download or re-create it")
    end = max((v["data_offsets"][1] for v in header.values()), default=0)
    if 8 + n + end != size:
        raise CheckpointError(
            f"{path}: truncated or corrupt safetensors file: header describes {8 + n + end} bytes, file has {size}; "
            "re-download or re-create it"
        )
    return header


def read_json_object(path: Path) -> dict[str, Any]:
    """``path`` parsed as a JSON object (config.json, hf_quant_config.json, generation_config.json); a
    ``CheckpointError`` naming the file where it is not valid JSON or not an object of keys."""
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"{path}: a JSON {type(doc).__name__}, where an object of keys belongs; fix or "
                              "re-download it")
    return doc


class CheckpointReader:
    """An HF checkpoint dir opened for lazy reads."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        cfg_path = self.path / "config.json"
        if not self.path.exists():
            raise CheckpointError(f"{self.path} does not exist; point model.checkpoint at an HF checkpoint dir")
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path} is a file; point model.checkpoint at an HF checkpoint dir (the folder "
                                  "holding config.json and the *.safetensors files)")
        if not cfg_path.is_file():
            raise CheckpointError(f"{self.path}: no config.json; point model.checkpoint at an HF checkpoint dir")
        self.config: dict[str, Any] = read_json_object(cfg_path)
        self.geometry: ModelGeometry = geometry_from_config(self.config, str(cfg_path))
        self._file_of: dict[str, Path] = {}
        self._meta: dict[str, tuple[str, tuple[int, ...]]] = {}
        self._handles: dict[Path, Any] = {}
        self._size_of: dict[Path, int] = {}
        self.reads: Counter = Counter()
        self.bytes_read = 0
        self._index_files()
        self.geometry = resolve_naming(self.geometry, self.has)
        key = "num_experts" if "num_experts" in self.config else "num_local_experts"
        problem = expert_count_error(self.geometry, self.names(), key)
        if problem:
            raise CheckpointError(f"{cfg_path}: {problem}")
        extra = layers_past_config(self.geometry, self.names())
        if extra:  # a model truncated by its config (a debugging habit) runs, but never silently
            log.log_once(f"checkpoint_layers_ignored:{self.path}", "checkpoint_layers_ignored", logging.WARNING,
                         path=str(cfg_path), num_hidden_layers=self.geometry.num_layers,
                         ignored_layers=f"{extra[0]}..{extra[-1]}",
                         detail=f"only the first {self.geometry.num_layers} decoder layers run; the weights of "
                                f"{len(extra)} more are not read",
                         change_with=f"num_hidden_layers={extra[-1] + 1} in config.json to run them all")

    def _index_files(self) -> None:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise CheckpointError(f"{index}: not a safetensors index ({exc})") from None
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
            weight_map = None
        if not files:
            pickles = sorted(p.name for p in self.path.iterdir() if p.suffix in _PICKLE_SUFFIXES)
            if pickles:
                raise CheckpointError(
                    f"{self.path}: holds only pickle weight files ({', '.join(pickles[:4])}); pickle can run code "
                    "when loaded, so only safetensors is read. Convert them to *.safetensors (e.g. load once in a "
                    "trusted environment and save_pretrained(safe_serialization=True)) or use a safetensors export")
            raise CheckpointError(f"{self.path}: no *.safetensors files")
        for fname in files:
            fpath = self.path / fname
            if not fpath.is_file():
                raise CheckpointError(f"{index}: lists {fname}, which does not exist in {self.path}")
            header = _read_header(fpath)
            self._size_of[fpath] = fpath.stat().st_size  # _read_header checked it against the header
            for name, info in header.items():
                self._file_of[name] = fpath
                self._meta[name] = (info["dtype"], tuple(info["shape"]))
        if weight_map is not None:
            for name, fname in weight_map.items():
                if name not in self._file_of:
                    raise CheckpointError(f"{self.path / fname}: tensor {name} is listed in the index but not in the file")

    # --- lookups -------------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return name in self._file_of

    def names(self) -> list[str]:
        return list(self._file_of)

    def file_of(self, name: str) -> Path:
        return self._file_of.get(name, self.path)

    def shape_of(self, name: str) -> tuple[int, ...]:
        self._require(name)
        return self._meta[name][1]

    def dtype_of(self, name: str) -> torch.dtype:
        self._require(name)
        code = self._meta[name][0]
        if code not in _DTYPES:
            raise CheckpointError(f"{self._file_of[name]}: tensor {name} has unsupported dtype {code}")
        return _DTYPES[code]

    def _require(self, name: str) -> None:
        if name not in self._file_of:
            raise CheckpointError(
                f"{self.path}: tensor {name} is missing (no safetensors file holds it); the checkpoint is "
                "incomplete or its format does not match model.format"
            )

    def _handle(self, fpath: Path):
        h = self._handles.get(fpath)
        if h is None:
            try:
                h = safe_open(str(fpath), framework="pt", device="cpu")
            except Exception as exc:  # safetensors raises its own error types
                raise CheckpointError(f"{fpath}: cannot open ({exc})") from None
            self._handles[fpath] = h
        return h

    # --- reads ---------------------------------------------------------------------------------
    def get(
        self,
        name: str,
        rows: tuple[int, int] | None = None,
        cols: tuple[int, int] | None = None,
        index: int | None = None,
        expect_dtype: torch.dtype | None = None,
        expect_shape: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """Read ``name`` (optionally ``[index]``, rows ``[r0, r1)`` and cols ``[c0, c1)`` of the last two dims)."""
        self._require(name)
        fpath = self._file_of[name]
        dtype, shape = self.dtype_of(name), self.shape_of(name)
        if expect_dtype is not None and dtype != expect_dtype:
            raise CheckpointError(f"{fpath}: tensor {name} has dtype {dtype}, expected {expect_dtype} for this format")
        if expect_shape is not None and tuple(shape) != tuple(expect_shape):
            raise CheckpointError(f"{fpath}: tensor {name} has shape {tuple(shape)}, expected {tuple(expect_shape)}")
        size = os.stat(fpath).st_size
        if size != self._size_of[fpath]:
            # reads go through a memory map: touching bytes past a truncated end would kill the process
            # (SIGBUS). This check narrows that window to the read itself; it cannot close it.
            raise CheckpointError(f"{fpath}: changed on disk while being read ({size} bytes now, {self._size_of[fpath]} "
                                  f"when opened; reading tensor {name}); do not modify a checkpoint while it is served")
        handle = self._handle(fpath)
        if index is None and rows is None and cols is None:
            try:
                t = handle.get_tensor(name)
            except Exception as exc:
                raise CheckpointError(f"{fpath}: cannot read tensor {name} ({exc})") from None
            self.reads[name] += 1
            self.bytes_read += t.numel() * t.element_size()
            return t
        sl = handle.get_slice(name)
        idx: list = []
        if index is not None:
            idx.append(index)
        nd_left = len(shape) - len(idx)
        if rows is not None or cols is not None:
            if nd_left < 2:
                raise CheckpointError(f"{fpath}: tensor {name} has shape {tuple(shape)}, expected a matrix")
            r = slice(*rows) if rows is not None else slice(None)
            c = slice(*cols) if cols is not None else slice(None)
            bound_r = shape[len(idx)]
            bound_c = shape[len(idx) + 1]
            if (rows and rows[1] > bound_r) or (cols and cols[1] > bound_c):
                need = (rows[1] if rows else bound_r, cols[1] if cols else bound_c)
                raise CheckpointError(f"{fpath}: tensor {name} has shape {tuple(shape)}, where at least {need} "
                                      "belong (config.json's sizes, this rank's slice); config.json and the weights "
                                      "disagree, or the tensor is cut short")
            idx += [r, c]
        try:
            t = sl[tuple(idx)]
        except Exception as exc:
            raise CheckpointError(f"{fpath}: cannot read tensor {name} ({exc})") from None
        self.reads[name] += 1
        self.bytes_read += t.numel() * t.element_size()
        return t

    def tensor(self, name: str) -> torch.Tensor:
        return self.get(name)


W4A4_EVENT = "nvfp4_w4a4_served_weight_only"


def _modelopt_algo(reader: CheckpointReader, qc: dict) -> tuple[str | None, Path]:
    hf_quant = reader.path / "hf_quant_config.json"
    algo, source = qc.get("quant_algo"), reader.path / "config.json"
    if hf_quant.is_file():
        doc = read_json_object(hf_quant)
        algo, source = (doc.get("quantization") or {}).get("quant_algo", algo), hf_quant
    return algo, source


def detect_format(reader: CheckpointReader) -> str:
    """``bf16``, ``nvfp4-modelopt`` or ``nvfp4-ct`` from config.json / hf_quant_config.json.

    ModelOpt ``quant_algo`` "W4A16_NVFP4" (weight-only) and "NVFP4" (W4A4) store the same weight tensors;
    compressed-tensors ``nvfp4-pack-quantized`` with or without ``input_activations``. W4A4 exports are
    served weight-only (this runtime computes W4A16: dequantize in the GEMM, activations stay 16-bit), said
    once per process in a ``nvfp4_w4a4_served_weight_only`` event, as vLLM does on GPUs without FP4 cores.
    """
    qc = reader.config.get("quantization_config") or {}
    cfg_path = reader.path / "config.json"
    if qc.get("quant_method") == "compressed-tensors":
        fmt = qc.get("format")
        groups = {k: g for k, g in (qc.get("config_groups") or {}).items() if isinstance(g, dict)}
        fmts = {fmt} | {g.get("format") for g in groups.values()}
        if "nvfp4-pack-quantized" not in fmts:
            raise CheckpointError(f"{cfg_path}: compressed-tensors format {fmt!r} is not supported (only "
                                  "nvfp4-pack-quantized); re-export with llm-compressor's NVFP4 or NVFP4A16 scheme")
        acts = [k for k, g in groups.items() if g.get("input_activations")]
        if acts:
            _weight_only_event(reader, "compressed-tensors", f"config_groups {', '.join(acts)} quantize input_activations")
        return "nvfp4-ct"
    if qc.get("quant_method") == "modelopt" or (reader.path / "hf_quant_config.json").is_file():
        algo, source = _modelopt_algo(reader, qc)
        if algo == "W4A16_NVFP4":
            return "nvfp4-modelopt"
        if algo == "NVFP4":
            _weight_only_event(reader, "modelopt", f"{source.name} quant_algo NVFP4 (W4A4)")
            return "nvfp4-modelopt"
        raise CheckpointError(f"{source}: ModelOpt quant_algo {algo!r} is not supported; accepted: W4A16_NVFP4 "
                              "(weight-only) and NVFP4 (W4A4, served weight-only)")
    if qc:
        raise CheckpointError(f"{cfg_path}: quant_method {qc.get('quant_method')!r} is not supported; accepted: "
                              "modelopt (NVFP4, W4A16_NVFP4), compressed-tensors (nvfp4-pack-quantized), or none (bf16)")
    return "bf16"


def _weight_only_event(reader: CheckpointReader, tool: str, why: str) -> None:
    log.log_once(f"{W4A4_EVENT}:{reader.path}", W4A4_EVENT, logging.INFO, path=str(reader.path), tool=tool,
                 reason=why, served="W4A16 (weights NVFP4, activations 16-bit; activation scales ignored)",
                 detail="this runtime has no FP4-activation GEMM (Hopper has no FP4 tensor cores)")
