"""One GEMM for an attention layer's q, k and v projections (CUDA; a decode step is launch-bound).

Legend: T tokens, H hidden, Q/KV output widths of q_proj and of k_proj/v_proj.

transformers' attention modules (Qwen3-MoE, Qwen3-Next, Mixtral) call ``q_proj(x)``, ``k_proj(x)`` and
``v_proj(x)`` on the same ``x``, in that order: three GEMVs of ~7 + 5 + 5 us per decode layer on an
H200, where the k and v ones read 2 MB each and are set by launch and tail, not bandwidth. Here the
three weights are one ``[Q + 2 KV, H]`` tensor (the modules' ``weight`` become views of it: no second
copy); ``q_proj(x)`` runs the fused GEMM and keeps the result for the k and v calls with that same
``x`` object (the v call drops it); a call with any other input computes its own slice, so a caller
that uses one projection alone still gets the right answer.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from moe_offload import log


class _Shared:
    __slots__ = ("x", "y_TN")

    def __init__(self):
        self.x = None
        self.y_TN = None


class _FusedProjection(nn.Module):
    """One of q/k/v over the fused weight: columns ``[lo, hi)`` of the fused output."""

    def __init__(self, weight_NH: torch.Tensor, bias_N, lo: int, hi: int, shared: _Shared, role: str):
        super().__init__()
        # plain tensors, not parameters: model.parameters() counts the q/k/v views below once each
        self.fused_weight, self.fused_bias = weight_NH, bias_N
        self.weight = nn.Parameter(weight_NH[lo:hi], requires_grad=False)
        self.bias = None if bias_N is None else nn.Parameter(bias_N[lo:hi], requires_grad=False)
        self.lo, self.hi, self.shared, self.role = lo, hi, shared, role
        self.in_features, self.out_features = weight_NH.shape[1], hi - lo

    def extra_repr(self) -> str:
        return f"{self.role}: columns [{self.lo}, {self.hi}) of a fused q/k/v GEMM"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sh = self.shared
        if self.role == "q":
            sh.x, sh.y_TN = x, F.linear(x, self.fused_weight, self.fused_bias)
            return sh.y_TN[..., self.lo:self.hi]
        if sh.x is x:
            out = sh.y_TN[..., self.lo:self.hi]
            if self.role == "v":
                sh.x = sh.y_TN = None
            return out
        return F.linear(x, self.weight, self.bias)


def fuse_qkv(model: nn.Module) -> int:
    """Give every attention module of ``model`` with plain ``nn.Linear`` q/k/v projections on one
    input width the fused GEMM; returns how many modules were changed."""
    n = 0
    for module in model.modules():
        projs = [getattr(module, name, None) for name in ("q_proj", "k_proj", "v_proj")]
        if not all(type(p) is nn.Linear for p in projs):
            continue
        if len({p.in_features for p in projs}) != 1 or len({p.weight.dtype for p in projs}) != 1:
            continue
        if len({p.bias is None for p in projs}) != 1:
            continue
        with torch.no_grad():
            weight = torch.cat([p.weight for p in projs])
            bias = None if projs[0].bias is None else torch.cat([p.bias for p in projs])
        shared = _Shared()
        lo = 0
        for name, p in zip(("q", "k", "v"), projs):
            setattr(module, f"{name}_proj", _FusedProjection(weight, bias, lo, lo + p.out_features, shared, name))
            lo += p.out_features
        n += 1
    log.event("fused_qkv", logging.DEBUG, modules=n)
    return n
