"""Validate a generate request before any weight is loaded: the model's facts come from config.json
(or the preset table) and the safetensors headers, which cost milliseconds.

Checked here: model.format against the checkpoint, TP divisibility of the expert intermediate size,
prompt text / ids (non-empty, integers, inside the vocab), max_new_tokens >= 1 and prompt + new tokens
within max_position_embeddings. Each failure is an ``InputError`` whose message names the flag or key,
the value and the fix.
"""

from __future__ import annotations

import io
import sys
from dataclasses import dataclass
from pathlib import Path

from moe_offload.config import OffloadConfig

#: what a preset is built as when model.format is auto (engine.ensure_checkpoint)
PRESET_DEFAULT_FORMAT = "nvfp4-modelopt"


class InputError(ValueError):
    """A request input is wrong (prompt, lengths, TP size); the message names the flag, value and fix."""


@dataclass(frozen=True)
class ModelFacts:
    """What validation needs to know about the model, read without loading weights."""

    source: str                  # "checkpoint DIR" or "preset NAME" (for messages)
    path: Path | None            # checkpoint dir, None for a preset not built yet
    format: str
    vocab: int
    max_positions: int | None
    inter: int
    eos_ids: tuple[int, ...]


def _eos_ids(config: dict, path: Path | None) -> tuple[int, ...]:
    """EOS ids from generation_config.json (what transformers' generate uses), else config.json."""
    raw, source = config.get("eos_token_id"), "config.json" if path is None else str(path / "config.json")
    if path is not None and (path / "generation_config.json").is_file():
        from moe_offload.checkpoint.reader import read_json_object

        gen = read_json_object(path / "generation_config.json")
        if "eos_token_id" in gen:
            raw, source = gen["eos_token_id"], str(path / "generation_config.json")
    if raw is None:
        return ()
    ids = raw if isinstance(raw, list) else [raw]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        # dropping a bad id would leave generation without its stop token, silently
        raise InputError(f"{source}: eos_token_id is {raw!r}; it must be a token id (a JSON integer >= 0) or a list "
                         "of them; fix the file")
    return tuple(ids)


#: rope scalings that extend a model past ``max_position_embeddings`` (to ``original_max_position_embeddings x
#: factor``), as Qwen3's documented YaRN setting does (32768 x 4)
_EXTENDING_ROPE = ("yarn", "dynamic", "linear", "longrope")


def max_positions(config) -> int | None:
    """The positions a model serves: ``max_position_embeddings``, or more under an extending rope scaling in
    ``rope_scaling`` / ``rope_parameters``. ``config``: config.json's dict or a transformers config."""
    get = config.get if isinstance(config, dict) else (lambda k: getattr(config, k, None))
    base = get("max_position_embeddings")
    rope = get("rope_scaling") or get("rope_parameters")
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) in _EXTENDING_ROPE:
        factor = rope.get("factor") or 1
        if isinstance(factor, (int, float)) and factor > 1:
            orig = rope.get("original_max_position_embeddings") or base
            if isinstance(orig, int):
                return max(base or 0, int(orig * factor))
    return base


def model_facts(cfg: OffloadConfig) -> ModelFacts:
    """The model's vocab, positions, expert intermediate size, format and EOS ids; checks model.format."""
    from moe_offload.checkpoint.families import geometry_from_config

    if cfg.model.checkpoint:
        from moe_offload.checkpoint.reader import CheckpointReader, detect_format

        path = Path(cfg.model.checkpoint).expanduser()
        if not path.is_dir():
            raise InputError(f"model.checkpoint (--checkpoint) {path} is not a directory; point it at an HF "
                             "checkpoint dir (config.json + *.safetensors)")
        reader = CheckpointReader(path)
        fmt = detect_format(reader)
        if cfg.model.format not in ("auto", fmt):
            raise InputError(f"model.format is {cfg.model.format!r} but {path} is {fmt!r} (from config.json / "
                             "hf_quant_config.json); set model.format to auto or to the checkpoint's format")
        config, geo, source = reader.config, reader.geometry, f"checkpoint {path}"
    else:
        from moe_offload.presets import preset_config

        config = preset_config(cfg.model.preset, cfg.model.layers)
        config = {"model_type": _preset_type(cfg.model.preset), **config}
        geo = geometry_from_config(config, f"preset {cfg.model.preset}")
        path, source = None, f"preset {cfg.model.preset}"
        fmt = PRESET_DEFAULT_FORMAT if cfg.model.format == "auto" else cfg.model.format
    max_pos = config.get("max_position_embeddings")
    if max_pos is not None and (isinstance(max_pos, bool) or not isinstance(max_pos, int) or max_pos < 1):
        raise InputError(f"{source}: max_position_embeddings in config.json is {max_pos!r}; it must be a JSON "
                         "integer >= 1; fix config.json")
    return ModelFacts(source, path, fmt, geo.vocab, max_positions(config) or None, geo.inter,
                      _eos_ids(config, path))


