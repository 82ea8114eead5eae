"""Describe and fully validate a checkpoint dir: every expert tensor's presence, dtype and shape, the
expert count against config.json, and the values of every float tensor (finite; NVFP4 global scales
also non-zero). Packed FP4 codes need no value check: every byte is a valid pair of codes."""

from __future__ import annotations

import torch

from moe_offload.checkpoint.reader import CheckpointError, CheckpointReader, detect_format
from moe_offload.formats import get_format
from moe_offload.formats.base import require_finite, require_global_scale


def _check_headers(reader: CheckpointReader, fmt) -> set[str]:
    """Presence, dtype and shape of every expert tensor; returns their names."""
    geo = reader.geometry
    fam = geo.family
    expert_names: set[str] = set()
    for layer in geo.moe_layers:
        if reader.has(fam.fused_gate_up.format(l=layer)):
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
                rows, cols = (geo.inter, geo.hidden) if which in ("gate", "up") else (geo.hidden, geo.inter)
                for suffix, (shape, dtype) in fmt.disk_tensors(rows, cols).items():
                    name = f"{prefix}.{suffix}"
                    got_dtype = reader.dtype_of(name)  # raises a named error if missing
                    got_shape = reader.shape_of(name)
                    if got_dtype != dtype or (shape is not None and got_shape != shape):
                        raise CheckpointError(
                            f"{reader.file_of(name)}: tensor {name} is {got_shape} {got_dtype}, expected "
                            f"{shape or 'scalar'} {dtype} for format {fmt.name}")
                    expert_names.add(name)
    return expert_names


def check_values(reader: CheckpointReader, fmt) -> int:
    """Read every float tensor and raise a named error on NaN/Inf (and on a zero global scale); returns
    the number of tensors checked."""
    checked = 0
    gsuffix = fmt.global_scale_suffix
    for name in reader.names():
        if not reader.dtype_of(name).is_floating_point:
            continue
        where = f"{reader.file_of(name)}: tensor {name}"
        t = reader.get(name)
        if gsuffix is not None and name.endswith("." + gsuffix):
            require_global_scale(t, where)
        else:
            require_finite(t, where)
        checked += 1
    return checked


def inspect_checkpoint(path: str, values: bool = True) -> dict:
    reader = CheckpointReader(path)
    fmt_name = detect_format(reader)
    fmt = get_format(fmt_name)
    geo = reader.geometry
    expert_names = _check_headers(reader, fmt)
    checked = check_values(reader, fmt) if values else 0
    total = 0
    expert_total = 0
    for name in reader.names():
        size = reader.dtype_of(name).itemsize
        for d in reader.shape_of(name):
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
        "expert_projection_names": dict(geo.family.proj),
        "bytes_per_expert": fmt.bytes_per_expert(geo.hidden, geo.inter),
        "bytes_per_expert_per_bank": {b.name: b.nbytes for b in fmt.banks(geo.hidden, geo.inter)},
        "expert_bytes_total": expert_total,
        "non_expert_bytes_total": total - expert_total,
        "tensors": len(reader.names()),
        "float_tensors_value_checked": checked,
    }
