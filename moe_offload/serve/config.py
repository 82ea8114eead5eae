"""The ``serve`` config section (typed, validated): batch and queue bounds, model length, names.

Until ``OffloadConfig`` grows a ``serve`` section, these keys come from ``--set serve.k=v`` on
``moe-offload serve`` (split off before the main config is loaded; see ``split_overrides``).
"""

from __future__ import annotations

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from moe_offload.config import ConfigError


class ServeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    max_batch: int = Field(16, ge=1, le=4096, description="sequences decoded together in one forward")
    max_queue: int = Field(64, ge=0, le=1_000_000, description="requests waiting for a batch slot; more get 429")
    max_model_len: int | None = Field(None, ge=2, description="prompt + max_tokens limit; null = the model's max positions")
    default_max_tokens: int = Field(16, ge=1, description="max_tokens of a request that gives none")
    model_name: str | None = Field(None, description="the id /v1/models reports; null = the checkpoint dir's name")


def split_overrides(overrides: list[str]) -> tuple[list[str], list[str]]:
    """``--set`` items -> (main config overrides, ``serve.*`` overrides without the prefix)."""
    main, serve = [], []
    for item in overrides:
        (serve.append(item[len("serve."):]) if item.startswith("serve.") else main.append(item))
    return main, serve


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
