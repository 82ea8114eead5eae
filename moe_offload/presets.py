"""The one table of synthetic model presets: family, config.json values, and whether it is tiny.

Tiny presets (CPU tests, the embedded default) draw float experts and quantize them as the tools do;
real-size presets write valid NVFP4 codes and scales directly. ``preset_config`` is the config.json
dict of a preset truncated to ``layers`` (never deeper than the preset itself).
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_offload.tokenizer import ByteTokenizer

#: qwen3_next alternates 3 linear-attention layers and 1 full-attention layer
NEXT_PERIOD = 4
#: every preset ships the byte tokenizer; its special ids go into config.json
BOS_ID, EOS_ID = ByteTokenizer.bos_id, ByteTokenizer.eos_id


@dataclass(frozen=True)
class Preset:
    model_type: str
    config: dict
    tiny: bool

    @property
    def depth(self) -> int:
        return int(self.config["num_hidden_layers"])


_TINY_ATTN = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6)
_VOCAB_TINY = 320

PRESETS: dict[str, Preset] = {
    "tiny-qwen3-moe": Preset("qwen3_moe", dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4, num_experts=16,
        num_experts_per_tok=4, norm_topk_prob=True, vocab_size=_VOCAB_TINY, tie_word_embeddings=False, **_TINY_ATTN,
    ), True),
    "tiny-qwen3-next": Preset("qwen3_next", dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        num_hidden_layers=4, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, vocab_size=_VOCAB_TINY,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, tie_word_embeddings=False, **_TINY_ATTN,
    ), True),
    "tiny-mixtral": Preset("mixtral", dict(
        hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2,
        vocab_size=_VOCAB_TINY, tie_word_embeddings=False, **_TINY_ATTN,
    ), True),
    "qwen3-30b-a3b": Preset("qwen3_moe", dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID,
    ), False),
    "flash-next": Preset("qwen3_next", dict(
        hidden_size=2560, intermediate_size=5120, moe_intermediate_size=640, shared_expert_intermediate_size=640,
        num_hidden_layers=48, num_experts=512, num_experts_per_tok=10, norm_topk_prob=True, vocab_size=151936,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=262144,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
    ), False),
}

PRESET_NAMES: tuple[str, ...] = tuple(PRESETS)


class PresetError(ValueError):
    """An unknown preset or a depth it cannot have; the message names the flag and what is accepted."""


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise PresetError(f"unknown preset {name!r}; accepted: {', '.join(PRESETS)}")
    return PRESETS[name]


def preset_config(preset: str, layers: int | None = None) -> dict:
    """config.json values of ``preset`` with ``num_hidden_layers`` = ``layers`` (1..the preset's depth)."""
    p = get_preset(preset)
    cfg = dict(p.config)
    if layers is not None:
        if layers < 1 or layers > p.depth:
            raise PresetError(
                f"--layers {layers} (model.layers) is outside 1..{p.depth} for preset {preset}, which has "
                f"{p.depth} layers; pass a value in that range or omit it for the full depth"
            )
        cfg["num_hidden_layers"] = layers
        if p.model_type == "qwen3_next" and layers < NEXT_PERIOD:
            raise PresetError(
                f"{preset}: --layers {layers} leaves no full-attention layer (qwen3_next has one every "
                f"{NEXT_PERIOD} layers) and transformers' cache cannot serve such a model; use --layers >= {NEXT_PERIOD}"
            )
    cfg.setdefault("bos_token_id", BOS_ID)
    cfg.setdefault("eos_token_id", EOS_ID)
    return cfg


def preset_geometry(preset: str, layers: int | None = None):
    """``checkpoint.families.ModelGeometry`` of ``preset`` (``layers`` as in ``preset_config``), without building it."""
    from moe_offload.checkpoint.families import geometry_from_config

    return geometry_from_config({**preset_config(preset, layers), "model_type": get_preset(preset).model_type},
                                f"preset {preset}")
