"""The ``serve`` config section: ``ServeConfig`` lives in the one config tree (``OffloadConfig.serve``,
YAML ``serve:`` or ``--set serve.k=v``); ``load_serve_config`` builds one from ``key=value`` items alone
(tests and embedders without a whole config). ``decode_kv_kind`` says which decode batch serving uses."""

from __future__ import annotations

import torch
import yaml
from pydantic import ValidationError

from moe_offload.config import ConfigError, OffloadConfig, ServeConfig

__all__ = ["ServeConfig", "decode_kv_kind", "load_serve_config"]


def decode_kv_kind(cfg: OffloadConfig, device: torch.device) -> str:
    """``serve.kv_cache`` when set, else ``static`` (the per-row static KV cache, each decode step a CUDA
    graph replay: serve/static_batch.py) on CUDA with ``decode.cuda_graphs`` (the key that turns decode graphs on and off everywhere), else
    ``dynamic`` (one left-padded transformers cache, eager: serve/kv.py)."""
    if cfg.serve.kv_cache != "auto":
        return cfg.serve.kv_cache
    return "static" if device.type == "cuda" and cfg.decode.cuda_graphs else "dynamic"


def load_serve_config(overrides: list[str]) -> ServeConfig:
    """``["max_batch=8", ...]`` -> a validated ServeConfig (errors name the key and what is accepted)."""
    tree = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set serve.{item!r}: expected key=value, e.g. --set serve.max_queue=32")
        key, raw = item.split("=", 1)
        tree[key.strip()] = yaml.safe_load(raw) if raw.strip() else ""
    try:
        return ServeConfig.model_validate(tree)
    except ValidationError as err:
        lines = []
        for e in err.errors():
            key = "serve." + ".".join(str(p) for p in e["loc"])
            if e["type"] == "extra_forbidden":
                lines.append(f"unknown key '{key}'; accepted: " + ", ".join(ServeConfig.model_fields))
            else:
                lines.append(f"bad value for '{key}': got {e.get('input')!r}; {e['msg']}")
        raise ConfigError("\n".join(lines)) from None
