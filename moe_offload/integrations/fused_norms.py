"""Swap the RMSNorm modules of a built transformers model for one fused kernel each (CUDA).

A decode step is launch-bound: a Qwen3-MoE layer has four RMSNorms (input, post-attention, q and k
norms) at ~6 kernels each in module form. ``kernels/rmsnorm.py`` does one norm in one kernel with the
modules' rounding steps. Only the classes listed here are swapped (their formula is checked against
``rms_norm_reference`` in the tests); other norms keep their forward.
"""

from __future__ import annotations

import logging

import torch

from moe_offload import log

#: module class name -> how its weight scales the normalized input (kernels/rmsnorm.py)
FLAVOURS = {"Qwen3MoeRMSNorm": "weight", "MixtralRMSNorm": "weight", "Qwen3NextRMSNorm": "one_plus_weight"}


def _eps(module) -> float:
    for name in ("variance_epsilon", "eps"):
        if hasattr(module, name):
            return float(getattr(module, name))
    raise AttributeError(f"{type(module).__name__} has no variance_epsilon/eps")


def fuse_rms_norms(model: torch.nn.Module) -> int:
    """Give every listed RMSNorm module of ``model`` the fused forward; returns how many."""
    from moe_offload.kernels.rmsnorm import rms_norm

    n = 0
    for module in model.modules():
        scale = FLAVOURS.get(type(module).__name__)
        if scale is None:
            continue
        eps, weight = _eps(module), module.weight

        def forward(hidden_states, _w=weight, _eps=eps, _scale=scale):
            return rms_norm(hidden_states, _w, _eps, _scale)

        module.forward = forward
        n += 1
    log.event("fused_rms_norms", logging.DEBUG, modules=n)
    return n
