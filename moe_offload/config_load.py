"""Reading a config in and writing it out: the YAML file (or the embedded default) with a duplicate-key check,
the ``--set a.b=c`` overrides, validation into an ``OffloadConfig``, and pydantic's errors turned into
``ConfigError`` lines that name the key, the bad value and what is accepted; ``config_to_dict`` for results files.

The typed tree itself is config.py's; this module's public names are importable from there too.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import yaml
from pydantic import BaseModel, ValidationError

from moe_offload.config import ConfigError, OffloadConfig


def _format_error(err: ValidationError, source: str) -> ConfigError:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            parent = _model_at(e["loc"][:-1])
            accepted = ", ".join(parent.model_fields) if parent else "?"
            lines.append(f"unknown key '{key}' in {source}; accepted keys here: {accepted}")
        else:
            lines.append(f"bad value for '{key}' in {source}: got {e.get('input')!r}; {e['msg']}")
    return ConfigError("\n".join(lines))


def _model_at(loc: tuple) -> type[BaseModel] | None:
    model: type[BaseModel] = OffloadConfig
    for part in loc:
        field = model.model_fields.get(str(part))
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return None
        model = field.annotation
    return model


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load`` that refuses a key given twice in one mapping (plain YAML keeps the last one silently, so
    a config that sets ``cache.budget`` twice would run the one its author did not mean)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # "<<: *anchor": SafeLoader merges it
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is given twice in one section; keep one", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def _apply_override(tree: dict, assignment: str) -> None:
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r}: expected key=value, e.g. --set cache.budget=0.5")
    key, raw = assignment.split("=", 1)
    parts = key.strip().split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {assignment!r}: '{p}' is not a section")
    try:
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {assignment!r}: the value is not valid YAML ({str(exc).splitlines()[0]}); quote "
                          "a string, e.g. --set 'model.checkpoint=\"dir\"'") from None


def default_config_text() -> str:
    """The embedded default config (configs/tiny.yaml, packaged as moe_offload.configs)."""
    return resources.files("moe_offload.configs").joinpath("tiny.yaml").read_text()


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> OffloadConfig:
    """Load ``path`` (or the embedded default), apply ``key=value`` overrides, validate."""
    if path is None:
        text, source = default_config_text(), "embedded configs/tiny.yaml"
    else:
        p = Path(path)
        if p.is_dir():
            raise ConfigError(f"config file {p} is a directory; pass a YAML file (e.g. configs/qwen3-30b-a3b-nvfp4.yaml) "
                              "or omit --config for the embedded default")
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist; pass an existing YAML file or omit --config for the embedded default")
        try:
            text, source = p.read_text(encoding="utf-8"), str(p)
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config file {p} is not UTF-8 text ({exc.reason} at byte {exc.start}); save it as "
                              "UTF-8 YAML") from None
    try:
        tree = yaml.load(text, Loader=_UniqueKeyLoader) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source} is not valid YAML: {exc}") from exc
    if not isinstance(tree, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections (model, cache, ...)")
    for o in overrides:
        _apply_override(tree, o)
    try:
        return OffloadConfig.model_validate(tree)
    except ValidationError as err:
        raise _format_error(err, source + (" with --set overrides" if overrides else "")) from None


def config_to_dict(cfg: OffloadConfig) -> dict:
    d = cfg.model_dump()
    b = cfg.cache.budget
    d["cache"]["budget"] = {"kind": b.kind, "value": b.value}
    return d
