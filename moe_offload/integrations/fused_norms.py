"""Fused replacements for the launch-bound small ops of a decode step (CUDA): RMSNorm and rotary.

RMSNorm: the modules of a built transformers model get a forward that runs one fused kernel each.

A decode step is launch-bound: a Qwen3-MoE layer has four RMSNorms (input, post-attention, q and k
norms) at ~6 kernels each in module form. ``kernels/rmsnorm.py`` does one norm in one kernel with the
modules' rounding steps. Only the classes listed here are swapped (their formula is checked against
``rms_norm_reference`` in the tests); other norms keep their forward.

Rotary: ``apply_rotary_pos_emb`` of the families listed in ``ROTARY_MODULES`` is replaced, in that
transformers module (so for every model of the family in this process), by a wrapper that runs
``kernels/rotary.py`` on CUDA tensors with the default layout and the original function otherwise.
Qwen3-Next (partial rotary) keeps its own.
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


#: transformers modeling modules whose apply_rotary_pos_emb is the full-head-dim, unsqueeze_dim=1 form
ROTARY_MODULES = ("transformers.models.qwen3_moe.modeling_qwen3_moe", "transformers.models.mixtral.modeling_mixtral")


def fuse_rotary() -> int:
    """Install the fused rotary wrapper in each listed family module (idempotent); returns how many."""
    import importlib

    from moe_offload.kernels.rotary import apply_rotary

    n = 0
    for name in ROTARY_MODULES:
        mod = importlib.import_module(name)
        original = mod.apply_rotary_pos_emb
        if getattr(original, "_moe_offload_fused", False):
            n += 1
            continue

        def fused(q, k, cos, sin, unsqueeze_dim=1, _original=original):
            if q.is_cuda and unsqueeze_dim == 1 and cos.dim() == 3 and q.shape[-1] == cos.shape[-1]:
                return apply_rotary(q, k, cos, sin)
            return _original(q, k, cos, sin, unsqueeze_dim)

        fused._moe_offload_fused = True
        mod.apply_rotary_pos_emb = fused
        n += 1
    log.event("fused_rotary", logging.DEBUG, modules=n)
    return n
