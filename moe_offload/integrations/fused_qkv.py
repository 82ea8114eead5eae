"""One GEMM for an attention layer's q, k and v projections (CUDA; a decode step is launch-bound).

Legend: T tokens, H hidden, Q/KV output widths of q_proj and of k_proj/v_proj.

transformers' attention modules (Qwen3-MoE, Qwen3-Next, Mixtral) call ``q_proj(x)``, ``k_proj(x)`` and
``v_proj(x)`` on the same ``x``, in that order: three GEMVs of ~7 + 5 + 5 us per decode layer on an
H200, where the k and v ones read 2 MB each and are set by launch and tail, not bandwidth. Here the
three weights are one ``[Q + 2 KV, H]`` tensor (the modules' ``weight`` become views of it: no second
copy); ``q_proj(x)`` runs the fused GEMM and keeps the result for the k and v calls with that same
``x`` object (the v call drops it); a call with any other input computes its own slice, so a caller
that uses one projection alone still gets the right answer.

``fuse_qk_norm_rope`` (Qwen3-MoE, after ``fuse_qkv``): over a decoder's static cache, the module's q/k RMSNorms,
rotary embedding and KV write after that GEMM are one kernel (``kernels/qk_norm_rope.py``), same bits.
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


#: attention class name -> its q/k norm class name: modules whose forward is ``q = rope(q_norm(q_proj(x)))``,
#: ``k = rope(k_norm(k_proj(x)))``, ``v = v_proj(x)``, then the cache update and the attention function
NORM_ROPE_ATTENTION = {"Qwen3MoeAttention": "Qwen3MoeRMSNorm"}
_OWN_KWARGS = ("hidden_states", "position_embeddings", "attention_mask", "cache", "past_key_values")


def fuse_qk_norm_rope(model: nn.Module, on_cpu: bool = False) -> int:
    """Give every listed attention module of ``model`` whose q/k/v are fused (``fuse_qkv`` first) a forward that,
    over a decoder's static cache (``decode_graph.SharedStartLayer``, initialized), runs the q/k RMSNorms, the
    rotary embedding and the KV write in one launch (``kernels/qk_norm_rope.py``) instead of four; same bits.
    Anything else (another cache, its first call, positional arguments, training, an attention implementation
    other than sdpa, CPU tensors unless ``on_cpu``, which runs the kernel in Triton's interpreter: tests) runs the
    module's own forward. Returns how many modules."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from moe_offload.decode_graph import SharedStartLayer
    from moe_offload.integrations.fused_norms import _eps
    from moe_offload.kernels.qk_norm_rope import qk_norm_rope_write

    n = 0
    for module in model.modules():
        norm = NORM_ROPE_ATTENTION.get(type(module).__name__)
        projs = [getattr(module, f"{p}_proj", None) for p in "qkv"]
        if norm is None or not all(isinstance(p, _FusedProjection) for p in projs):
            continue
        if len({id(p.shared) for p in projs}) != 1 or any(type(getattr(module, f"{p}_norm", None)).__name__ != norm
                                                          for p in "qk"):
            continue
        eps = _eps(module.q_norm)
        if _eps(module.k_norm) != eps:
            continue
        q = projs[0]
        heads = (q.out_features // module.head_dim, projs[1].out_features // module.head_dim)
        original = type(module).forward.__get__(module)

        def forward(*args, _m=module, _original=original, _q=q, _heads=heads, _eps=eps, **kwargs):
            x, cache, pe = kwargs.get("hidden_states"), kwargs.get("cache", kwargs.get("past_key_values")), \
                kwargs.get("position_embeddings")
            layers = getattr(cache, "layers", None)
            layer = layers[_m.layer_idx] if layers is not None and _m.layer_idx < len(layers) else None
            if (args or x is None or pe is None or not isinstance(layer, SharedStartLayer) or not layer.is_initialized
                    or not (x.is_cuda or on_cpu) or _m.training or _m.config._attn_implementation != "sdpa"
                    or kwargs.get("output_attentions") or pe[0].dim() != 3 or pe[0].shape[-1] != _m.head_dim):
                return _original(*args, **kwargs)
            B, T = x.shape[:2]
            cos, sin = pe
            q_BHTD = qk_norm_rope_write(F.linear(x, _q.fused_weight, _q.fused_bias), _heads, _m.q_norm.weight,
                                        _m.k_norm.weight, _eps, cos, sin, layer.keys, layer.values,
                                        layer.start_0.view(1).expand(B))
            keys, values = layer.keys, layer.values
            if layer.window is not None:
                keys, values = keys[:, :, :layer.window], values[:, :, :layer.window]
            rest = {k: v for k, v in kwargs.items() if k not in _OWN_KWARGS}
            out, weights = ALL_ATTENTION_FUNCTIONS["sdpa"](_m, q_BHTD, keys, values, kwargs.get("attention_mask"),
                                                           dropout=0.0, scaling=_m.scaling,
                                                           sliding_window=getattr(_m, "sliding_window", None), **rest)
            return _m.o_proj(out.reshape(B, T, -1).contiguous()), weights

        module.forward = forward
        n += 1
    log.event("fused_qk_norm_rope", logging.DEBUG, modules=n)
    return n
