"""Declarative tables of the supported MoE families: expert tensor names on disk, the transformers
experts class to replace, and the model geometry read from config.json."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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

    def need(key: str, *alts: str):
        for k in (key, *alts):
            if k in cfg and cfg[k] is not None:
                return cfg[k]
        raise UnknownFamilyError(f"{source}: missing key {key!r}" + (f" (or {', '.join(alts)})" if alts else "") + f" for a {mt} model")

    n_layers = int(need("num_hidden_layers"))
    experts = int(need("num_experts", "num_local_experts"))
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
        top_k=int(need("num_experts_per_tok")),
        hidden=int(need("hidden_size")),
        inter=int(need(fam.inter_key)),
        vocab=int(need("vocab_size")),
    )
