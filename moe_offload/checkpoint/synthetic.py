"""Real-shaped synthetic HF checkpoints that transformers loads, in bf16, ModelOpt NVFP4 or
compressed-tensors NVFP4, with a byte-level tokenizer.

Non-expert weights come from transformers' own initialisation of the family (a skeleton of at most
``_PERIOD`` layers; deeper layers are re-drawn from each tensor's mean/std). Expert weights: tiny
presets draw bf16 normals and quantize them as the tools do; real-size presets write valid NVFP4
codes and scales directly (memory speed, no 30B-float quantization), each expert matrix from its own seed
on a few threads (``_DRAW_THREADS``; seeds drawn in order, so the bytes do not depend on the thread count).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from moe_offload import log
from moe_offload.checkpoint.families import FAMILIES, geometry_from_config
from moe_offload.checkpoint.skeleton import build_skeleton, disk_name, hf_config
from moe_offload.formats import get_format
from moe_offload.formats.nvfp4 import quantize, random_normal_seeded, random_nvfp4, random_nvfp4_seeded, random_seed
from moe_offload.presets import NEXT_PERIOD as _PERIOD
from moe_offload.presets import PRESETS, Preset, PresetError, preset_config
from moe_offload.tokenizer import ByteTokenizer

__all__ = ["ACTIVATIONS", "PRESETS", "Preset", "PresetError", "make_checkpoint", "ensure_preset", "preset_config"]

_SHARD_BYTES = 2 * 2**30
#: threads drawing a real-size layer's experts (NumPy releases the GIL); the seeds are drawn in order on the
#: calling thread, so the checkpoint does not depend on the thread count
_DRAW_THREADS = max(1, min(8, os.cpu_count() or 1))
EXPERT_STD = 0.02
ACTIVATIONS = ("w4a16", "w4a4")
#: written into a checkpoint dir as its last file: a dir without it was never finished
COMPLETE_MARKER = ".complete"


def _quant_config(fmt: str, family_unquantized: tuple, activations: str) -> tuple[dict | None, dict | None]:
    """(config.json quantization_config, hf_quant_config.json) for the format, as ModelOpt and llm-compressor
    write them: ModelOpt ``quant_algo`` "W4A16_NVFP4" (weight-only) or "NVFP4" (W4A4, with ``input_scale``);
    compressed-tensors ``nvfp4-pack-quantized`` with ``input_activations`` only for W4A4."""
    if fmt == "nvfp4-modelopt":
        algo = "NVFP4" if activations == "w4a4" else "W4A16_NVFP4"
        qc = {"quant_method": "modelopt", "quant_algo": algo, "group_size": 16,
              "exclude_modules": ["lm_head", *[f"*{x}*" for x in family_unquantized]]}
        hf = {"producer": {"name": "modelopt", "version": "synthetic"},
              "quantization": {"quant_algo": algo, "group_size": 16, "exclude_modules": qc["exclude_modules"]}}
        return qc, hf
    if fmt == "nvfp4-ct":
        scheme = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True,
                  "dynamic": False, "scale_dtype": "float8_e4m3fn"}
        group = {"targets": ["Linear"], "weights": scheme, "format": "nvfp4-pack-quantized"}
        if activations == "w4a4":
            group["input_activations"] = {**scheme, "dynamic": "local"}
        qc = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "quantization_status": "compressed",
              "config_groups": {"group_0": group}, "ignore": ["lm_head", *[f"re:.*{x}$" for x in family_unquantized]]}
        return qc, None
    return None, None


def _disk_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def _check_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} is an existing file; pass a directory path (new or empty)")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise FileExistsError(f"--out {out} is a non-empty directory; pass a new or empty directory, or --force "
                              "to replace it")


@contextmanager
def _file_lock(path: Path):
    """An exclusive lock on ``path`` (created) held for the block; waits for another holder."""
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info_rank0("preset_build_wait", lock=str(path), detail="another process is building this preset")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_preset(preset: str, fmt: str, path: str | Path, layers: int | None = None, seed: int = 0,
                  progress: bool = True) -> Path:
    """``path`` holding the preset's checkpoint, built once: under a file lock next to it, so a second
    process asking for the same preset waits for the first and then reuses its build."""
    path = Path(path)
    if (path / COMPLETE_MARKER).is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(path.parent / f".{path.name}.lock"):
        if (path / COMPLETE_MARKER).is_file():  # built by the process we waited for
            return path
        log.info_rank0("build_preset", preset=preset, format=fmt, path=str(path))
        summary = make_checkpoint(preset, fmt, path, layers=layers, seed=seed, progress=progress, force=True)
        log.info_rank0("preset_built", **summary)
    return path


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
                    progress: bool = True, force: bool = False, activations: str = "w4a16") -> dict:
    """Write a synthetic checkpoint for ``preset`` in format ``fmt`` to ``out``; returns a summary.

    Built in a temporary dir beside ``out`` and renamed into place, so ``out`` is either absent, the
    old content, or complete. A non-empty ``out`` is refused unless ``force`` (then replaced).
    ``activations``: "w4a4" writes the activation-scale entries of a W4A4 export (served weight-only)."""
    t0 = time.perf_counter()
    fmt_obj = get_format(fmt)
    cfg = preset_config(preset, layers)
    if activations not in ACTIVATIONS:
        raise ValueError(f"--activations {activations!r}: accepted: {', '.join(ACTIVATIONS)}")
    out = Path(out)
    _check_out(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        n_layers = _write(preset, fmt_obj, cfg, tmp, seed, progress, activations)
        (tmp / COMPLETE_MARKER).write_text("ok\n")
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"path": str(out), "preset": preset, "format": fmt, "activations": activations if fmt_obj.is_quantized else None,
            "layers": n_layers, "bytes": _disk_bytes(out), "seconds": round(time.perf_counter() - t0, 2)}


def _write(preset: str, fmt_obj, cfg: dict, out: Path, seed: int, progress: bool, activations: str) -> int:
    """Write every file of the checkpoint into ``out``; returns the number of layers."""
    fmt = fmt_obj.name
    p = PRESETS[preset]
    family = FAMILIES[p.model_type]
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)

    n_layers = cfg["num_hidden_layers"]
    skel_layers = n_layers if p.tiny else min(n_layers, _PERIOD)
    config = hf_config({"model_type": p.model_type, **cfg}, num_layers=skel_layers)
    skeleton = build_skeleton(family, config, torch.bfloat16, empty=False)
    skel_state = {k: v.detach() for k, v in skeleton.state_dict().items()}
    linear_weights = {f"{n}.weight" for n, m in skeleton.named_modules() if isinstance(m, torch.nn.Linear)}
    qc, hf_quant = _quant_config(fmt, family.unquantized, activations)
    w4a4 = activations == "w4a4"

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
    quantized = fmt_obj.is_quantized

    def add_quantized(prefix: str, packed, scale, g) -> None:
        for k, v in fmt_obj.to_disk(prefix, packed, scale, g, w4a4).items():
            writer.add(k, v)

    def emit_non_expert(mem_name: str, t: torch.Tensor) -> None:
        name = disk_name(family, mem_name)
        if quantized and mem_name in linear_weights and t.shape[-1] % 16 == 0 and not any(x in name for x in family.unquantized):
            if p.tiny:
                packed, scale, g = quantize(t.float())
            else:  # real size: valid codes and scales at the tensor's std, written directly
                packed, scale, g = random_nvfp4(*t.shape, generator=gen, target_std=float(t.float().std()) or EXPERT_STD)
            add_quantized(name[: -len(".weight")], packed, scale, g)
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

    def draw(shape, seed):  # one real-size expert matrix (thread-safe: its own NumPy generator)
        if quantized:
            return random_nvfp4_seeded(*shape, seed, EXPERT_STD)
        return random_normal_seeded(shape, seed, EXPERT_STD)

    bar = tqdm(range(n_layers), desc=f"make-checkpoint {preset} {fmt}", unit="layer", disable=not progress)
    with ThreadPoolExecutor(_DRAW_THREADS, thread_name_prefix="make-checkpoint") as pool:
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
            jobs = [(family.expert_name(layer, e, which), shape)
                    for e in range(E) for which, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I)))]
            if p.tiny:
                for prefix, shape in jobs:
                    w = torch.randn(shape, generator=gen) * EXPERT_STD
                    if quantized:
                        add_quantized(prefix, *quantize(w))
                    else:
                        writer.add(prefix + ".weight", w.to(torch.bfloat16))
                continue
            # real size: every expert matrix from its own seed, drawn on threads, written in order
            seeds = [random_seed(gen) for _ in jobs]
            for (prefix, _), w in zip(jobs, pool.map(draw, [shape for _, shape in jobs], seeds)):
                if quantized:
                    add_quantized(prefix, *w)
                else:
                    writer.add(prefix + ".weight", w)
    writer.close()
    return n_layers
