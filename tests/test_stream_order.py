"""A stream-ordering checker: the real cache on CPU with its streams and events replaced by vector-clock
fakes; every read and write of pool and staging rows is recorded with its stream and clock, and every
pair of accesses to the same row from two streams (one a write) must be ordered by events.

The checker is alive: dropping one wait (the copy stream's wait for a buffer's previous hit copy)
makes it report hazards on the same traffic.
"""

import random

import numpy as np
import pytest
import torch

import moe_offload.hit_copy as hit_copy
import moe_offload.kernels.copy as copy_kernels
import moe_offload.kernels.decode_miss as decode_miss
import moe_offload.lookahead as lookahead_module
from moe_offload.cache import OffloadMoeCache
from moe_offload.config import CacheConfig, PrefillConfig
from moe_offload.host_store import ExpertStore


class FakeStream:
    def __init__(self, name):
        self.name, self.vc = name, {name: 0}

    def tick(self):
        self.vc[self.name] += 1
        return dict(self.vc)

    def merge(self, vc):
        for k, v in vc.items():
            self.vc[k] = max(self.vc.get(k, 0), v)

    def wait_event(self, ev):
        self.merge(ev.vc)

    def wait_stream(self, other):
        self.merge(other.vc)


class FakeEvent:
    def __init__(self, streams=None):
        self.vc, self.streams = {}, streams

    def synchronize(self):
        """The host waited for the event: whatever it enqueues next, on any stream, comes after."""
        for s in (self.streams.compute, self.streams.copy, self.streams.hit, self.streams.ahead):
            s.merge(self.vc)


class FakeStreams:
    """The ``streams.Streams`` API over vector clocks (``is_cuda`` True: the cache takes its CUDA paths)."""

    def __init__(self, device, skip=lambda event: False):
        self.device, self.is_cuda, self.skip = device, True, skip
        self.compute, self.copy, self.hit = FakeStream("compute"), FakeStream("copy"), FakeStream("hit")
        self.ahead = FakeStream("lookahead")
        self._current = self.compute

    def lookahead(self):
        return self.ahead

    def event(self):
        return FakeEvent(self)

    def current(self):
        return self._current

    def on(self, stream):
        streams = self

        class _On:
            def __enter__(self):
                self.prev, streams._current = streams._current, stream

            def __exit__(self, *exc):
                streams._current = self.prev
                return False

        return _On()

    def wait(self, stream, *events):
        for ev in events:
            if not self.skip(ev):
                stream.wait_event(ev)

    def record(self, event, stream):
        event.vc = dict(stream.vc)

    def join_current(self):
        self.copy.wait_stream(self.compute)
        self.hit.wait_stream(self.compute)

    def current_joins_copies(self):
        self.compute.wait_stream(self.copy)
        self.compute.wait_stream(self.hit)

    def synchronize(self):
        every = (self.compute, self.copy, self.hit, self.ahead)
        for s in every:
            for t in every:
                s.merge(t.vc)


class Recorder:
    def __init__(self, cache):
        self.cache, self.log = cache, []

    def resource(self, t):
        if t.data_ptr() == self.cache.pool.rows_NR.data_ptr():
            return "pool"
        for b, rows in enumerate(self.cache.staging.rows):
            if t.data_ptr() == rows.data_ptr():
                return f"staging{b}"
        return None  # host memory: never written by the device

    def access(self, t, rows, write):
        name = self.resource(t)
        if name is not None:
            self.access_named(name, rows, write)

    def access_named(self, name, rows, write):
        s = self.cache.streams.current()
        self.log.append((name, frozenset(int(r) for r in rows), write, s.name, s.tick()))

    def hazards(self):
        found = []
        for i, (ra, rows_a, wa, sa, vca) in enumerate(self.log):
            for rb, rows_b, wb, sb, vcb in self.log[i + 1:]:
                if ra != rb or sa == sb or not (wa or wb) or not rows_a & rows_b:
                    continue
                if vcb.get(sa, 0) < vca[sa] and vca.get(sb, 0) < vcb[sb]:
                    found.append((ra, sa, sb, sorted(rows_a & rows_b)[:4]))
        return found


