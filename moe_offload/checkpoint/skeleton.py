"""A transformers model of a family built without its experts, and the on-disk <-> in-memory names.

The experts class of the family's modeling module is replaced by a parameter-free placeholder while
the model is built, so expert tensors are never allocated (works on transformers 5.17 and 5.24).
Used by the synthetic checkpoint writer (non-expert weights from transformers' own initialisation)
and by ``moe_offload.integrations.hf`` (which then swaps in the modules that compute the experts).
"""

from __future__ import annotations

import importlib
from contextlib import contextmanager

import torch
from torch import nn

from moe_offload.checkpoint.families import Family


class ExpertsPlaceholder(nn.Module):
    """Stands in for the family's experts module during construction; holds no tensors."""

    def __init__(self, config, *args, **kwargs):
        super().__init__()
        # transformers' _init_weights would look for gate_up_proj on an experts instance
        self._is_hf_initialized = True

    def forward(self, *args, **kwargs):
        raise RuntimeError("experts placeholder called: attach_experts() was not run on this model")


@contextmanager
def experts_class(family: Family, cls: type[nn.Module]):
    """Temporarily replace ``family.experts_class`` in its modeling module by ``cls``."""
    module = importlib.import_module(family.modeling_module)
    original = getattr(module, family.experts_class)
    setattr(module, family.experts_class, cls)
    try:
        yield
    finally:
        setattr(module, family.experts_class, original)


def hf_config(config_dict: dict, num_layers: int | None = None):
    """A transformers config from a config.json dict (quantization metadata stripped: we read it ourselves).

    Built from the dict by ``AutoConfig.for_model``: no code from the checkpoint dir is ever run."""
    from transformers import AutoConfig

    d = {k: v for k, v in config_dict.items() if k not in ("quantization_config", "architectures", "transformers_version")}
    model_type = d.pop("model_type")
    if num_layers is not None:
        d["num_hidden_layers"] = num_layers
        if "layer_types" in d and d["layer_types"] is not None:
            d["layer_types"] = list(d["layer_types"])[:num_layers]
    return AutoConfig.for_model(model_type, **d)


def build_skeleton(family: Family, config, dtype: torch.dtype, empty: bool = True) -> nn.Module:
    """Build the causal-LM with placeholder experts. ``empty``: parameters on meta (buffers real)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with experts_class(family, ExpertsPlaceholder):
        if empty:
            with init_empty_weights(include_buffers=False):
                model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model


def disk_name(family: Family, mem_name: str) -> str:
    """In-memory parameter name -> on-disk name (undo the family's renames, e.g. Mixtral's .mlp.)."""
    name = mem_name
    for disk, mem in family.renames:
        name = name.replace(mem, disk)
    return name
