"""Real-shaped synthetic HF checkpoints that transformers loads, in bf16, ModelOpt NVFP4 or
compressed-tensors NVFP4, with a byte-level tokenizer.

Non-expert weights come from transformers' own initialisation of the family (a skeleton of at most
``_PERIOD`` layers; deeper layers are re-drawn from each tensor's mean/std). Expert weights: tiny
presets draw bf16 normals and quantize them as the tools do; real-size presets write valid NVFP4
codes and scales directly (memory speed, no 30B-float quantization).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from moe_offload.checkpoint.families import FAMILIES, geometry_from_config
from moe_offload.formats import get_format
from moe_offload.formats.nvfp4 import _Nvfp4Base, quantize, random_nvfp4
from moe_offload.tokenizer import ByteTokenizer

_PERIOD = 4  # qwen3_next alternates 3 linear-attention layers and 1 full-attention layer
_SHARD_BYTES = 2 * 2**30
EXPERT_STD = 0.02


@dataclass(frozen=True)
class Preset:
    model_type: str
    config: dict
    tiny: bool


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
        bos_token_id=1, eos_token_id=2,
    ), False),
    "flash-next": Preset("qwen3_next", dict(
        hidden_size=2560, intermediate_size=5120, moe_intermediate_size=640, shared_expert_intermediate_size=640,
        num_hidden_layers=48, num_experts=512, num_experts_per_tok=10, norm_topk_prob=True, vocab_size=151936,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=262144,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    ), False),
}


class PresetError(ValueError):
    pass


def preset_config(preset: str, layers: int | None = None) -> dict:
    if preset not in PRESETS:
        raise PresetError(f"unknown preset {preset!r}; accepted: {', '.join(PRESETS)}")
    p = PRESETS[preset]
    cfg = dict(p.config)
    if layers is not None:
        if layers < 1:
            raise PresetError(f"--layers must be >= 1, got {layers}")
        cfg["num_hidden_layers"] = min(layers, cfg["num_hidden_layers"]) if not p.tiny else layers
        if p.model_type == "qwen3_next" and cfg["num_hidden_layers"] < _PERIOD:
            raise PresetError(
                f"{preset}: --layers {layers} leaves no full-attention layer (qwen3_next has one every "
                f"{_PERIOD} layers) and transformers' cache cannot serve such a model; use --layers >= {_PERIOD}"
            )
    cfg.setdefault("bos_token_id", ByteTokenizer.bos_id)
    cfg.setdefault("eos_token_id", ByteTokenizer.eos_id)
    return cfg


def _quant_config(fmt: str, family_unquantized: tuple) -> tuple[dict | None, dict | None]:
    """(config.json quantization_config, hf_quant_config.json) for the format."""
    if fmt == "nvfp4-modelopt":
        qc = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
              "exclude_modules": ["lm_head", *[f"*{x}*" for x in family_unquantized]]}
        hf = {"producer": {"name": "modelopt", "version": "synthetic"},
              "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": qc["exclude_modules"]}}
        return qc, hf
    if fmt == "nvfp4-ct":
        scheme = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True,
                  "dynamic": False, "scale_dtype": "float8_e4m3fn"}
        qc = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "quantization_status": "compressed",
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": scheme, "format": "nvfp4-pack-quantized",
                                            "input_activations": {**scheme, "dynamic": "local"}}},
              "ignore": ["lm_head", *[f"re:.*{x}$" for x in family_unquantized]]}
        return qc, None
    return None, None


class _ShardWriter:
    def __init__(self, out: Path, single: bool):
        self.out, self.single = out, single
        self.buf: dict[str, torch.Tensor] = {}
        self.buf_bytes = 0
        self.shards: list[dict[str, torch.Tensor]] = []
        self.weight_map: dict[str, str] = {}
        self.n = 0
        self.total = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        t = t.contiguous()
        self.buf[name] = t
        nb = t.numel() * t.element_size()
        self.buf_bytes += nb
        self.total += nb
        if not self.single and self.buf_bytes >= _SHARD_BYTES:
            self.flush()

    def flush(self) -> None:
        if not self.buf:
            return
        self.n += 1
        fname = f"model-{self.n:05d}.safetensors"
        save_file(self.buf, str(self.out / fname), metadata={"format": "pt"})
        for k in self.buf:
            self.weight_map[k] = fname
        self.buf, self.buf_bytes = {}, 0

    def close(self) -> None:
        if self.single:
            save_file(self.buf, str(self.out / "model.safetensors"), metadata={"format": "pt"})
            return
        self.flush()
        # rename into the HF "-of-" convention and write the index
        final: dict[str, str] = {}
        for i in range(1, self.n + 1):
            old = self.out / f"model-{i:05d}.safetensors"
            new = f"model-{i:05d}-of-{self.n:05d}.safetensors"
            old.rename(self.out / new)
            final[f"model-{i:05d}.safetensors"] = new
        index = {"metadata": {"total_size": self.total}, "weight_map": {k: final[v] for k, v in self.weight_map.items()}}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def make_checkpoint(preset: str, fmt: str, out: str | Path, layers: int | None = None, seed: int = 0,
                    progress: bool = True) -> dict:
    """Write a synthetic checkpoint for ``preset`` in format ``fmt`` to ``out``; returns a summary."""
    from moe_offload.integrations.hf import build_skeleton, disk_name, hf_config

    t0 = time.perf_counter()
    fmt_obj = get_format(fmt)
    cfg = preset_config(preset, layers)
    p = PRESETS[preset]
    family = FAMILIES[p.model_type]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)

    n_layers = cfg["num_hidden_layers"]
    skel_layers = n_layers if p.tiny else min(n_layers, _PERIOD)
    config = hf_config({"model_type": p.model_type, **cfg}, num_layers=skel_layers)
    skeleton = build_skeleton(family, config, torch.bfloat16, empty=False)
    skel_state = {k: v.detach() for k, v in skeleton.state_dict().items()}
    linear_weights = {f"{n}.weight" for n, m in skeleton.named_modules() if isinstance(m, torch.nn.Linear)}
    qc, hf_quant = _quant_config(fmt, family.unquantized)

    # config.json: the full config (all layers), as transformers writes it
    full = hf_config({"model_type": p.model_type, **cfg})
    full_dict = full.to_dict()
    full_dict["architectures"] = [type(skeleton).__name__]
    if qc:
        full_dict["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(full_dict, indent=2, default=str))
    if hf_quant:
        (out / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=2))
    ByteTokenizer().save(out)
    geo = geometry_from_config(full_dict)

    writer = _ShardWriter(out, single=p.tiny)
    quantized = isinstance(fmt_obj, _Nvfp4Base)

    def emit_non_expert(mem_name: str, t: torch.Tensor) -> None:
        name = disk_name(family, mem_name)
        if quantized and mem_name in linear_weights and t.shape[-1] % 16 == 0 and not any(x in name for x in family.unquantized):
            if p.tiny:
                packed, scale, g = quantize(t.float())
            else:  # real size: valid codes and scales at the tensor's std, written directly
                packed, scale, g = random_nvfp4(*t.shape, generator=gen, target_std=float(t.float().std()) or EXPERT_STD)
            for k, v in fmt_obj.to_disk(name[: -len(".weight")], packed, scale, g).items():
                writer.add(k, v)
        else:
            writer.add(name, t)

    layer_re = "model.layers."
    for name, t in skel_state.items():
        if not name.startswith(layer_re):
            emit_non_expert(name, t)
    by_layer: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for name, t in skel_state.items():
        if name.startswith(layer_re):
            li = int(name.split(".")[2])
            by_layer.setdefault(li, []).append((".".join(name.split(".")[3:]), t))

    H, I, E = geo.hidden, geo.inter, geo.num_experts
    bar = tqdm(range(n_layers), desc=f"make-checkpoint {preset} {fmt}", unit="layer", disable=not progress)
    for layer in bar:
        src = by_layer[layer % skel_layers]
        for rel, t in src:
            if layer < skel_layers:
                v = t
            elif t.numel() < 2 or float(t.float().std()) == 0.0:
                v = t.clone()  # a constant tensor (norms): own storage, safetensors refuses shared memory
            else:
                tf = t.float()
                v = (torch.randn(t.shape, generator=gen) * tf.std() + tf.mean()).to(t.dtype)
            emit_non_expert(f"model.layers.{layer}.{rel}", v)
        if layer not in geo.moe_layers:
            continue
        for e in range(E):
            for which, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
                prefix = family.expert_name(layer, e, which)
                if not quantized:
                    writer.add(prefix + ".weight", (torch.randn(shape, generator=gen) * EXPERT_STD).to(torch.bfloat16))
                elif p.tiny:
                    w = torch.randn(shape, generator=gen) * EXPERT_STD
                    for k, v in fmt_obj.to_disk(prefix, *quantize(w)).items():
                        writer.add(k, v)
                else:
                    for k, v in fmt_obj.to_disk(prefix, *random_nvfp4(*shape, generator=gen, target_std=EXPERT_STD)).items():
                        writer.add(k, v)
    writer.close()
    return {"path": str(out), "preset": preset, "format": fmt, "layers": n_layers, "bytes": writer.total,
            "seconds": round(time.perf_counter() - t0, 2)}