def _instrument(monkeypatch, cache):
    rec = Recorder(cache)
    real_h2d, real_gather, real_serve = hit_copy.H2DRows.copy, copy_kernels.gather_rows, decode_miss.serve_misses_reference
    real_full, real_stage, real_done = type(cache.staging)._copy_full, cache.stage, cache.done

    def h2d(self, copies, coalesce):
        for c in copies:
            rec.access(c.dst, c.dst_rows, True)
        return real_h2d(self, copies, coalesce)

    def gather(dst, dst_rows, src, src_rows):
        rec.access(src, src_rows.tolist(), False)
        rec.access(dst, dst_rows.tolist(), True)
        return real_gather(dst, dst_rows, src, src_rows)

    real_resident = copy_kernels.gather_resident

    def resident(dst, src, slot_N):  # the hit copy driven by the device slot table (no host indices)
        rows = [e for e, slot in enumerate(slot_N.tolist()) if slot >= 0]
        rec.access(src, [slot_N[e].item() for e in rows], False)
        rec.access(dst, rows, True)
        return real_resident(dst, src, slot_N)

    def full(self, layer, b):
        rec.access(self.rows[b], range(self.rows[b].shape[0]), True)
        return real_full(self, layer, b)

    def stage(layer):
        views = real_stage(layer)
        b = cache.staging.buffer_for(layer)
        slots = cache.staging.in_place[b]
        if slots is not None:  # read in place: the GEMMs read the layer's slots of the pool
            rec.access(cache.pool.rows_NR, slots.tolist(), False)
        elif cache.staging.mixed[b]:  # hits from their slots, misses from the buffer (one bank, staging.py)
            res = cache.pool.resident(layer)
            rec.access(cache.pool.rows_NR, res[res >= 0].tolist(), False)
            rec.access(cache.staging.rows[b], np.flatnonzero(res < 0).tolist(), False)
        else:
            rec.access(cache.staging.rows[b], range(cache.E), False)  # the GEMMs read the whole layer
        return views

    la = cache.decode.lookahead
    ahead_base = la.base if la is not None else None
    real_prefetch = decode_miss.prefetch_misses_reference

    def serve(slot_of_E, ids_TK, host_rows, pool_rows, base, pf_row_E=None):
        rows = real_serve(slot_of_E, ids_TK, host_rows, pool_rows, base, pf_row_E)
        flat = rows.flatten().tolist()
        if pf_row_E is not None:  # the lookahead's row map (which parity: by address), then its rows, are read
            rec.access_named(f"map{(pf_row_E.data_ptr() - la.row_of_PE.data_ptr()) // pf_row_E.nbytes}", [0], False)
        rec.access(pool_rows, [r for r in flat if 0 <= r < base or (ahead_base is not None and r >= ahead_base)],
                   False)
        rec.access(pool_rows, sorted({r for r in flat if r >= base and (ahead_base is None or r < ahead_base)}), True)
        return rows

    def prefetch(slot_of_E, ids_TK, host_rows, pool_rows, base, row_of_E):
        n = real_prefetch(slot_of_E, ids_TK, host_rows, pool_rows, base, row_of_E)
        rec.access_named(f"map{(row_of_E.data_ptr() - la.row_of_PE.data_ptr()) // row_of_E.nbytes}", [0], True)
        rec.access(pool_rows, range(base, base + n), True)
        return n

    monkeypatch.setattr(hit_copy.H2DRows, "copy", h2d)
    monkeypatch.setattr(copy_kernels, "gather_rows", gather)
    monkeypatch.setattr(copy_kernels, "gather_resident", resident)
    monkeypatch.setattr(type(cache.staging), "_copy_full", full)
    monkeypatch.setattr(cache, "stage", stage)
    monkeypatch.setattr(decode_miss, "serve_misses_reference", serve)
    monkeypatch.setattr(lookahead_module, "prefetch_misses_reference", prefetch)
    return rec, real_done


class _Router:
    """A stand-in router for the lookahead (its predictions only move bytes): K ids from the hidden state."""

    def __init__(self, E, K, salt):
        self.E, self.K, self.salt = E, K, salt

    def forward(self, hidden_TH):
        ids = ((hidden_TH[:, :self.K].abs() * 1000).long() + self.salt) % self.E
        return None, None, ids


