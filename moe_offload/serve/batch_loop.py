"""The scheduler's loop thread (``serve/scheduler.py``): continuous batching over the Engine it owns.

Continuous batching: requests join and leave the decode batch at step boundaries. Each loop iteration
runs at most one prefill forward (``prefill.chunk_tokens`` tokens of the oldest admitted prompt, batch
1, so running streams keep flowing while a long prompt is prefilled) and then ONE model forward that
decodes every running sequence. A finished or cancelled request's rows leave the batch KV cache at
the next step boundary.

With ``serve.prefill_batch_tokens`` > 0 that prefill forward takes the oldest admitted prompt and the
later waiting ones that fit beside it whole (``serve/prefill_batch.py``).

Decision (transformers' continuous batching vs our own): transformers 5.24 ships
``generation.continuous_batching`` (``ContinuousBatchingManager``, paged KV cache). It was not adopted:
it needs a paged attention implementation chosen when the model is built, runs its own thread and
its own sampling / stop logic (no per-request seeded generator, no hook for our cache's stats or
cancellation semantics), flattens prefill and decode tokens of all requests into one ``[1, T]``
forward (so every step carrying a prefill chunk would send the decode tokens down the experts'
prefill path), and its API differs between 5.17 (the GPU image) and 5.24. Ours keeps one
``DynamicCache`` per prefilling sequence and one left-padded cache for the decode batch
(``serve/kv.py``), decoding with ``attention_mask`` + ``position_ids``; prefill is the exact call
sequence of ``Engine.generate``. On the CPU this gives the same greedy token ids as
``Engine.generate`` for every request of a mixed batch (tests/test_serve_scheduler.py).

On CUDA (``decode.cuda_graphs``) the decode batch is instead a per-row static KV cache whose steps are
CUDA graph replays, one graph per (rows, positions) bucket (``serve/static_batch.py``); the scheduler's
ops are the same (``executor.py``), and ``serve.max_model_len`` is held to ``decode.max_cache_len``, the
positions of a row.

Legend: B sequences in the decode batch, S padded cache length, T prompt tokens, V vocab.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from moe_offload import log
from moe_offload.serve import prefill_batch
from moe_offload.serve.request import Output, Request
from moe_offload.serve.sampling import sample


#: how often the loop refreshes its cache-stats snapshot while busy (and always when it goes idle)
_STATS_PERIOD_S = 0.25


class BatchLoop:
    """The loop-thread half of ``Scheduler`` (see the module docstring): it alone runs the forwards and calls the
    sinks. It uses what ``Scheduler.__init__`` makes: ``engine``, ``cfg``, ``executor``, the lock (``_lock``, a
    Condition), the queues (``_waiting``, ``_prefilling``, ``_running``) and ``_stop`` / ``_error``; its own state
    is made by ``_init_loop``."""

    def _init_loop(self, engine) -> None:
        """The loop's own state (``Scheduler.__init__`` makes what it shares with callers: the lock and the queues)."""
        self._outbox: list[tuple[Request, Output]] = []  # a decode step's Outputs, sent once the next step is launched
        # only where a step is enqueued asynchronously (CUDA): on a CPU the forward runs in the call, and
        # deferring would hold every token back by one whole forward for nothing
        self._defer = engine.device.type == "cuda"
        self.steps = 0
        self.cache_stats: dict = {}
        self._stats_t = 0.0
        #: decode forwards by batch rows: rows -> (steps, seconds) (forward + sampling, host wall time; the
        #: sampled ids are read on the host, so each step's time includes its device work)
        self.decode_timing: dict[int, tuple[int, float]] = {}
        #: the last finished requests' timings (``timings()``), oldest dropped first
        self.finished: deque[dict] = deque(maxlen=4096)
        #: prompts per forward (serve.prefill_batch_tokens), 0 when off or declined for this model
        self._batch_tokens = prefill_batch.budget(engine, self.cfg.prefill_batch_tokens)
        self.prefill_batches = 0  # forwards that prefilled several requests together

    def _full(self) -> bool:
        return len(self._running) + len(self._prefilling) >= self.cfg.max_batch

    # ------------------------------------------------------------------ the loop (owns the engine)
    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._stop and not (self._waiting or self._prefilling or self._running):
                        self._lock.wait()
                    if self._stop:
                        break
                    self._drop_cancelled()
                    while self._waiting and not self._full():
                        self._prefilling.append(self._waiting.popleft())
                self._step()
        except Exception as exc:  # the loop cannot continue: fail everything, refuse new requests
            self._error = f"scheduler loop died: {type(exc).__name__}: {exc}"
            log.event("serve_loop_died", 40, error=type(exc).__name__, message=str(exc))
        with self._lock:
            self._flush()
            reason = self._error or "the server is shutting down"
            for req in [*self._waiting, *self._prefilling, *self._running]:
                self._finish(req, None, error=reason)
            self._waiting.clear()
            self._prefilling.clear()
            self._running = []
        try:
            self.executor.reset()
            self.executor.stop()
        except Exception as exc:  # e.g. a TP peer already gone; nothing is left to serve anyway
            log.event("serve_executor_stop_failed", 30, error=type(exc).__name__, message=str(exc))

    def _step(self) -> None:
        group = self._prefill_group() if self._prefilling else []
        if group:
            self._flush()  # the last decode step's tokens go out before a prefill forward
        if len(group) > 1:
            self._prefill_together(group)
        elif group:
            req = group[0]
            try:
                self._prefill_chunk(req)
            except Exception as exc:  # this request fails; the batch keeps going
                log.event("serve_request_failed", 40, request=req.id, stage="prefill", error=type(exc).__name__,
                          message=str(exc))
                if self._prefilling and self._prefilling[0] is req:  # a failed join: it already left the queue
                    self._prefilling.popleft()
                self._fail_prefill(req, exc)
        if self._running:
            self._decode_step()
        self.steps += 1
        now = time.perf_counter()
        idle = not (self._prefilling or self._running)
        if idle or now - self._stats_t >= _STATS_PERIOD_S:
            self.cache_stats, self._stats_t = self.engine.cache.stats(), now

    def _prefill_chunk(self, req: Request) -> None:
        chunk = self.engine.cfg.prefill.chunk_tokens
        s = req.prefilled
        if req.t_prefill is None:
            req.t_prefill = time.perf_counter()
        t0 = time.perf_counter()
        logits_1V = self.executor.prefill(req.id, req.prompt_ids[s:s + chunk], s == 0 and len(req.prompt_ids) <= chunk)
        req.prefill_host += time.perf_counter() - t0
        req.prefilled = min(len(req.prompt_ids), s + chunk)
        if req.prefilled < len(req.prompt_ids):
            return
        self._prefilling.popleft()
        self._start(req, self._first_tokens([req], logits_1V)[0])

    def _prefill_group(self) -> list[Request]:
        return prefill_batch.group(self._prefilling, self._batch_tokens, self.engine.cfg.prefill.chunk_tokens)

    def _prefill_together(self, group: list[Request]) -> None:
        now = time.perf_counter()
        for r in group:
            r.t_prefill = now
        try:
            logits = self.executor.prefill_batch([r.id for r in group], [r.prompt_ids for r in group])
            for r in group:
                r.prefill_host = time.perf_counter() - now
        except Exception as exc:  # these requests fail; the running batch keeps going
            log.event("serve_request_failed", 40, requests=len(group), stage="prefill_batch",
                      error=type(exc).__name__, message=str(exc))
            for r in group:
                self._prefilling.remove(r)
                self._fail_prefill(r, exc)
            return
        self.prefill_batches += 1
        toks = self._first_tokens(group, torch.cat(logits))  # one device->host read for the group
        for r, tok in zip(group, toks):
            r.prefilled = len(r.prompt_ids)
            self._prefilling.remove(r)
            try:
                self._start(r, tok)
            except Exception as exc:  # e.g. its rows cannot join the decode batch: this request fails
                log.event("serve_request_failed", 40, request=r.id, stage="join", error=type(exc).__name__,
                          message=str(exc))
                self._fail_prefill(r, exc)

    def _fail_prefill(self, req: Request, exc: BaseException) -> None:
        """End a request whose prefill (or join) raised ``exc``: its per-request state goes, it gets the error."""
        self.executor.drop(req.id)
        self._finish(req, None, error=f"prefill failed: {type(exc).__name__}: {exc}")

    def _first_tokens(self, reqs: list[Request], logits_BV: torch.Tensor) -> list[int]:
        """Fully prefilled requests' first tokens (each request's seeded generator made here)."""
        for r in reqs:
            r.gen = torch.Generator().manual_seed(r.params.seed)
        return sample(logits_BV, [r.params for r in reqs], [r.gen for r in reqs])

    def _start(self, req: Request, tok: int) -> None:
        """Stream a request's first token; it finishes or joins the decode batch."""
        req.t_first = time.perf_counter()
        if self._emit(req, tok):
            self.executor.drop(req.id)
            return
        self.executor.join(req.id, self._batch_len(), len(req.prompt_ids))
        self._running.append(req)

    def _batch_len(self) -> int:
        return max((r.cache_len for r in self._running), default=0)

    def _decode_step(self) -> None:
        """One decode forward of every running row. On CUDA the previous step's Outputs are sent after this
        step is enqueued (``_flush``): the forward is asynchronous there, so the sinks and the HTTP side's work
        on those tokens overlap the device step instead of delaying its launch; a row's stop is still decided
        before the next step (its Output just leaves one launch later). On a CPU they are sent at once."""
        rows = self._running
        t0 = time.perf_counter()
        try:
            logits_BV = self.executor.decode([r.output_ids[-1] for r in rows], [r.cache_len for r in rows])
        except Exception as exc:  # the caches' state is unknown now: fail their requests, keep serving
            self._flush()
            log.event("serve_request_failed", 40, requests=len(rows) + len(self._prefilling), stage="decode",
                      error=type(exc).__name__, message=str(exc))
            for r in [*rows, *self._prefilling]:
                self._finish(r, None, error=f"decode failed: {type(exc).__name__}: {exc}")
            self._running = []
            self._prefilling.clear()
            self.executor.reset()
            return
        t_sinks = time.perf_counter()
        self._flush()
        t_sinks = time.perf_counter() - t_sinks  # the previous step's sinks: not this step's time
        toks = sample(logits_BV, [r.params for r in rows], [r.gen for r in rows])
        n, secs = self.decode_timing.get(len(rows), (0, 0.0))
        self.decode_timing[len(rows)] = (n + 1, secs + time.perf_counter() - t0 - t_sinks)  # one assignment: a scrape
        # on the HTTP thread never sees a step without its seconds
        keep = [b for b, (r, t) in enumerate(zip(rows, toks)) if not self._emit(r, t, defer=self._defer)]
        if len(keep) < len(rows):
            self._shrink(keep)
        if not self._running:
            self._flush()  # no next step to overlap with

    def _shrink(self, keep: list[int]) -> None:
        """Keep the running rows ``keep``; cut the cache columns that only padded the rows that left."""
        self._running = [self._running[b] for b in keep]
        trim = max(0, self.executor.batch_len() - self._batch_len()) if self._running else 0
        self.executor.keep(keep, trim)

    def _drop_cancelled(self) -> None:
        for r in [r for r in self._waiting if r.cancelled]:
            self._waiting.remove(r)
            self._finish(r, "cancelled")
        for r in [r for r in self._prefilling if r.cancelled]:
            self._prefilling.remove(r)
            self.executor.drop(r.id)
            self._finish(r, "cancelled")
        if any(r.cancelled for r in self._running):
            gone = [r for r in self._running if r.cancelled]
            self._shrink([b for b, r in enumerate(self._running) if not r.cancelled])
            for r in gone:
                self._finish(r, "cancelled")

    def _emit(self, req: Request, tok: int, defer: bool = False) -> bool:
        """Append ``tok`` and stream it (``defer``: at the next ``_flush``); True when the request is finished."""
        req.output_ids.append(tok)
        reason = None
        if tok in req.stop_ids:
            reason = "stop"
        elif len(req.output_ids) >= req.params.max_tokens:
            reason = "length"
        if reason is not None:
            req.finish_reason, req.t_done = reason, time.perf_counter()
            self._record(req)
        out = Output([tok], finish_reason=reason)
        if defer:
            self._outbox.append((req, out))
        else:
            self._send(req, out)
        return reason is not None

    def _flush(self) -> None:
        """Send the Outputs a decode step deferred, in order."""
        if self._outbox:
            out, self._outbox = self._outbox, []
            for req, o in out:
                self._send(req, o)

    def _finish(self, req: Request, reason: str | None, error: str | None = None) -> None:
        self._flush()  # tokens already decoded go out before the request's last Output
        req.finish_reason, req.t_done = reason or "error", time.perf_counter()
        self._record(req)
        self._send(req, Output([], finish_reason=reason, error=error))

    def _record(self, req: Request) -> None:
        def span(a, b):
            return None if a is None or b is None else b - a

        row = {"id": req.id, "prompt_tokens": len(req.prompt_ids), "output_tokens": len(req.output_ids),
               "finish_reason": req.finish_reason, "queue_s": span(req.t_submit, req.t_prefill),
               "prefill_s": span(req.t_prefill, req.t_first),
               "prefill_host_s": None if req.t_first is None else req.prefill_host,
               "ttft_s": span(req.t_submit, req.t_first),
               "total_s": req.t_done - req.t_submit}
        with self._lock:
            self.finished.append(row)

    def _send(self, req: Request, out: Output) -> None:
        try:
            req.sink(out)
        except Exception as exc:  # a broken sink must not stop the loop: its request is cancelled
            log.event("serve_sink_failed", 30, request=req.id, error=type(exc).__name__, message=str(exc))
            req.cancelled = True