def _preset_type(name: str) -> str:
    from moe_offload.presets import get_preset

    return get_preset(name).model_type


def check_tp(facts: ModelFacts, tp: int, flag: str = "parallel.tp") -> None:
    """The expert intermediate size must split evenly over ``tp`` ranks, in whole format blocks."""
    from moe_offload.formats import get_format

    if tp <= 1:
        return
    multiple = get_format(facts.format).tp_multiple
    part, rem = divmod(facts.inter, tp)
    if rem or part % multiple:
        ok = [t for t in range(1, 17) if facts.inter % t == 0 and (facts.inter // t) % multiple == 0]
        raise InputError(
            f"{flag}={tp}: the {facts.source} has expert intermediate size {facts.inter}, which does not split into "
            f"{tp} parts that are multiples of {multiple} ({facts.format} block); use one of tp = "
            f"{', '.join(map(str, ok))}")


def parse_prompt_ids(text: str, flag: str = "--prompt-ids") -> list[int]:
    """``"1,2,3"`` -> [1, 2, 3]; empty, non-integer or negative entries are errors."""
    parts = [p.strip() for p in str(text).split(",")]
    if not any(parts):
        raise InputError(f"{flag} is empty; pass comma-separated token ids such as {flag} 1,2,3")
    ids = []
    for p in parts:
        if not p:
            raise InputError(f"{flag} {text!r} has an empty entry; pass comma-separated token ids such as 1,2,3")
        try:
            ids.append(int(p))
        except ValueError:
            raise InputError(f"{flag} {text!r}: {p!r} is not an integer token id; pass ids such as 1,2,3") from None
    return ids


def read_prompt_file(name: str) -> str:
    """The prompt text of ``--prompt-file`` (``-`` reads standard input)."""
    if name == "-":
        raw = getattr(sys.stdin, "buffer", None)  # a text stream without bytes underneath (embedders, tests)
        if raw is None:
            return sys.stdin.read()
        try:  # newlines translated as for a file (CRLF -> LF)
            return io.TextIOWrapper(raw, encoding="utf-8").read()
        except UnicodeDecodeError as exc:
            raise InputError(f"--prompt-file -: standard input is not UTF-8 text ({exc.reason} at byte {exc.start}); "
                             "pipe UTF-8 text") from None
    p = Path(name)
    if p.is_dir():
        raise InputError(f"--prompt-file {name} is a directory; pass a UTF-8 text file, or - for standard input")
    if not p.is_file():
        raise InputError(f"--prompt-file {name}: no such file; pass a UTF-8 text file, or - for standard input")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"--prompt-file {name}: not UTF-8 text ({exc}); re-save it as UTF-8") from None


def load_prompt_tokenizer(facts: ModelFacts):
    """The tokenizer generate will use, without loading weights (presets: the byte tokenizer)."""
    from moe_offload.tokenizer import ByteTokenizer, load_tokenizer

    return ByteTokenizer() if facts.path is None else load_tokenizer(facts.path)


def check_ids(ids: list[int], facts: ModelFacts, flag: str) -> None:
    if not ids:
        raise InputError(f"{flag} gives no tokens; pass a non-empty prompt")
    bad = [i for i in ids if not 0 <= i < facts.vocab]
    if bad:
        raise InputError(f"{flag}: token id(s) {bad[:5]} are outside the vocab of the {facts.source} "
                         f"(0..{facts.vocab - 1}); pass ids in that range")


def check_lengths(n_prompt: int, max_new: int, facts: ModelFacts, max_new_flag: str) -> None:
    if max_new < 1:
        raise InputError(f"{max_new_flag}={max_new}: generate at least 1 token; pass {max_new_flag} >= 1")
    limit = facts.max_positions
    if limit is None or n_prompt + max_new <= limit:
        return
    if n_prompt >= limit:
        raise InputError(f"the prompt has {n_prompt} tokens; the {facts.source} allows {limit} positions "
                         f"(max_position_embeddings) in all; shorten the prompt below {limit} tokens")
    raise InputError(f"prompt ({n_prompt} tokens) + {max_new_flag}={max_new} = {n_prompt + max_new} exceeds the "
                     f"{facts.source}'s max_position_embeddings={limit}; pass {max_new_flag} <= {limit - n_prompt} "
                     "or a shorter prompt")
