"""The request scheduler: one loop thread owns the Engine (model + expert cache); callers on any thread
submit requests and receive their tokens through a sink.

This module is the callers' side: construction (``serve.max_model_len`` within the model's and the static KV
cache's positions), validation, the bounded waiting queue (``serve.max_queue``), cancellation and timings. The
loop's continuous batching, and why it is ours rather than transformers': ``serve/batch_loop.py``; a request and
its Outputs: ``serve/request.py``.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from typing import Callable

from moe_offload import log
from moe_offload.config import ConfigError
from moe_offload.prompts import max_positions
from moe_offload.serve.batch_loop import BatchLoop
from moe_offload.serve.config import ServeConfig
from moe_offload.serve.executor import LocalExecutor
from moe_offload.serve.request import Output, Overloaded, Request, SchedulerClosed
from moe_offload.serve.sampling import RequestError, SamplingParams

__all__ = ["Output", "Overloaded", "Request", "Scheduler", "SchedulerClosed"]


class Scheduler(BatchLoop):
    """Owns ``engine`` on one loop thread. ``submit`` is safe from any thread; the sink is called on the
    loop thread and must not block (hand the Output to your own queue / event loop). ``executor`` runs
    the forwards and cache edits (a ``BroadcastExecutor`` on rank 0 under TP)."""

    def __init__(self, engine, cfg: ServeConfig | None = None, executor: LocalExecutor | None = None):
        self.engine, self.cfg = engine, cfg or ServeConfig()
        self.executor = executor or LocalExecutor(engine, self.cfg)
        model = engine.model
        self.vocab = int(engine.reader.geometry.vocab)
        self.max_model_len = self._max_model_len(int(max_positions(model.config) or 1 << 30))
        tok = engine.tokenizer
        eos = getattr(tok, "eos_id", None) if tok is not None else None
        if eos is None and tok is not None:
            eos = getattr(tok, "eos_token_id", None)
        self.eos_id: int | None = eos if isinstance(eos, int) else None
        self._lock = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._prefilling: deque[Request] = deque()
        self._running: list[Request] = []
        self._ids = itertools.count()
        self._stop = False
        self._error: str | None = None
        self._init_loop(engine)
        self._thread = threading.Thread(target=self._loop, name="moe-offload-scheduler", daemon=True)

    def _max_model_len(self, model_max: int) -> int:
        """``serve.max_model_len`` (default: the model's), within the static KV cache's positions per row."""
        if self.cfg.max_model_len is not None and self.cfg.max_model_len > model_max:
            raise ConfigError(f"serve.max_model_len={self.cfg.max_model_len} is more than the model's {model_max} "
                              "positions (max_position_embeddings in the checkpoint's config.json, times an "
                              "extending rope_scaling factor): tokens past them "
                              "would be computed at positions the model never saw; lower serve.max_model_len or "
                              "leave it unset (null: the model's)")
        limit = self.executor.batch.max_len
        if limit is None:
            return self.cfg.max_model_len or model_max
        if self.cfg.max_model_len is not None and self.cfg.max_model_len > limit:
            raise ConfigError(f"serve.max_model_len={self.cfg.max_model_len} is more than "
                              f"decode.max_cache_len={limit}, the positions per row of the static serving KV cache; "
                              "raise decode.max_cache_len (device memory: rows x positions x KV bytes per position) "
                              "or lower serve.max_model_len")
        if (self.cfg.max_model_len or model_max) > limit:
            log.info_rank0("serve_max_model_len_capped", max_model_len=limit, model_max=model_max,
                           setting="decode.max_cache_len")
        return min(self.cfg.max_model_len or model_max, limit)

    @property
    def decode_steps(self) -> dict[str, int]:
        """Decode steps so far by path: ``graph`` (CUDA graph replays) and ``eager``."""
        return dict(self.executor.batch.steps)

    # ------------------------------------------------------------------ callers (any thread)
    def start(self) -> "Scheduler":
        self.cache_stats = self.engine.cache.stats()
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loop; requests still in flight finish with an error."""
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError when the request cannot be served as given."""
        if not prompt_ids:
            raise RequestError("the prompt is empty; send at least one token", "prompt")
        bad = [t for t in prompt_ids if not (isinstance(t, int) and 0 <= t < self.vocab)]
        if bad:
            raise RequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab})", "prompt")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise RequestError(f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) is "
                               f"{total} tokens, more than this model's maximum of {self.max_model_len}; "
                               "shorten the prompt or lower max_tokens", "max_tokens")

    def submit(self, prompt_ids: list[int], params: SamplingParams, sink: Callable[[Output], None],
               request_id: str | None = None) -> Request:
        """Queue a request -> its handle (``cancel()``). Raises RequestError, Overloaded, SchedulerClosed."""
        prompt_ids = list(prompt_ids)
        self.validate(prompt_ids, params)
        stop = set(params.stop_token_ids) | set(self.engine.cfg.decode.stop_token_ids)
        if self.eos_id is not None and not params.ignore_eos:
            stop.add(self.eos_id)
        req = Request(request_id or f"req-{next(self._ids)}", prompt_ids, params, sink, frozenset(stop),
                      t_submit=time.perf_counter())
        with self._lock:
            if self._stop or self._error is not None:
                raise SchedulerClosed(self._error or "the scheduler is stopped")
            # waiting requests beyond the free batch slots are the queue that serve.max_queue bounds
            free = max(0, self.cfg.max_batch - len(self._running) - len(self._prefilling))
            if len(self._waiting) >= self.cfg.max_queue + free:
                raise Overloaded(f"{len(self._waiting)} requests are waiting (serve.max_queue={self.cfg.max_queue}, "
                                 f"serve.max_batch={self.cfg.max_batch}); retry later")
            self._waiting.append(req)
            self._lock.notify_all()
        return req

    def cancel(self, req: Request) -> None:
        with self._lock:
            req.cancel()
            self._lock.notify_all()

    def generate(self, prompt_ids: list[int], params: SamplingParams, timeout: float | None = None) -> Request:
        """Blocking convenience: submit, wait for the end -> the finished request (``output_ids``)."""
        done = threading.Event()
        req = self.submit(prompt_ids, params, lambda o: done.set() if o.finished else None)
        if not done.wait(timeout):
            self.cancel(req)
            raise TimeoutError(f"request {req.id} did not finish in {timeout} s")
        return req

    def timings(self) -> list[dict]:
        """Per finished request (oldest first, at most the last 4096): prompt and output tokens, queue wait
        (submit -> first prefill chunk), prefill (-> first token sampled), prefill host time (the loop's time in
        the request's prefill forwards, returned once enqueued), TTFT (submit -> first token) and total seconds
        on the scheduler's clock; the HTTP layer's time is not in them."""
        with self._lock:
            return list(self.finished)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running) + len(self._prefilling)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._error is None and not self._stop
