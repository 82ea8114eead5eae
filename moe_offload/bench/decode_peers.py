"""Peers of ``bench decode``, measured in the same run on the same checkpoint and prompts: transformers
holding the whole model in bf16 on the GPU (experts dequantized as the oracle does, built by
``peers.py``'s helpers; transformers' ``grouped_mm`` experts), greedy:

- ``eager``: a ``DynamicCache``, every step an eager forward;
- ``compiled``: a ``StaticCache`` and the step under ``torch.compile(mode="reduce-overhead")`` (CUDA
  graphs); the prompt is prefilled by the uncompiled model. Each batch size is its own compile, so
  only ``--compiled-batches`` run (the others are reported as not measured, with the reason).

Per batch: one untimed run (allocator; the compile for ``compiled``, its seconds recorded), then
``--peer-reps`` timed runs of ``--steps`` steps, each step timed from the host (its ids are read back).
A batch whose KV cache does not fit next to the weights is "not measured" with the sizes. On a CPU
device both are skipped with a note. ``--peer-layers N`` runs them on the first N layers and scales
ms/step by ``layers / N`` (embedding and LM head too: a small overestimate).
"""

from __future__ import annotations

import gc
import inspect
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch

from moe_offload.bench.peers import _failed, _fits, truncated_view

# activations of a batch prefill (attention, the experts' grouped_mm buffers), on top of the KV cache
_BATCH_SLACK = 4 << 30


def _kv_bytes(model, positions: int, batch: int) -> int:
    c = model.config
    types = getattr(c, "layer_types", None)
    layers = sum(t == "full_attention" for t in types) if isinstance(types, list) else c.num_hidden_layers
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return layers * 2 * c.num_key_value_heads * head_dim * 2 * positions * batch  # bf16


class _Decoder:
    """Greedy prefill + ``steps`` decode steps of one transformers model; eager or compiled step."""

    def __init__(self, model, device: torch.device, compiled: bool, max_len: int):
        params = inspect.signature(type(model).forward).parameters
        self.kv_name = "cache" if "cache" in params else "past_key_values"
        self.positions = "cache_position" in params  # transformers < 5.2x: positions are passed in
        self.model, self.device, self.compiled, self.max_len = model, device, compiled, max_len
        self.step_fn = torch.compile(model, mode="reduce-overhead") if compiled else model

    def _kwargs(self, ids_BT: torch.Tensor, kv, start: int) -> dict:
        kw = dict(input_ids=ids_BT, use_cache=True, logits_to_keep=1, **{self.kv_name: kv})
        if self.positions:
            T = ids_BT.shape[1]
            pos = torch.arange(start, start + T, device=self.device)
            kw.update(cache_position=pos, position_ids=pos[None].expand(ids_BT.shape[0], T))
        return kw

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], steps: int) -> list[float]:
        """Seconds of each decode step (host-timed: each step's ids are read back)."""
        from transformers import DynamicCache, StaticCache

        cfg = self.model.config
        kv = StaticCache(config=cfg, max_cache_len=self.max_len) if self.compiled else DynamicCache(config=cfg)
        ids_BT = torch.tensor(prompts, dtype=torch.long, device=self.device)
        T = ids_BT.shape[1]
        tok_B1 = self.model(**self._kwargs(ids_BT, kv, 0)).logits[:, -1].argmax(-1, keepdim=True)
        tok_B1.tolist()  # synchronizes: the first tokens are on the host
        times, t0 = [], time.perf_counter()
        for i in range(steps):
            logits = self.step_fn(**self._kwargs(tok_B1, kv, T + i)).logits
            tok_B1 = logits[:, -1].argmax(-1, keepdim=True).clone()  # a graph's output is overwritten next replay
            tok_B1.tolist()  # synchronizes: the step's ids are on the host
            t1 = time.perf_counter()
            times.append(t1 - t0)
            t0 = t1
        return times


def _measure(dec: _Decoder, prompts, steps: int, reps: int, scale: float) -> dict:
    t0 = time.perf_counter()
    dec.run(prompts, steps)  # untimed: allocator, kernels, and for the compiled peer the compile + capture
    first_s = time.perf_counter() - t0
    per_step, tok_s = [], []
    for _ in range(reps):
        s = dec.run(prompts, steps)
        per_step += s
        tok_s.append(len(prompts) * steps / (sum(s) * scale))
    q = sorted(per_step)
    return {"status": "ok", "first_run_s": first_s, "tok_s": {"median": statistics.median(tok_s), "reps": tok_s},
            "ms_per_step": {"median": statistics.median(q) * 1e3 * scale,
                            "p90": q[min(len(q) - 1, math.ceil(0.9 * len(q)) - 1)] * 1e3 * scale}}


