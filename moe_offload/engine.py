"""Engine: load a checkpoint into a transformers model with offloaded experts, warm it up, and run
prefill / generate / TTFT measurement.

Legend: B batch (1 here), T prompt tokens, V vocab.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from moe_offload import log
from moe_offload.cache import OffloadMoeCache
from moe_offload.checkpoint.reader import CheckpointReader, detect_format
from moe_offload.config import ModelConfig, OffloadConfig
from moe_offload.compute import make_compute, prefill_compute
from moe_offload.experts import OffloadedExperts, offloaded_experts
from moe_offload.formats import get_format
from moe_offload.guards import finite_logits
from moe_offload.host_store import ExpertStore
from moe_offload.integrations.hf import attach_experts, build_skeleton, check_no_meta, hf_config, load_non_expert_weights

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device={name!r} but torch has no CUDA here; set device: cpu or auto")
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "moe-offload"


def ensure_checkpoint(model_cfg: ModelConfig, progress: bool = True) -> Path:
    """The checkpoint dir: ``model.checkpoint`` as given, or the preset built once into the cache dir."""
    if model_cfg.checkpoint:
        path = Path(model_cfg.checkpoint).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"model.checkpoint {path} is not a directory; point it at an HF checkpoint dir")
        return path
    from moe_offload.checkpoint.synthetic import ensure_preset

    fmt = "nvfp4-modelopt" if model_cfg.format == "auto" else model_cfg.format
    root = Path(model_cfg.cache_dir).expanduser() if model_cfg.cache_dir else default_cache_dir()
    layers = f"-l{model_cfg.layers}" if model_cfg.layers else ""
    path = root / f"{model_cfg.preset}-{fmt}{layers}-s{model_cfg.seed}"
    return ensure_preset(model_cfg.preset, fmt, path, model_cfg.layers, model_cfg.seed, progress)


@dataclass
class GenerateResult:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str | None
    ttft_s: float
    decode_tok_s: float | None
    stats: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """What ``moe-offload generate`` prints."""
        return {
            "prompt_tokens": len(self.prompt_ids), "token_ids": self.token_ids, "text": self.text,
            "ttft_s": round(self.ttft_s, 6),
            "decode_tok_s": None if self.decode_tok_s is None else round(self.decode_tok_s, 2),
            "cache": {k: v for k, v in self.stats.items() if k != "per_layer"},
        }


class Engine:
    """A transformers MoE model whose experts live in pinned host memory behind an OffloadMoeCache."""

    def __init__(self, cfg, model, cache, store, reader, tokenizer, device, dtype):
        self.cfg, self.model, self.cache, self.store = cfg, model, cache, store
        self.reader, self.tokenizer, self.device, self.dtype = reader, tokenizer, device, dtype
        params = inspect.signature(type(model).forward).parameters
        self._kv_name = "cache" if "cache" in params else "past_key_values"
        experts = offloaded_experts(model)
        self._first_experts = next((m for m in experts if m.layer_idx == store.layers[0]), None)
        self._computes = list({id(c): c for m in experts for c in (m.compute, m.prefill_compute)}.values())
        for c in self._computes:
            c.bind(cache.counters)

    @classmethod
    def from_config(cls, cfg: OffloadConfig, tp_rank: int = 0, tp_size: int = 1, reduce=None,
                    progress: bool = True) -> "Engine":
        device = resolve_device(cfg.device)
        if device.type == "cuda":
            torch.cuda.set_device(device.index or 0)
        dtype = resolve_dtype(cfg.dtype, device)
        path = ensure_checkpoint(cfg.model, progress and tp_rank == 0)
        reader = CheckpointReader(path)
        fmt_name = detect_format(reader)
        store = ExpertStore.from_checkpoint(reader, cfg.model.format, tp_rank, tp_size, progress=progress and tp_rank == 0)
        cache = OffloadMoeCache(store, cfg.cache, cfg.prefill, device)
        fmt = get_format(fmt_name)
        compute = make_compute(cfg, fmt, store, device, dtype)
        graphed = prefill_compute(cfg, compute, device, dtype)
        geo = reader.geometry
        model = build_skeleton(geo.family, hf_config(reader.config), dtype, empty=True)
        load_non_expert_weights(model, reader, get_format(fmt_name), dtype)
        attach_experts(model, lambda layer, _p: OffloadedExperts(layer, cache, compute, cfg.decode.max_tokens, reduce,
                                                                 graphed))
        model.to(device).eval()
        check_no_meta(model)
        tokenizer = None
        try:
            from moe_offload.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(path)
        except ValueError:
            log.info_rank0("no_tokenizer", path=str(path), detail="text prompts need --prompt-ids")
        engine = cls(cfg, model, cache, store, reader, tokenizer, device, dtype)
        log.info_rank0("engine_ready", model_type=geo.model_type, format=fmt_name, layers=len(store.layers),
                       experts=geo.num_experts, top_k=geo.top_k, device=str(device), dtype=str(dtype).replace("torch.", ""),
                       expert_bytes=store.total_bytes, pinned=store.pinned, compute=getattr(graphed or compute, "name", "?"))
        if cfg.prefill.warmup:
            engine.warmup(progress=progress and tp_rank == 0)
        else:
            cache.resolve_hit_path()
        return engine

    # ------------------------------------------------------------------ running
    def warmup(self, progress: bool = False) -> None:
        """A dummy prefill plus one decode step: resolves the hit path under load, compiles kernels."""
        gen = torch.Generator().manual_seed(1234)
        n = max(self.cfg.prefill.warmup_tokens, self.cfg.decode.max_tokens + 1)
        ids = torch.randint(3, self.reader.geometry.vocab, (1, n), generator=gen)
        with tqdm(total=2, desc="warmup (prefill, decode)", disable=not progress) as bar:
            logits, past = self.forward(ids.to(self.device), None, 1)
            bar.update(1)
            self.forward(logits[:, -1:].argmax(-1), past)
            bar.update(1)
        self.cache.synchronize()
        self.cache.reset()

    @torch.inference_mode()
    def forward(self, ids_BT: torch.Tensor, past, logits_to_keep: int = 0):
        """One model forward of ``ids_BT [B, T]`` on the KV cache ``past`` -> (logits, past)."""
        # transformers 5.24 renamed past_key_values -> cache (5.17 has only the old name)
        # logits_to_keep=1: the LM head runs on the last position only (what sampling needs)
        first = self._first_experts
        kwargs = dict(input_ids=ids_BT, use_cache=True, logits_to_keep=logits_to_keep, **{self._kv_name: past})
        if first is not None and first.cache is self.cache and not first.uses_decode_path(ids_BT.numel()):
            with self.cache.prefill_pass():  # layer 0's copy overlaps the embedding and attention
                out = self.model(**kwargs)
        else:
            out = self.model(**kwargs)
        return out.logits, getattr(out, self._kv_name)

    def replace_cache(self, cache) -> None:
        """Serve from ``cache`` (a new OffloadMoeCache over the same store) from now on; the old one is
        closed (its streams synchronized, its device memory dropped)."""
        old = self.cache
        for m in offloaded_experts(self.model, old):
            m.cache = cache
        for c in self._computes:
            c.bind(cache.counters)
        self.cache = cache
        old.close()

    def close(self) -> None:
        """Synchronize and free the device cache, then unpin the host store (idempotent)."""
        self.cache.close()
        self.store.close()

    @torch.inference_mode()
    def prefill(self, input_ids, past=None, last_only: bool = False) -> tuple[torch.Tensor, object]:
        """Logits ``[B, T, V]`` of the prompt (chunked by ``prefill.chunk_tokens``) and the KV cache.

        ``last_only``: logits ``[B, 1, V]`` of the last position only, as serving does (the LM head
        over every prompt position costs a [T, H] x [H, V] GEMM and T x V logits that nobody reads)."""
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        if ids.dim() == 1:
            ids = ids[None]
        ids = ids.to(self.device)
        chunk = self.cfg.prefill.chunk_tokens
        parts = []
        for s in range(0, ids.shape[1], chunk):
            logits, past = self.forward(ids[:, s:s + chunk], past, 1 if last_only else 0)
            parts.append(logits)
        if last_only:
            return parts[-1], past
        return (parts[0] if len(parts) == 1 else torch.cat(parts, 1)), past

    def _sample(self, logits_BV: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
        d = self.cfg.decode
        if d.temperature == 0:
            return logits_BV.argmax(-1)
        scores = logits_BV.float() / d.temperature
        if d.top_k:
            kth = torch.topk(scores, min(d.top_k, scores.shape[-1])).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if d.top_p < 1.0:
            sorted_s, idx = torch.sort(scores, descending=True)
            cum = sorted_s.softmax(-1).cumsum(-1)
            drop = cum - sorted_s.softmax(-1) > d.top_p
            scores = scores.scatter(-1, idx, sorted_s.masked_fill(drop, float("-inf")))
        probs = scores.softmax(-1)
        return torch.multinomial(probs.cpu(), 1, generator=gen).squeeze(-1).to(logits_BV.device)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int | None = None, seed: int = 0,
                 on_token=None) -> GenerateResult:
        """Prefill + decode (greedy when decode.temperature is 0). Stops at decode.stop_token_ids / eos.
        ``on_token(id)`` is called with each token as it is sampled (streaming); non-finite logits raise
        ``guards.NonFiniteLogitsError`` naming the first layer that produced them."""
        max_new = max_new_tokens or self.cfg.decode.max_new_tokens
        stop = set(self.cfg.decode.stop_token_ids)
        gen = torch.Generator().manual_seed(seed)
        self._sync()
        t0 = time.perf_counter()
        logits, past = self.prefill(prompt_ids, last_only=True)
        tok = self._sample(finite_logits(self, logits[:, -1], prompt_ids, []), gen)
        out = [int(tok.item())]  # synchronizes: TTFT includes the first sampled token
        if on_token is not None:
            on_token(out[-1])
        ttft = time.perf_counter() - t0
        t1 = time.perf_counter()
        while len(out) < max_new and out[-1] not in stop:
            logits, past = self.forward(tok.view(1, 1), past)
            tok = self._sample(finite_logits(self, logits[:, -1], prompt_ids, out), gen)
            out.append(int(tok.item()))
            if on_token is not None:
                on_token(out[-1])
        dt = time.perf_counter() - t1
        n_dec = len(out) - 1
        text = self.tokenizer.decode(out) if self.tokenizer is not None else None
        return GenerateResult(list(prompt_ids), out, text, ttft, n_dec / dt if n_dec and dt > 0 else None, self.cache.stats())

    @torch.inference_mode()
    def measure_ttft(self, prompt_ids: list[int]) -> float:
        """Seconds from a synchronized start to the first sampled token on the host."""
        self._sync()
        t0 = time.perf_counter()
        logits, _ = self.prefill(prompt_ids, last_only=True)
        int(logits[0, -1].argmax().item())
        return time.perf_counter() - t0

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer; pass --prompt-ids")
        return list(self.tokenizer.encode(text))
