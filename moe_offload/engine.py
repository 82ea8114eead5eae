"""Engine: a transformers model whose experts are offloaded; it warms up and runs prefill / generate / TTFT
measurement.

Building one from a config (device, checkpoint, store, cache, model, tokenizer) is engine_load.py's; the generate
loop behind ``generate`` / ``generate_batch`` is generation.py's.

Legend: B batch (1 here), T prompt tokens, V vocab.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import time

import torch
from tqdm.auto import tqdm

from moe_offload import log
from moe_offload.config import OffloadConfig
from moe_offload.engine_load import (default_cache_dir, ensure_checkpoint, load_engine, make_cache, resolve_device,
                                     resolve_dtype)
from moe_offload.experts import offloaded_experts
from moe_offload.generation import GenerateResult, generate_batch
from moe_offload.lookahead import attach_routers

# the loading helpers (engine_load.py) and the generate loop's result (generation.py) stay importable from here
__all__ = ["Engine", "GenerateResult", "default_cache_dir", "ensure_checkpoint", "make_cache", "resolve_device",
           "resolve_dtype"]


class Engine:
    """A transformers MoE model whose experts live in pinned host memory behind an OffloadMoeCache."""

    def __init__(self, cfg, model, cache, store, reader, tokenizer, device, dtype):
        self.cfg, self.model, self.cache, self.store = cfg, model, cache, store
        self.reader, self.tokenizer, self.device, self.dtype = reader, tokenizer, device, dtype
        params = inspect.signature(type(model).forward).parameters
        self._kv_name = "cache" if "cache" in params else "past_key_values"
        experts = offloaded_experts(model)
        self._first_experts = next((m for m in experts if m.layer_idx == store.layers[0]), None)
        self._decoders: dict = {}
        self._owner_lock, self._owner = threading.Lock(), None
        self._computes = list({id(c): c for m in experts
                               for c in (m.compute, m.prefill_compute, m.decode_compute)}.values())
        for c in self._computes:
            c.bind(cache.counters)
        attach_routers(cache, model)  # decode.lookahead (a no-op when off)
        self.pdl = self._pdl_usable()

    def _pdl_usable(self) -> bool:
        """Whether ``compute.pdl_max_tokens`` can take effect here: never on a CPU (a CUDA launch attribute, like
        ``decode.cuda_graphs``: nothing to decline); on a CUDA device that cannot, one ``pdl_declined`` event."""
        from moe_offload.kernels.pdl import unsupported

        if self.cfg.compute.pdl_max_tokens == 0 or self.device.type != "cuda":
            return False
        why = unsupported(self.device)
        if why is not None:
            log.log_once("pdl_declined", "pdl_declined", logging.INFO, reason=why, fallback="plain launches",
                         setting="compute.pdl_max_tokens")
        return why is None

    def pdl_launches(self, tokens: int):
        """Context for a decode step of ``tokens`` sequences or its capture: its Triton kernels use PDL where
        ``tokens <= compute.pdl_max_tokens`` and the device can (``kernels/pdl.py``), plain launches otherwise
        (counted per forward as declined where the device cannot)."""
        from moe_offload.kernels.pdl import launches

        wanted = tokens <= self.cfg.compute.pdl_max_tokens and self.device.type == "cuda"
        if wanted and not self.pdl:
            self.cache.counters.declined["pdl:unsupported"] += 1
        return launches(wanted and self.pdl)

    @classmethod
    def from_config(cls, cfg: OffloadConfig, tp_rank: int = 0, tp_size: int = 1, reduce=None,
                    progress: bool = True) -> "Engine":
        """Load ``cfg``'s checkpoint (its preset built on first use) into an Engine and warm it up
        (engine_load.py)."""
        return load_engine(cls, cfg, tp_rank, tp_size, reduce, progress)

    # ------------------------------------------------------------------ running
    def warmup(self, progress: bool = False) -> None:
        """A dummy prefill plus one decode step: resolves the hit path under load, compiles kernels."""
        gen = torch.Generator().manual_seed(1234)
        n = max(self.cfg.prefill.warmup_tokens, self.cache.routed_max_tokens + 1)  # the staged path
        ids = torch.randint(3, self.reader.geometry.vocab, (1, n), generator=gen)
        with tqdm(total=2, desc="warmup (prefill, decode)", disable=not progress) as bar:
            logits, past = self.forward(ids.to(self.device), None, 1)
            bar.update(1)
            self.forward(logits[:, -1:].argmax(-1), past)
            bar.update(1)
        self.cache.synchronize()
        self.cache.reset()
        self.cache.forget_observations()  # random ids route unlike prompts: learn spreads from real traffic

    @property
    def kv_name(self) -> str:
        """The model forward's KV-cache argument (transformers 5.24 renamed past_key_values -> cache)."""
        return self._kv_name

    @contextlib.contextmanager
    def _exclusive(self):
        """One thread at a time: the cache holds per-pass state (staging, the decode record). A second
        thread gets a clear error instead of corrupting it; re-entry from the same thread is fine."""
        me = threading.get_ident()
        with self._owner_lock:
            if self._owner not in (None, me):
                raise RuntimeError("Engine is already running a forward on another thread; it is not thread-safe. "
                                   "Serve concurrent requests through moe_offload.serve (one loop owns the engine)")
            outer = self._owner is None
            self._owner = me
        try:
            yield
        finally:
            if outer:
                with self._owner_lock:
                    self._owner = None

    def run_model(self, kwargs: dict, num_tokens: int):
        """``model(**kwargs).logits``; a forward on the prefill path is one announced prefill pass (layer
        0's copy then overlaps the embedding and the first attention)."""
        first = self._first_experts
        ids = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        sequences = int(ids.shape[0]) if ids is not None and ids.dim() >= 2 else 1
        with self._exclusive():
            ok = False
            routed = self.cache.begin_forward(num_tokens, sequences)
            try:
                if first is not None and first.cache is self.cache and not routed:
                    # a staged decode step (one new token a sequence) may stage only its routed misses (decode.path
                    # fills); a prompt's routed fills are prefill_graph.py's
                    fills = num_tokens == sequences and self.cache.decode_fills_for(num_tokens)
                    context = self.cache.prefill_pass(routed_fills=True) if fills else self.cache.prefill_pass()
                elif num_tokens == sequences:  # a decode step (one new token a sequence): PDL as in its graph
                    context = self.pdl_launches(num_tokens)
                else:  # a prompt on the routed path: plain launches (PDL measured no gain there, bb13400)
                    context = contextlib.nullcontext()
                with context:
                    logits = self.model(**kwargs).logits
                ok = True
                return logits
            finally:
                self.cache.end_forward(ok)

    @torch.inference_mode()
    def forward(self, ids_BT: torch.Tensor, past, logits_to_keep: int = 0, **model_kwargs):
        """One model forward of ``ids_BT [B, T]`` on the KV cache ``past`` -> (logits, past).
        ``logits_to_keep=1``: the LM head runs on the last position only (what sampling needs);
        ``model_kwargs`` (``attention_mask``, ``position_ids``) go to the model as they are."""
        if past is None:
            from transformers import DynamicCache

            past = DynamicCache(config=self.model.config)
        kwargs = dict(input_ids=ids_BT, use_cache=True, logits_to_keep=logits_to_keep, **{self._kv_name: past},
                      **model_kwargs)
        return self.run_model(kwargs, ids_BT.numel()), past

    def decoder(self, batch: int):
        """The static-cache decoder for ``batch`` sequences (made once, reset per request), or None when
        ``decode.cuda_graphs`` is off or the device is not CUDA."""
        if not (self.cfg.decode.cuda_graphs and self.device.type == "cuda"):
            return None
        reason = self.graph_decline_reason(batch)
        if reason is not None:
            self.cache.counters.declined[f"decode_graph:{reason}"] += 1
            if reason == "batch_staged":
                log.log_once(f"decode_graph_declined:batch_staged:{batch}", "decode_graph_declined", logging.INFO,
                             reason=reason, fallback="eager_staged", rows=batch,
                             routed_max_tokens=self.cache.routed_max_tokens, setting="decode.path")
            return None
        if batch not in self._decoders:
            from moe_offload.decode_graph import StaticDecoder

            try:
                self._decoders[batch] = StaticDecoder(self, batch, self.cfg.decode.max_cache_len, graphs=True)
            except Exception as exc:  # e.g. a hybrid (linear-attention) cache transformers cannot make static
                log.log_once(f"decode_graph_declined:static_cache:{type(exc).__name__}", "decode_graph_declined",
                             logging.WARNING, reason="static_cache_unavailable", fallback="eager_dynamic_cache",
                             detail=f"{type(exc).__name__}: {exc}"[:500], setting="decode.cuda_graphs")
                self._decoders[batch] = None
        dec = self._decoders[batch]
        if dec is None:
            self.cache.counters.declined["decode_graph:static_cache_unavailable"] += 1
        return dec

    def graph_decline_reason(self, rows: int) -> str | None:
        """Why a decode step of ``rows`` rows cannot be graph-captured (None: it can): above ``decode.max_tokens``
        (``batch_above_decode_max_tokens``) or above the cache's routed threshold (``batch_staged``, only with
        ``decode.path: auto`` or ``fills``, or ``host`` where the link rates were measured), the experts take the
        staged path, which does host work per layer.
        ``Engine.decoder`` and the serving batch (``serve/static_batch.py``) both decide by it."""
        if rows > self.cfg.decode.max_tokens:
            return "batch_above_decode_max_tokens"
        if rows > self.cache.routed_max_tokens:
            return "batch_staged"
        return None

    def drop_decoders(self) -> None:
        """Free the batch decoders' static KV caches and graphs (made again on the next ``generate_batch``)."""
        self._decoders.clear()

    def replace_cache(self, cache) -> None:
        """Serve from ``cache`` (a new OffloadMoeCache over the same store) from now on; the old one is
        closed (its streams synchronized, its device memory dropped)."""
        old = self.cache
        self._decoders.clear()  # their graphs hold the old cache's addresses (pool, table, counters)
        for m in offloaded_experts(self.model, old):
            m.cache = cache
        for c in self._computes:
            c.bind(cache.counters)
        self.cache = cache
        attach_routers(cache, self.model)
        old.close()

    def close(self) -> None:
        """Synchronize and free the device cache, then unpin the host store (idempotent)."""
        self._decoders.clear()
        self.cache.close()
        self.store.close()

    @torch.inference_mode()
    def prefill(self, input_ids, past=None, last_only: bool = False) -> tuple[torch.Tensor, object]:
        """Logits ``[B, T, V]`` of the prompt (chunked by ``prefill.chunk_tokens``) and the KV cache.

        ``last_only``: logits ``[B, 1, V]`` of the last position only, as serving does (the LM head
        over every prompt position costs a [T, H] x [H, V] GEMM and T x V logits that nobody reads)."""
        ids = torch.as_tensor(input_ids)
        if ids.dim() == 1:
            ids = ids[None]
        if ids.dim() != 2 or 0 in ids.shape or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError(f"prefill: token ids as a non-empty [T] or [B, T] integer list or tensor, got "
                             f"{ids.dtype} of shape {tuple(ids.shape)}")
        ids = ids.to(self.device, torch.long)
        chunk = self.cfg.prefill.chunk_tokens
        parts = []
        for s in range(0, ids.shape[1], chunk):
            logits, past = self.forward(ids[:, s:s + chunk], past, 1 if last_only else 0)
            parts.append(logits)
        if last_only:
            return parts[-1], past
        return (parts[0] if len(parts) == 1 else torch.cat(parts, 1)), past

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int | None = None, seed: int = 0,
                 on_token=None) -> GenerateResult:
        """Prefill + decode (greedy when decode.temperature is 0). Stops at decode.stop_token_ids / eos.
        ``on_token(id)`` is called with each token as it is sampled (streaming); non-finite logits raise
        ``guards.NonFiniteLogitsError`` naming the first layer that produced them."""
        cb = None if on_token is None else (lambda b, t: on_token(t))
        return self.generate_batch([prompt_ids], max_new_tokens, seed, cb)[0]

    @torch.inference_mode()
    def generate_batch(self, prompts: list[list[int]], max_new_tokens: int | None = None, seed: int = 0,
                       on_token=None) -> list[GenerateResult]:
        """``generate`` for B prompts of equal length, decoded together (one forward per step for all B).
        On CUDA with ``decode.cuda_graphs`` each step is one CUDA graph replay over a static KV cache
        (``decode_graph.py``); otherwise eager steps over a DynamicCache. ``on_token(b, id)`` streams.
        A sequence that stopped keeps its batch row until all stop (its later tokens are dropped)."""
        with self._exclusive():
            return generate_batch(self, prompts, max_new_tokens, seed, on_token)

    def check_prompt(self, prompt_ids, max_new_tokens: int = 0, what: str = "prompt") -> None:
        """``prompt_ids`` a non-empty list of token ids (integers, not floats or bools) in the vocab, and with
        ``max_new_tokens`` within the model's positions (``max_position_embeddings``): a ``ValueError`` naming the
        ids or the numbers otherwise. The CLI checks the same before loading (``prompts.check_ids``); this is the
        embedder's check (a float id was truncated and an id past the vocab failed deep in the embedding before)."""
        if isinstance(prompt_ids, torch.Tensor):
            prompt_ids = prompt_ids.tolist()
        if not isinstance(prompt_ids, (list, tuple)) or not prompt_ids:
            raise ValueError(f"{what}: a non-empty list of token ids, got {type(prompt_ids).__name__} "
                             f"{str(prompt_ids)[:60]}")
        vocab = self.reader.geometry.vocab
        bad = [i for i in prompt_ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab]
        if bad:
            raise ValueError(f"{what}: token ids {bad[:5]} are not integers in the vocab (0..{vocab - 1})")
        from moe_offload.prompts import max_positions

        limit = max_positions(self.model.config)
        if limit and len(prompt_ids) + max_new_tokens > limit:
            raise ValueError(f"{what}: {len(prompt_ids)} tokens + {max_new_tokens} new ones exceed the model's {limit} "
                             f"positions (max_position_embeddings); at most {max(limit - len(prompt_ids), 0)} new "
                             "tokens fit")

    @torch.inference_mode()
    def measure_ttft(self, prompt_ids: list[int]) -> float:
        """Seconds from a synchronized start to the first sampled token on the host, on ``generate``'s path:
        the static decoder (its prefill graph where one applies, ``prefill_graph.py``) where generate takes it."""
        self.check_prompt(prompt_ids, 1)
        with self._exclusive():
            n = len(prompt_ids)
            dec = self.decoder(1) if n + 1 <= self.cfg.decode.max_cache_len else None
            if dec is not None:
                dec.reset()
            self._sync()
            t0 = time.perf_counter()
            if dec is not None:
                logits_BV = dec.prefill(torch.as_tensor([prompt_ids], dtype=torch.long).to(self.device))
            else:
                logits_BV = self.prefill(prompt_ids, last_only=True)[0][:, -1]
            int(logits_BV[0].argmax().item())
            return time.perf_counter() - t0

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer; pass --prompt-ids")
        return list(self.tokenizer.encode(text))
