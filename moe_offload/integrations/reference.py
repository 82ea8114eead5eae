"""The correctness oracle: plain transformers (the family's own experts class, eager) on the same
weights, dequantized to ``dtype``, no offload. Also the 'fully on the GPU' ceiling of the benchmarks."""

from __future__ import annotations

import importlib

import torch

from moe_offload.checkpoint.reader import CheckpointReader, detect_format
from moe_offload.formats import get_format
from moe_offload.formats.base import TpSlice
from moe_offload.integrations.hf import attach_experts, build_skeleton, check_no_meta, hf_config, load_non_expert_weights


def dequantized_experts(reader: CheckpointReader, layer: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """All experts of ``layer`` as ``(gate_up [E, 2I, H], down [E, H, I])`` in ``dtype``."""
    fmt = get_format(detect_format(reader))
    geo = reader.geometry
    fam = geo.family
    per_expert = [fmt.read_expert(reader, lambda w, e=e: fam.expert_name(layer, e, w), geo.hidden, geo.inter, TpSlice())
                  for e in range(geo.num_experts)]
    views = {k: torch.stack([p[k] for p in per_expert]) for k in per_expert[0]}
    return fmt.dequantize(views, dtype)


def build_reference_model(path: str, dtype: torch.dtype = torch.float32, device: str = "cpu",
                          experts_implementation: str = "eager") -> torch.nn.Module:
    reader = CheckpointReader(path)
    fmt = get_format(detect_format(reader))
    fam = reader.geometry.family
    config = hf_config(reader.config)
    config._experts_implementation = experts_implementation
    model = build_skeleton(fam, config, dtype, empty=True)
    load_non_expert_weights(model, reader, fmt, dtype)
    experts_cls = getattr(importlib.import_module(fam.modeling_module), fam.experts_class)

    def make(layer: int, _placeholder):
        mod = experts_cls(config)
        gate_up, down = dequantized_experts(reader, layer, dtype)
        mod.gate_up_proj = torch.nn.Parameter(gate_up, requires_grad=False)
        mod.down_proj = torch.nn.Parameter(down, requires_grad=False)
        return mod

    attach_experts(model, make)
    model.to(device).eval()
    check_no_meta(model)
    return model
