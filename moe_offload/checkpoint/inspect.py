"""Describe and fully validate a checkpoint dir (every expert tensor's presence, dtype and shape)."""

from __future__ import annotations

import torch

from moe_offload.checkpoint.reader import CheckpointError, CheckpointReader, detect_format
from moe_offload.formats import get_format


def _expected(fmt_name: str, which: str, H: int, I: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    rows, cols = (I, H) if which in ("gate", "up") else (H, I)
    if fmt_name == "bf16":
        return {"weight": ((rows, cols), torch.bfloat16)}
    q, s, g = ("weight", "weight_scale", "weight_scale_2") if fmt_name == "nvfp4-modelopt" else (
        "weight_packed", "weight_scale", "weight_global_scale")
    return {q: ((rows, cols // 2), torch.uint8), s: ((rows, cols // 16), torch.float8_e4m3fn), g: (None, torch.float32)}


def inspect_checkpoint(path: str) -> dict:
    reader = CheckpointReader(path)
    fmt_name = detect_format(reader)
    fmt = get_format(fmt_name)
    geo = reader.geometry
    fam = geo.family
    expert_names: set[str] = set()
    for layer in geo.moe_layers:
        fused = reader.has(fam.fused_gate_up.format(l=layer))
        if fused:
            for name, shape in ((fam.fused_gate_up.format(l=layer), (geo.num_experts, 2 * geo.inter, geo.hidden)),
                                (fam.fused_down.format(l=layer), (geo.num_experts, geo.hidden, geo.inter))):
                if reader.shape_of(name) != shape or reader.dtype_of(name) != torch.bfloat16:
                    raise CheckpointError(f"{reader.file_of(name)}: tensor {name} is {reader.shape_of(name)} "
                                          f"{reader.dtype_of(name)}, expected {shape} torch.bfloat16")
                expert_names.add(name)
            continue
        for e in range(geo.num_experts):
            for which in ("gate", "up", "down"):
                prefix = fam.expert_name(layer, e, which)
                for suffix, (shape, dtype) in _expected(fmt_name, which, geo.hidden, geo.inter).items():
                    name = f"{prefix}.{suffix}"
                    got_dtype = reader.dtype_of(name)  # raises a named error if missing
                    got_shape = reader.shape_of(name)
                    if got_dtype != dtype or (shape is not None and got_shape != shape):
                        raise CheckpointError(
                            f"{reader.file_of(name)}: tensor {name} is {got_shape} {got_dtype}, expected "
                            f"{shape or 'scalar'} {dtype} for format {fmt_name}")
                    expert_names.add(name)
    bank_bytes = fmt.bytes_per_expert(geo.hidden, geo.inter)
    total = 0
    expert_total = 0
    for name in reader.names():
        n = reader.shape_of(name)
        size = reader.dtype_of(name).itemsize
        for d in n:
            size *= d
        total += size
        if name in expert_names or ".experts." in name:
            expert_total += size
    return {
        "path": str(reader.path),
        "family": geo.model_type,
        "format": fmt_name,
        "layers": geo.num_layers,
        "moe_layers": len(geo.moe_layers),
        "experts": geo.num_experts,
        "top_k": geo.top_k,
        "hidden": geo.hidden,
        "expert_intermediate": geo.inter,
        "bytes_per_expert": bank_bytes,
        "bytes_per_expert_per_bank": {b.name: b.nbytes for b in fmt.banks(geo.hidden, geo.inter)},
        "expert_bytes_total": expert_total,
        "non_expert_bytes_total": total - expert_total,
        "tensors": len(reader.names()),
    }