def _peer(model, name: str, batches, wanted, prompts, device, plan, scale: float) -> dict:
    compiled = name == "compiled"
    max_len = plan.prompt_len + plan.steps + 1
    out = {}
    dec = None
    for B in batches:
        if B not in wanted:
            out[str(B)] = {"status": "not measured", "reason": "not requested (--compiled-batches): every batch "
                           "size is its own torch.compile" if compiled else "not requested (--peer-batches)"}
            continue
        need = _kv_bytes(model, max_len, B) + _BATCH_SLACK
        free, _ = torch.cuda.mem_get_info(device)
        if need > free:
            out[str(B)] = {"status": "not measured", "reason": f"KV cache + activations need ~{need / 2**30:.1f} GiB, "
                           f"{free / 2**30:.1f} GiB free next to the weights"}
            continue
        try:
            dec = dec or _Decoder(model, device, compiled, max_len)
            out[str(B)] = _measure(dec, prompts[:B], plan.steps, plan.peer_reps, scale)
        except Exception as exc:  # recorded and logged: the engine's figures and the other batches are kept
            out[str(B)] = _failed(f"{name}@{B}", exc, {})
        finally:
            gc.collect()
            torch.cuda.empty_cache()
    return out


def run_peers(path: Path, plan, prompts: list[list[int]], device: torch.device, notes: list[str]) -> dict:
    """``{peer: {"status", "per_batch": {B: {"status": "ok", "tok_s", "ms_per_step"} | {"status", "reason"}}}}``."""
    if not plan.peers:
        return {}
    if device.type != "cuda":
        notes.append("peers skipped: the device is cpu (the peers are transformers fully on a GPU)")
        return {n: {"status": "skipped", "reason": "cpu device: the full-GPU peers need a GPU"} for n in plan.peers}
    from moe_offload.checkpoint.reader import CheckpointReader
    from moe_offload.integrations.reference import build_reference_model

    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    engine_layers = CheckpointReader(path).geometry.num_layers
    layers = min(plan.peer_layers or engine_layers, engine_layers)
    if layers != engine_layers:
        notes.append(f"peers ran on {layers} of {engine_layers} layers; their ms/step is scaled by "
                     f"{engine_layers}/{layers}")
    common = {"layers": layers, "engine_layers": engine_layers, "dtype": "bfloat16",
              "experts_implementation": "grouped_mm"}
    with tempfile.TemporaryDirectory(prefix="moe-offload-peer-") as tmp:
        src = path if layers == engine_layers else truncated_view(path, layers, Path(tmp) / "view")
        try:
            t0 = time.perf_counter()
            model = build_reference_model(str(src), torch.bfloat16, device="cpu", experts_implementation="grouped_mm")
            common["build_s"] = time.perf_counter() - t0
        except Exception as exc:  # a peer that cannot be built must not lose the engine's figures
            return {n: _failed(n, exc, common) for n in plan.peers}
        ok, need, free = _fits(model, device)
        if not ok:
            reason = (f"not measured: needs ~{need / 2**30:.1f} GiB on the GPU, {free / 2**30:.1f} GiB free; "
                      "use --peer-layers")
            return {n: {**common, "status": "skipped", "reason": reason} for n in plan.peers}
        result = {}
        try:
            model.to(device).eval()
            for name in plan.peers:
                wanted = plan.compiled_batches if name == "compiled" else plan.peer_batches
                per_batch = _peer(model, name, plan.batches, wanted, prompts, device, plan, engine_layers / layers)
                result[name] = {**common, "status": "ok", "per_batch": per_batch,
                                "cache": "StaticCache + torch.compile(mode='reduce-overhead')" if name == "compiled"
                                else "DynamicCache, eager"}
        except Exception as exc:  # e.g. the move to the GPU: recorded, the engine's figures are kept
            result.update({n: _failed(n, exc, common) for n in plan.peers if n not in result})
        finally:
            del model
            gc.collect()
            torch.cuda.empty_cache()
    return result
