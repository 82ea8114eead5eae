"""Declarative tables of the supported MoE families: expert tensor names on disk, the transformers
experts class to replace, and the model geometry read from config.json."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Callable


@dataclass(frozen=True)
class Family:
    model_type: str
    #: on-disk prefix of expert e of layer l's projection; ``{proj}`` is the on-disk projection name
    expert_prefix: str
    #: gate/up/down -> on-disk projection names
    proj: dict
    #: fused on-disk names (bf16 checkpoints written with ``save_original_format=False``)
    fused_gate_up: str
    fused_down: str
    #: transformers modeling module and the experts class replaced before construction
    modeling_module: str
    experts_class: str
    #: on-disk non-expert name -> in-memory name rewrites (prefix substitutions)
    renames: tuple = ()
    #: config key of the expert intermediate size
    inter_key: str = "moe_intermediate_size"
    #: non-expert linears never quantized (router gates, ...) - name fragments
    unquantized: tuple = ("mlp.gate", "lm_head")
    #: other on-disk projection names real exporters write (chosen per checkpoint by ``resolve_naming``)
    proj_alternatives: tuple = ()

    def expert_name(self, layer: int, expert: int, which: str) -> str:
        return self.expert_prefix.format(l=layer, e=expert, proj=self.proj[which])


FAMILIES: dict[str, Family] = {
    "qwen3_moe": Family(
        model_type="qwen3_moe",
        expert_prefix="model.layers.{l}.mlp.experts.{e}.{proj}",
        proj={"gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
        fused_gate_up="model.layers.{l}.mlp.experts.gate_up_proj",
        fused_down="model.layers.{l}.mlp.experts.down_proj",
        modeling_module="transformers.models.qwen3_moe.modeling_qwen3_moe",
        experts_class="Qwen3MoeExperts",
    ),
    "qwen3_next": Family(
        model_type="qwen3_next",
        expert_prefix="model.layers.{l}.mlp.experts.{e}.{proj}",
        proj={"gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
        fused_gate_up="model.layers.{l}.mlp.experts.gate_up_proj",
        fused_down="model.layers.{l}.mlp.experts.down_proj",
        modeling_module="transformers.models.qwen3_next.modeling_qwen3_next",
        experts_class="Qwen3NextExperts",
        unquantized=("mlp.gate", "shared_expert_gate", "lm_head", "linear_attn.in_proj_ba"),
    ),
    "mixtral": Family(
        model_type="mixtral",
        expert_prefix="model.layers.{l}.block_sparse_moe.experts.{e}.{proj}",
        proj={"gate": "w1", "up": "w3", "down": "w2"},
        fused_gate_up="model.layers.{l}.mlp.experts.gate_up_proj",
        fused_down="model.layers.{l}.mlp.experts.down_proj",
        modeling_module="transformers.models.mixtral.modeling_mixtral",
        experts_class="MixtralExperts",
        renames=((".block_sparse_moe.", ".mlp."),),
        inter_key="intermediate_size",
        unquantized=("block_sparse_moe.gate", "mlp.gate", "lm_head"),
        # llm-compressor's Mixtral exports name the experts' projections as the Llama MLP does
        proj_alternatives=({"gate": "gate_proj", "up": "up_proj", "down": "down_proj"},),
    ),
}


class UnknownFamilyError(ValueError):
    pass


@dataclass(frozen=True)
class ModelGeometry:
    """Shapes that matter to the runtime, read from config.json."""

    family: Family
    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    hidden: int
    inter: int
    vocab: int

    @property
    def model_type(self) -> str:
        return self.family.model_type


def geometry_from_config(cfg: dict[str, Any], source: str = "config.json") -> ModelGeometry:
    """Parse a config.json dict; accepts ``num_experts`` and ``num_local_experts``."""
    mt = cfg.get("model_type")
    if mt not in FAMILIES:
        raise UnknownFamilyError(
            f"{source}: model_type {mt!r} is not supported; supported families: {', '.join(FAMILIES)}"
        )
    fam = FAMILIES[mt]

    def need(key: str, *alts: str, low: int = 1) -> int:
        """The first of ``key, *alts`` present: an integer of at least ``low`` (JSON numbers only: a string such as
        "64" would pass here and fail deep inside transformers' config classes)."""
        for k in (key, *alts):
            if k in cfg and cfg[k] is not None:
                v = cfg[k]
                if isinstance(v, bool) or not isinstance(v, int) or v < low:
                    raise UnknownFamilyError(f"{source}: {k} is {v!r}; it must be an integer >= {low} (a JSON number, "
                                             "not a string); fix config.json")
                return v
        raise UnknownFamilyError(f"{source}: missing key {key!r}" + (f" (or {', '.join(alts)})" if alts else "") + f" for a {mt} model")

    n_layers = need("num_hidden_layers")
    experts = need("num_experts", "num_local_experts")
    top_k = need("num_experts_per_tok")
    if top_k > experts:
        raise UnknownFamilyError(f"{source}: num_experts_per_tok={top_k} routes each token to more experts than the "
                                 f"{experts} a layer has; fix config.json (num_experts_per_tok <= the expert count)")
    if mt == "mixtral":
        moe_layers = tuple(range(n_layers))
    else:
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        mlp_only = set(cfg.get("mlp_only_layers") or [])
        moe_layers = tuple(i for i in range(n_layers) if i not in mlp_only and experts > 0 and (i + 1) % step == 0)
    return ModelGeometry(
        family=fam,
        num_layers=n_layers,
        moe_layers=moe_layers,
        num_experts=experts,
        top_k=top_k,
        hidden=need("hidden_size"),
        inter=need(fam.inter_key),
        vocab=need("vocab_size"),
    )


_WEIGHT_SUFFIXES = ("weight", "weight_packed")


def resolve_naming(geo: ModelGeometry, has: Callable[[str], bool]) -> ModelGeometry:
    """``geo`` with the family's projection names that this checkpoint uses (Mixtral: ``w1/w3/w2`` as
    transformers writes them, or ``gate_proj/up_proj/down_proj`` as llm-compressor does)."""
    fam = geo.family
    if not geo.moe_layers or not fam.proj_alternatives:
        return geo
    layer = geo.moe_layers[0]
    for proj in (fam.proj, *fam.proj_alternatives):
        cand = replace(fam, proj=proj)
        if any(has(f"{cand.expert_name(layer, 0, 'gate')}.{s}") for s in _WEIGHT_SUFFIXES):
            return replace(geo, family=cand)
    return geo


def layers_past_config(geo: ModelGeometry, names: list[str]) -> list[int]:
    """Decoder layers whose tensors the checkpoint holds at or past config.json's ``num_hidden_layers`` (a config
    lowered to run a truncated model, or one that does not match its weights)."""
    layer_prefix = re.escape(geo.family.expert_prefix.split("{l}")[0]) + r"(\d+)\."
    return sorted({int(m.group(1)) for n in names if (m := re.match(layer_prefix, n)) and int(m.group(1)) >= geo.num_layers})


def expert_count_error(geo: ModelGeometry, names: list[str], count_key: str) -> str | None:
    """Where the per-expert tensors disagree with config.json's expert count, a message naming the layer,
    the expert indices found and the fix; None when they agree (or the experts are stored fused)."""
    pattern = re.escape(geo.family.expert_prefix).replace(r"\{l\}", r"(\d+)").replace(r"\{e\}", r"(\d+)")
    pattern = pattern.replace(r"\{proj\}", r"[^.]+")
    rx = re.compile(pattern + r"\.")
    seen: dict[int, set[int]] = {}
    for n in names:
        m = rx.match(n)
        if m:
            seen.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    E = geo.num_experts
    for layer in sorted(seen):
        idx = seen[layer]
        if max(idx) >= E:
            return (f"config.json {count_key}={E} but layer {layer} has tensors for expert {max(idx)} "
                    f"({len(idx)} experts on disk); set {count_key} to the number of experts the weights hold")
        if layer in geo.moe_layers and len(idx) < E:
            missing = sorted(set(range(E)) - idx)
            return (f"config.json {count_key}={E} but layer {layer} has tensors for {len(idx)} experts only "
                    f"(missing {missing[:8]}{'...' if len(missing) > 8 else ''}); set {count_key} to the number of "
                    "experts the weights hold, or complete the checkpoint")
    return None