def _cache(tiny_ckpt, skip=lambda ev: False, policy="balanced", lookahead=False, read_in_place=True):
    store = ExpertStore.from_checkpoint(tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt"), progress=False)
    cache = OffloadMoeCache(store, CacheConfig(budget="24 slots", policy=policy),
                            PrefillConfig(hit_copy="gather", read_in_place=read_in_place), "cpu", lookahead=lookahead)
    cache.streams = FakeStreams(cache.device, skip)
    parts = [cache.staging, cache.decode] + ([cache.decode.lookahead] if lookahead else [])
    for part in parts:
        part.streams = cache.streams
    if lookahead:
        E, K = store.num_experts, store.geometry.top_k
        cache.decode.lookahead.set_routers({layer: _Router(E, K, i) for i, layer in enumerate(store.layers)})
    ev = cache.streams.event
    for name in ("misses_done", "hits_done", "released"):
        setattr(cache.staging, name, [ev(), ev()])
    cache.decode._record_event, cache.decode._snap_event = ev(), ev()
    cache.decode._pending_event = ev()
    return store, cache


def _traffic(cache, store, rng, steps, late=False):
    """``late``: decode steps with their boundaries read late (decode.run_ahead), prefills without (as the engine)."""
    layers, E, K = store.layers, store.num_experts, store.geometry.top_k
    for _ in range(steps):
        kind = rng.choice(["prefill", "aborted", "decode", "decode"])
        cache.decode.set_late(late and kind == "decode")
        if kind == "decode":
            cache.step_boundary()
            T = rng.choice([1, 2])
            for layer in layers:
                ids = torch.tensor([rng.sample(range(E), K) for _ in range(T)])
                hidden = torch.randn(T, 8, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
                cache.decode_rows(layer, ids, hidden)
            cache.decode_step_enqueued()
            continue
        try:
            with cache.prefill_pass():
                for i, layer in enumerate(layers):
                    cache.stage(layer)
                    if kind == "aborted" and i == 1:
                        raise RuntimeError("injected compute failure")
                    cache.done(layer)
        except RuntimeError:
            pass


@pytest.mark.parametrize("read_in_place", [True, False], ids=["hits-in-place", "hits-gathered"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_traffic_leaves_no_unordered_pair_of_accesses(tiny_ckpt, monkeypatch, seed, read_in_place):
    store, cache = _cache(tiny_ckpt, read_in_place=read_in_place)
    rec, _ = _instrument(monkeypatch, cache)
    _traffic(cache, store, random.Random(seed), 40)
    assert len(rec.log) > 200 and {r for r, *_ in rec.log} == {"pool", "staging0", "staging1"}
    assert rec.hazards() == []


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_run_ahead_traffic_with_late_boundaries_leaves_no_unordered_pair_and_never_waits_on_the_step_in_flight(
        tiny_ckpt, monkeypatch, seed):
    """decode.run_ahead: each boundary admits from the step before last and commits admissions two boundaries on, so
    copies into victims run while a step that may read them is queued. Every access must still be ordered, and the
    host never waits on the record event of the step in flight (the wait run-ahead exists to avoid)."""
    store, cache = _cache(tiny_ckpt)
    rec, _ = _instrument(monkeypatch, cache)
    waits = []
    real = cache.decode._record_event.synchronize
    cache.decode._record_event.synchronize = lambda: (waits.append(cache.decode.late), real())[1]
    _traffic(cache, store, random.Random(seed), 60, late=True)
    assert cache.stats()["total"]["bytes"]["decode_h2d"] > 0 and cache.stats()["total"]["evictions"] > 0
    assert not any(waits)
    assert rec.hazards() == []
    assert np.array_equal(cache.pool.table_LE.numpy(), cache.pool.slot_of_LE)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decode_lookahead_traffic_leaves_no_unordered_pair_of_accesses(tiny_ckpt, monkeypatch, seed):
    """decode.lookahead: the lookahead stream writes a parity's rows and row map, the next layer's miss server
    reads them on the compute stream, and two layers later the next prefetch rewrites them."""
    store, cache = _cache(tiny_ckpt, lookahead=True)
    rec, _ = _instrument(monkeypatch, cache)
    _traffic(cache, store, random.Random(seed), 40)
    names = {r for r, *_ in rec.log}
    assert {"map0", "map1"} <= names and any(s == "lookahead" for *_, s, _ in rec.log)
    assert cache.stats()["lookahead"]["used"] > 0  # lookahead rows were read
    assert rec.hazards() == []


@pytest.mark.parametrize("dropped", ["join", "fork"])
def test_the_checker_finds_the_lookahead_hazard_when_its_join_or_fork_is_dropped(tiny_ckpt, monkeypatch, dropped):
    """join: the compute stream no longer waits for the lookahead stream before a layer reads its rows; fork:
    the lookahead stream no longer waits for the compute stream before rewriting rows a layer may still read."""
    store, cache = _cache(tiny_ckpt, lookahead=True)
    fake = cache.streams
    waiter, waited = (fake.compute, fake.ahead) if dropped == "join" else (fake.ahead, fake.compute)
    real_wait = waiter.wait_stream
    waiter.wait_stream = lambda other: None if other is waited else real_wait(other)
    rec, _ = _instrument(monkeypatch, cache)
    _traffic(cache, store, random.Random(0), 40)
    found = rec.hazards()
    assert any(r == "pool" or r.startswith("map") for r, *_ in found), "a checker that cannot fail proves nothing"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_layers_read_in_place_between_decode_evictions_leave_no_unordered_access(tiny_ckpt, monkeypatch, seed):
    """cache.policy lru with 24 slots for 4 x 16 experts, layer 0 wholly resident at the start: passes read it in
    place (prefill.read_in_place) while decode steps evict its experts and refill those slots on the copy stream
    in between: every in-place read of a slot must be ordered after the writes to it. What orders them today is
    the pass's start (it commits pending decode admissions after waiting for them on the host) and the fill's
    two events; dropping the events alone leaves the host wait, so this is a regression check of the traffic,
    not a proof that each mechanism is needed."""
    store, cache = _cache(tiny_ckpt, policy="lru")
    cache.set_residency({store.layers[0]: list(range(store.num_experts)), store.layers[1]: [0, 5, 9]})
    rec, _ = _instrument(monkeypatch, cache)
    rng = random.Random(seed)
    in_place = 0
    for _ in range(30):  # a pass first (layer 0 read in place), then decode steps that evict and refill
        with cache.prefill_pass():
            for layer in store.layers:
                cache.stage(layer)
                cache.done(layer)
        in_place = cache.counters.compute["prefill_in_place_layers"]
        _traffic(cache, store, rng, 3)
    assert in_place > 0  # the path under test was taken
    assert rec.hazards() == []
    assert np.array_equal(cache.pool.table_LE.numpy(), cache.pool.slot_of_LE)


@pytest.mark.parametrize("dropped, read_in_place", [("hits_done", False), ("misses_done", False), ("released", False),
                                                    ("released", True)])
def test_the_checker_finds_hazards_when_one_staging_wait_is_dropped(tiny_ckpt, monkeypatch, dropped, read_in_place):
    """hits_done: the copy stream no longer waits a buffer's previous hit copy (the aborted-pass race);
    misses_done: the hit stream no longer waits the previous misses; released: writers no longer wait
    for compute to have read the buffer. With hits read in place (no hit copy) only the release orders a
    buffer's refill after its readers."""
    holder = {}
    store, cache = _cache(tiny_ckpt, skip=lambda ev: any(ev is e for e in holder.get("events", [])),
                          read_in_place=read_in_place)
    holder["events"] = getattr(cache.staging, dropped)
    cache.set_residency({layer: list(range(0, store.num_experts, 3)) for layer in store.layers[:2]})
    rec, _ = _instrument(monkeypatch, cache)
    _traffic(cache, store, random.Random(0), 40)
    found = rec.hazards()
    assert any(r.startswith("staging") for r, *_ in found), "a checker that cannot fail proves nothing"
    assert np.array_equal(cache.pool.table_LE.numpy(), cache.pool.slot_of_LE)
