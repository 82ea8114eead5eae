"""Plug offloaded experts into transformers 5.x MoE models.

The experts class of the family's modeling module is replaced by a parameter-free placeholder while
the model is built (so expert tensors are never allocated or read by transformers; works on 5.17 and
5.24, see reference/transformers-facts.md section 2.2), non-expert weights are loaded by us (NVFP4
linears dequantized with each layout's global-scale semantics), then every placeholder is swapped
for the module that really computes the experts (``OffloadedExperts`` or, for the oracle, the
family's own experts class filled with dequantized weights).
"""

from __future__ import annotations

import re
from typing import Callable

import torch
from torch import nn

from moe_offload.checkpoint.reader import CheckpointError, CheckpointReader
from moe_offload.checkpoint.skeleton import ExpertsPlaceholder, build_skeleton, disk_name, experts_class, hf_config
from moe_offload.formats.base import ExpertFormat

# the skeleton helpers live in moe_offload.checkpoint.skeleton (the synthetic writer needs them too)
__all__ = ["ExpertsPlaceholder", "attach_experts", "build_skeleton", "check_no_meta", "disk_name", "experts_class",
           "hf_config", "layer_of", "load_non_expert_weights"]

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_of(module_name: str) -> int:
    m = _LAYER_RE.search(module_name)
    if not m:
        raise ValueError(f"cannot find a layer index in module name {module_name!r}")
    return int(m.group(1))


def load_non_expert_weights(model: nn.Module, reader: CheckpointReader, fmt: ExpertFormat, dtype: torch.dtype) -> int:
    """Fill every parameter of ``model`` (experts excluded: placeholders own none) from ``reader``.

    NVFP4-quantized linears are dequantized to ``dtype`` with the layout's global-scale semantics.
    Returns the number of bytes loaded.
    """
    family = reader.geometry.family
    state: dict[str, torch.Tensor] = {}
    params = dict(model.named_parameters())
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for name, param in params.items():
        src = disk_name(family, name)
        if reader.has(src) and reader.dtype_of(src).is_floating_point and reader.dtype_of(src).itemsize >= 2:
            t = reader.get(src)
        else:
            prefix = src[: -len(".weight")] if src.endswith(".weight") else src
            try:
                t = fmt.read_linear(reader, prefix, dtype) if src.endswith(".weight") else None
            except (CheckpointError, torch.OutOfMemoryError):
                raise
            except (RuntimeError, ValueError) as exc:  # e.g. packed codes and block scales of different shapes
                raise CheckpointError(
                    f"{reader.path}: the quantized linear {prefix} (for model parameter {name}) does not dequantize: "
                    f"its tensors' shapes disagree ({str(exc).splitlines()[0]}); the checkpoint is corrupt or not "
                    f"format {fmt.name}") from None
            if t is None:
                if tied and name == "lm_head.weight":
                    continue
                raise CheckpointError(
                    f"{reader.path}: tensor {src} (for model parameter {name}) is missing; the checkpoint does not "
                    f"match its config.json or format {fmt.name}"
                )
        if tuple(t.shape) != tuple(param.shape):
            raise CheckpointError(
                f"{reader.file_of(src)}: tensor {src} has shape {tuple(t.shape)}, the model expects {tuple(param.shape)}; "
                "config.json and the weights disagree"
            )
        state[name] = t.to(dtype)
    missing, _unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not (tied and m == "lm_head.weight")]
    if missing:
        raise CheckpointError(f"{reader.path}: no weights for {missing[:5]}{'...' if len(missing) > 5 else ''}")
    if tied:
        model.tie_weights()
    return sum(t.numel() * t.element_size() for t in state.values())


def attach_experts(model: nn.Module, make: Callable[[int, nn.Module], nn.Module]) -> list[int]:
    """Replace every ``ExpertsPlaceholder`` by ``make(layer_idx, placeholder)``; returns the layers."""
    layers = []
    for name, mod in list(model.named_modules()):
        if isinstance(mod, ExpertsPlaceholder):
            layer = layer_of(name)
            model.set_submodule(name, make(layer, mod))
            layers.append(layer)
    if not layers:
        raise RuntimeError("no MoE experts placeholders found: was the model built with build_skeleton()?")
    return layers


def check_no_meta(model: nn.Module) -> None:
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_meta:
            raise RuntimeError(f"model tensor {name} was never loaded (still on the meta device)")
