"""Fused replacements for the launch-bound small ops of a decode step (CUDA): RMSNorm, the decoder layers'
residual adds, rotary, the router's softmax + top-k, and grouped-query decode attention without repeated K/V.

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


#: decoder layer class name -> its MoE block class name: layers whose forward is ``h = x + attn(norm1(x));
#: out = h + mlp(norm2(h))`` (attention called with the layer's keyword arguments), MoE blocks whose forward is
#: ``gate`` -> ``experts(x, ids, weights)`` -> reshape (Mixtral's jitter only in training)
RESIDUAL_LAYERS = {"Qwen3MoeDecoderLayer": "Qwen3MoeSparseMoeBlock", "MixtralDecoderLayer": "MixtralSparseMoeBlock"}


def fuse_residual_adds(model: torch.nn.Module, on_cpu: bool = False) -> int:
    """Give every listed decoder layer of ``model`` a forward whose two residual adds share launches with their
    neighbours (CUDA, or also CPU tensors with ``on_cpu``, which runs the kernels only under Triton's interpreter:
    tests; keyword-argument calls, eval mode; anything else runs the layer's own forward):
    - after attention, ``h = x + attn`` and ``post_attention_layernorm(h)`` are one launch
      (``kernels/rmsnorm.py`` ``add_rms_norm``);
    - after the MoE block, ``h + moe`` is added by the MoE's own sum over K where the experts are
      ``OffloadedExperts`` on the decode path of one rank (``kernels/moe_sum.py``); elsewhere a torch add (experts
      sharded with no reduce of their own, i.e. a host that reduces: the layer's own ``h + mlp(x)``).
    Activations whose dtype differs from the residual stream's or the norm weight's (autocast, mixed dtypes)
    take the layer's own arithmetic.
    Two launches fewer per layer and step, same roundings as the layer (bit-equal to the unfused fused-kernel
    path; see tests). Returns how many layers."""
    from moe_offload.experts import OffloadedExperts
    from moe_offload.kernels.rmsnorm import add_rms_norm, add_rms_norm_split

    n = 0
    for layer in model.modules():
        block_name = RESIDUAL_LAYERS.get(type(layer).__name__)
        post = getattr(layer, "post_attention_layernorm", None)
        if block_name is None or post is None or FLAVOURS.get(type(post).__name__) is None:
            continue
        original = type(layer).forward.__get__(layer)
        flavour, eps = FLAVOURS[type(post).__name__], _eps(post)

        def forward(hidden_states, *args, _layer=layer, _original=original, _post=post, _eps=eps, _scale=flavour,
                    _block=block_name, **kwargs):
            if (args or not (hidden_states.is_cuda or on_cpu) or _layer.training
                    or torch.is_autocast_enabled(hidden_states.device.type)):
                return _original(hidden_states, *args, **kwargs)
            attn, _ = _layer.self_attn(hidden_states=_layer.input_layernorm(hidden_states), **kwargs)
            if attn.dtype != hidden_states.dtype or _post.weight.dtype != attn.dtype:  # the layer's promotions
                h = hidden_states + attn
                return h + _layer.mlp(_post(h))
            mlp = _layer.mlp
            experts = getattr(mlp, "experts", None)
            if type(mlp).__name__ == _block and isinstance(experts, OffloadedExperts) and experts.adds_residual:
                B, S, H = attn.shape
                # the swapped tile kernels' split activations written by the norm too (one copy launch fewer)
                split_k = experts.split_block_k(attn.reshape(-1, H))
                h, normed, x_split = add_rms_norm_split(attn, hidden_states, _post.weight, _eps, _scale, split_k)
                x = normed.view(-1, H)
                _, weights, ids = mlp.gate(x)
                kw = {} if x_split is None else {"x_split_TH": x_split}
                return experts(x, ids, weights, residual_TH=h.view(-1, H), **kw).view(B, S, H)
            h, normed = add_rms_norm(attn, hidden_states, _post.weight, _eps, _scale)
            return h + mlp(normed)

        layer.forward = forward
        n += 1
    log.event("fused_residual_adds", logging.DEBUG, layers=n)
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


#: router module class name -> (whether its top-k weights are cast to the logits' dtype, whether they
#: are always renormalized; else the module's ``norm_topk_prob`` says) (kernels/router.py)
ROUTERS = {"Qwen3MoeTopKRouter": (True, False), "Qwen3NextTopKRouter": (True, False),
           "MixtralTopKRouter": (False, True)}


def fuse_routers(model: torch.nn.Module, gemm_max_tokens: int = 0, route_plan_max_pairs: int = 0) -> int:
    """Give every listed router module of ``model`` a forward whose softmax + top-k + renormalization
    is one kernel (``kernels/router.py``) on CUDA; the logits stay ``F.linear``. Where the router's MoE block
    holds ``OffloadedExperts`` (``gate`` beside ``experts``), a forward on their fused decode path runs that kernel and
    the misses' plan in one launch (``OffloadedExperts.route``, forwards of at most ``route_plan_max_pairs`` routed
    pairs). Forwards of at most ``gemm_max_tokens`` tokens that the plan launch does not take compute the logits in
    that kernel too (``router_gemm_topk``: one launch instead of torch's GEMM and the top-k kernel). Returns how
    many."""
    import torch.nn.functional as F

    from moe_offload.experts import OffloadedExperts
    from moe_offload.kernels.router import router_counters, router_gemm_topk, router_topk

    experts_of = {id(block.gate): block.experts for block in model.modules()
                  if isinstance(getattr(block, "experts", None), OffloadedExperts) and hasattr(block, "gate")}
    n = 0
    for module in model.modules():
        kind = ROUTERS.get(type(module).__name__)
        if kind is None:
            continue
        cast, always = kind
        renorm = always or bool(getattr(module, "norm_topk_prob", False))
        original = type(module).forward.__get__(module)
        experts = experts_of.get(id(module))
        counters = (router_counters(gemm_max_tokens, module.weight.device)
                    if gemm_max_tokens > 0 and module.weight.is_cuda else None)
        plan_pairs = route_plan_max_pairs if experts is not None else 0

        def forward(hidden_states, _m=module, _cast=cast, _renorm=renorm, _original=original, _experts=experts,
                    _counters=counters, _plan_pairs=plan_pairs):
            if not hidden_states.is_cuda:
                return _original(hidden_states)
            x = hidden_states.reshape(-1, _m.hidden_dim)
            w_dtype = x.dtype if _cast else torch.float32
            T = x.shape[0]
            if _counters is not None and T <= gemm_max_tokens and T * _m.top_k > _plan_pairs:
                return router_gemm_topk(x if x.stride(1) == 1 else x.contiguous(), _m.weight, _m.top_k, _renorm,
                                        w_dtype, _counters)
            logits_TE = F.linear(x, _m.weight)
            routed = None if _experts is None else _experts.route(x, logits_TE, _m.top_k, _renorm, w_dtype)
            w_TK, ids_TK = routed if routed is not None else router_topk(logits_TE, _m.top_k, _renorm, w_dtype)
            return logits_TE, w_TK, ids_TK

        module.forward = forward
        n += 1
    log.event("fused_routers", logging.DEBUG, modules=n, gemm_max_tokens=gemm_max_tokens)
    return n


def gqa_decode_sdpa(original):
    """An ``sdpa`` attention function that, for modules marked by ``mark_gqa_decode`` and one query
    position, folds the query heads of each KV head into the query-length dim
    (``[B, Hkv * G, 1, D] -> [B, Hkv, G, D]``) instead of repeating K and V G times: one SDPA call
    on the cache as it is. transformers' sdpa path repeats K/V whenever a mask is given (two copies
    of the whole static cache per layer and step, ~22 us of an H200 decode layer at 1k positions).
    Everything else goes to ``original``."""

    def forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
        G = getattr(module, "num_key_value_groups", 1)
        B, Hq, Tq, D = query.shape
        mask_ok = attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[1] == 1
                                             and attention_mask.shape[2] == 1)
        kernel = getattr(module, "_moe_offload_gqa_decode", None)
        if (kernel and G > 1 and Tq == 1 and dropout == 0.0 and mask_ok
                and kwargs.get("position_bias") is None and not kwargs.get("output_attentions", False)
                and key.shape[1] * G == Hq):
            q = query.reshape(B, key.shape[1], G, D)
            if kernel == "triton" and value.shape[-1] == D:
                from moe_offload.kernels.decode_attention import decode_attention

                mask = None if attention_mask is None else attention_mask[..., :key.shape[-2]]
                out = decode_attention(q, key, value, mask, D ** -0.5 if scaling is None else scaling)
            else:
                out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask,
                                                                       dropout_p=0.0, scale=scaling, is_causal=False)
            return out.reshape(B, Hq, 1, value.shape[-1]).transpose(1, 2).contiguous(), None
        return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                        is_causal=is_causal, **kwargs)

    forward._moe_offload_gqa = True
    return forward


#: ``compute.decode_attention``: what a marked module's one-position attention runs
DECODE_ATTENTION = ("sdpa", "triton")


def mark_gqa_decode(model: torch.nn.Module, kernel: str = "sdpa") -> int:
    """Route the decode attention of ``model``'s grouped-query attention modules through
    ``gqa_decode_sdpa`` (installed once in transformers' attention registry; modules of other models
    keep the stock path), running ``kernel``: ``sdpa`` (torch's SDPA on the folded query) or ``triton``
    (``kernels/decode_attention.py``, split-K). Returns how many modules were marked."""
    if kernel not in DECODE_ATTENTION:
        raise ValueError(f"compute.decode_attention={kernel!r}: expected one of {', '.join(DECODE_ATTENTION)}")
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    current = ALL_ATTENTION_FUNCTIONS["sdpa"]
    if not getattr(current, "_moe_offload_gqa", False):
        ALL_ATTENTION_FUNCTIONS["sdpa"] = gqa_decode_sdpa(current)
    n = 0
    for module in model.modules():
        if getattr(module, "num_key_value_groups", 1) > 1 and hasattr(module, "o_proj"):
            module._moe_offload_gqa_decode = kernel
            n += 1
    log.event("gqa_decode_attention", logging.DEBUG, modules=n, kernel=kernel)
    return n


def fuse_decode_ops(model: torch.nn.Module, compute) -> None:
    """Every fusion of this package that ``compute`` (the config's ``compute`` section) asks for, in the order
    they build on each other (``compute.fused_norms``; the engine calls it on CUDA)."""
    from moe_offload.integrations.fused_qkv import fuse_qk_norm_rope, fuse_qkv

    fuse_rms_norms(model)
    fuse_residual_adds(model)
    fuse_rotary()
    fuse_routers(model, compute.router_gemm_max_tokens, compute.route_plan_max_pairs)
    mark_gqa_decode(model, compute.decode_attention)
    fuse_qkv(model)
    if compute.fused_qk_rope:
        fuse_qk_norm_rope(model)
