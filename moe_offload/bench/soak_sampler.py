"""What the soak benchmark samples while requests run (``soak.py``): every ``interval`` seconds on a
daemon thread, device memory allocated and reserved (CUDA), pinned host bytes (the store's registered
banks, the cache's registered routing record, torch's pinned host allocator), the process RSS
(``/proc/self/status``, no psutil), and the counters of the last finished request.

The thread makes no CUDA call that synchronizes or could disturb a graph capture (the allocator's
statistics are host-side bookkeeping). The cache counters (``stats()`` synchronizes the device) are read
by the request loop between requests and handed over with ``publish``, together with the device memory
allocated at that moment (``device_allocated_idle``: nothing of a request is alive then, so it is the
curve a leak shows on).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

import torch


def rss_bytes() -> int | None:
    """VmRSS of this process (``/proc/self/status``), None where there is no procfs."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def host_allocator_bytes() -> int | None:
    """Bytes of pinned blocks torch's caching host allocator owns (in use + cached); None without CUDA
    or where this torch has no host allocator statistics."""
    if not torch.cuda.is_available() or not hasattr(torch.cuda, "host_memory_stats"):
        return None
    try:
        return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))
    except RuntimeError:
        return None


class Sampler:
    """Samples ``engine``'s memory every ``interval`` seconds (``t_s`` since ``t0``, a ``perf_counter``
    time); ``publish`` hands it the request loop's latest counters (module docstring)."""

    def __init__(self, engine, interval: float, t0: float):
        self.engine, self.interval, self.t0 = engine, interval, t0
        dev = engine.device
        self._cuda = dev.type == "cuda"
        self._index = (dev.index or 0) if self._cuda else None
        self.samples: list[dict] = []
        self._latest: dict = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)

    def publish(self, latest: dict) -> None:
        self._latest = latest  # one reference assignment: the sampler sees the old dict or the new one

    def start(self) -> None:
        self.samples.append(self.sample())
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(self.sample())

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.samples.append(self.sample())

    def sample(self) -> dict:
        eng, latest = self.engine, self._latest
        host = host_allocator_bytes()
        registered = eng.store.pinned_bytes + eng.cache.pinned_bytes
        return {
            "t_s": time.perf_counter() - self.t0,
            "device_allocated": torch.cuda.memory_allocated(self._index) if self._cuda else None,
            "device_reserved": torch.cuda.memory_reserved(self._index) if self._cuda else None,
            "device_allocated_idle": latest.get("device_allocated_idle"),
            "pinned_bytes": registered + (host or 0) if torch.cuda.is_available() else None,
            "pinned_registered_bytes": registered,
            "pinned_host_allocator_bytes": host,
            "rss_bytes": rss_bytes(),
            "requests": latest.get("requests", 0),
            "hit_rate": latest.get("hit_rate"),
            "prefill_hit_rate": latest.get("prefill_hit_rate"),
            "fallbacks": latest.get("fallbacks", 0),
            "declined": latest.get("declined", 0),
        }


class WarningCounter(logging.Handler):
    """Counts WARNING and ERROR events of the ``moe_offload`` logger by event name (a fallback logs once
    per process, so the cache counters stay the verdict; this catches events nothing counts)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.events: Counter = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        self.events[(getattr(record, "event_fields", None) or {}).get("event", record.getMessage())] += 1
