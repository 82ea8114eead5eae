"""The HTTP clients of ``moe-offload bench serve`` (``serve/bench.py``): one streaming request, a level of N
closed-loop clients, and the child process that runs the levels off the server's process.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Job:
    prompt_ids: tuple[int, ...]
    max_tokens: int


async def _one(client, url: str, job: Job, timeout: float) -> dict:
    body = {"prompt": list(job.prompt_ids), "max_tokens": job.max_tokens, "stream": True, "temperature": 0,
            "ignore_eos": True}
    rec = {"job": job, "ids": [], "t_tokens": [], "error": None}
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                rec["error"] = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec["error"] = chunk["error"].get("message")
                    break
                ids = chunk["choices"][0].get("token_ids") or []
                now = time.perf_counter() - t0
                rec["ids"] += ids
                rec["t_tokens"] += [now] * len(ids)
    except Exception as exc:  # counted as an error of this request; the level goes on
        rec["error"] = f"{type(exc).__name__}: {exc}"
    return rec


async def _level(url: str, jobs: list[Job], clients: int, per_client: int, timeout: float) -> tuple[list[dict], float]:
    import httpx

    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        async def loop(c: int) -> list[dict]:
            # round k of every client takes consecutive jobs: concurrent streams differ while clients <= jobs
            return [await _one(client, url, jobs[(k * clients + c) % len(jobs)], timeout) for k in range(per_client)]

        t0 = time.perf_counter()
        recs = await asyncio.gather(*(loop(c) for c in range(clients)))
        return [r for rs in recs for r in rs], time.perf_counter() - t0


def level_in_child(url: str, jobs: list[Job], clients: int, per_client: int, timeout: float) -> tuple[list[dict], float]:
    """``_level`` run to completion in the calling process (the target of ``ClientProcess``)."""
    return asyncio.run(_level(url, jobs, clients, per_client, timeout))


class ClientProcess:
    """The benchmark's clients in one spawned child process, reused by every level.

    Decision: an in-process run used to drive its clients from the server's own process, so their Python
    work (request bodies, SSE parsing) competed for the GIL with the scheduler thread, whose prefill has
    little host slack at 48 layers (host 57 ms of a 77 ms TTFT on the H200 at 78928ef). There the one-client
    TTFT was 1.47 x ``Engine.measure_ttft`` while the scheduler without client traffic was 1.01 x
    (``benchmarks/serve_overhead.py``). Real clients run elsewhere, so the clients run in a child process
    (timestamps are that process's ``perf_counter``, differences only); ``--clients-in-process`` keeps the
    old way for comparison."""

    def __init__(self, in_process: bool = False):
        self.pool = None
        if not in_process:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            self.pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))

    @property
    def where(self) -> str:
        return "in process" if self.pool is None else "child process"

    def level(self, url: str, jobs: list[Job], clients: int, per_client: int, timeout: float):
        if self.pool is None:
            return level_in_child(url, jobs, clients, per_client, timeout)
        return self.pool.submit(level_in_child, url, jobs, clients, per_client, timeout).result()

    def close(self, wait: bool = True) -> None:
        """``wait=False`` (an error or Ctrl-C in this process): do not wait for a level in flight; it ends
        when the caller stops the server (its requests then fail fast)."""
        if self.pool is not None:
            self.pool.shutdown(wait=wait, cancel_futures=True)
            self.pool = None

    def __enter__(self) -> "ClientProcess":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(wait=exc_type is None)
