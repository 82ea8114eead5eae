"""The GPU rows of the fault matrix: each CUDA-only step fails in turn, and the outcome is one of a named
start-up error, a logged and counted fallback with correct output, or a clean request-level error after
which the next request is correct. Never a wrong answer, never a hang. (The CPU rows: tests/test_faults.py.)

Faults are injected on the seam that performs the step: an allocation (``index_tensor`` of the module
that allocates, or a real allocation under ``torch.cuda.set_per_process_memory_fraction``), the ctypes
call of ``cudaMemcpyBatchAsync`` (``kernels/batch_memcpy.py``: a Python stand-in that returns a CUDA error
code), the per-run H2D copier (``hit_copy.copy_rows_torch``), the decode step's capture and replay
(``decode_graph.py``). A sticky CUDA error runs in a subprocess with a timeout.

"Correct" is compared with an unfaulted engine of the same settings (greedy ids, ``==``): bf16 on CUDA
reads the same expert bytes through the same kernels whatever the residency and copy path
(tests/gpu/test_offload_gpu.py, tests/gpu/test_decode_gpu.py). Every engine fixes
``prefill.routed_max_tokens=0`` (only decode steps and prompts of <= decode.max_tokens tokens take the
routed path) so the long prompt always takes the staged path, where the copies under test run.
"""

from __future__ import annotations

import dataclasses
import gc
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import moe_offload.hit_copy as hit_copy_mod
import moe_offload.slot_pool as slot_pool_mod
import moe_offload.staging as staging_mod
from moe_offload.budget import BudgetError
from moe_offload.cache import OffloadMoeCache
from moe_offload.cli import main as cli_main
from moe_offload.config import CacheConfig, PrefillConfig, load_config
from moe_offload.engine import Engine
from moe_offload.hit_copy import HitPathUnavailable
from moe_offload.host_store import ExpertStore
from moe_offload.kernels import batch_memcpy as bm
from moe_offload.kernels import copy as copy_kernels

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPT_LONG = [3 + (7 * i) % 290 for i in range(300)]  # 300 ids < 300 (tiny vocab: 320): the staged path
PROMPT_SHORT = [7, 11, 13, 17, 19]  # 5 tokens: the routed (decode) path from the first forward
BATCH = [list(range(10 + b, 34 + b)) for b in range(3)]  # 3 x 24 tokens decoded together (graph of batch 3)
SHORT_BATCH = [[p + b for p in PROMPT_SHORT] for b in range(3)]  # 3 x 5 = 15 tokens: no staged forward at all
NEW_TOKENS = 8
BASE = ("device=cuda", "dtype=bfloat16", "prefill.routed_max_tokens=0", "prefill.hit_copy=gather",
        "logging.level=WARNING")
STICKY_TIMEOUT_S = 180  # load + two tiny generates take ~20 s; a hang is the failure this bounds


def _engine(path: str, *extra: str) -> Engine:
    return Engine.from_config(load_config(None, [f"model.checkpoint={path}", "model.format=auto", *BASE, *extra]),
                              progress=False)


def _answers(eng: Engine) -> dict:
    """Greedy ids of the long prompt (staged), the short one (routed) and two batches of 3 (graph decoder)."""
    return {"long": eng.generate(PROMPT_LONG, NEW_TOKENS).token_ids,
            "short": eng.generate(PROMPT_SHORT, NEW_TOKENS).token_ids,
            "batch": [r.token_ids for r in eng.generate_batch(BATCH, NEW_TOKENS)],
            "short_batch": [r.token_ids for r in eng.generate_batch(SHORT_BATCH, NEW_TOKENS)]}


_REFERENCES: dict = {}


def reference(path: str, *extra: str) -> dict:
    """What an unfaulted engine of these settings answers (built once per settings)."""
    key = (path, extra)
    if key not in _REFERENCES:
        eng = _engine(path, *extra)
        _REFERENCES[key] = _answers(eng)
        eng.close()
        del eng
        gc.collect()
    return _REFERENCES[key]


def assert_residency_true(cache) -> None:
    """The map never lies: one owner per slot, host map == device table, every slot the map calls
    resident holds its expert's host bytes, and every slot is owned, free or an admission in flight."""
    cache.synchronize()
    pool, store = cache.pool, cache.store
    owners = pool.owner_S[pool.owner_S >= 0]
    assert len(set(owners.tolist())) == owners.size
    assert np.array_equal(pool.table_LE.cpu().numpy(), pool.slot_of_LE)
    for layer in store.layers:
        for e, s in enumerate(cache.resident(layer).tolist()):
            if s >= 0:
                assert pool.owner_S[s] == pool.layer_pos[layer] * cache.E + e
                assert torch.equal(pool.rows_SR[s].cpu(), store.rows(layer)[e])
    in_flight = {s for _, _, victims in cache.decode._pending for s in victims}
    assert set(np.flatnonzero(pool.owner_S >= 0).tolist()) | set(pool.policy._free) | in_flight == set(
        range(cache.num_slots))


def _raise_on_call(real, n: int, exc: Exception, calls: dict):
    """``real`` that raises ``exc`` on its ``n``-th call (and only then)."""

    def flaky(*args, **kw):
        calls["n"] = calls.get("n", 0) + 1
        if calls["n"] == n:
            raise exc
        return real(*args, **kw)

    return flaky


def _returns(code: int, then=None):
    """A stand-in for a ctypes runtime function: returns the CUDA error ``code`` on its first call and
    hands later calls to ``then`` (returns ``code`` on every call when ``then`` is None)."""
    calls = []

    def fn(*args):
        calls.append(1)
        return code if then is None or len(calls) == 1 else then(*args)

    return fn


@pytest.fixture(scope="module")
def tiny(tiny_ckpt) -> str:
    return tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt")


@pytest.fixture(scope="module")
def real_rows(tmp_path_factory) -> str:
    """qwen3-30b-a3b NVFP4 shapes (2.65 MB expert rows, 128 experts, top-8), 3 layers: rows large enough for
    the batched H2D call (``hit_copy_table.json`` h2d_batch: >= 256 KiB), ~1 GB of experts."""
    from moe_offload.checkpoint.synthetic import make_checkpoint

    out = tmp_path_factory.mktemp("q30") / "ckpt"
    make_checkpoint("qwen3-30b-a3b", "nvfp4-modelopt", out, layers=3, progress=False)
    return str(out)


# ------------------------------------------------------------------------------ device OOM at cache build
@pytest.fixture
def hog():
    """``hog(leave)``: hold all free device memory but ``leave`` bytes until the test ends."""
    held = []

    def take(leave: int) -> None:
        gc.collect()
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info()
        if free <= leave + (64 << 20):
            pytest.skip(f"only {free} bytes free on the device")
        block = 2 << 20  # the caching allocator rounds large blocks up to 2 MiB: round down, or the hog itself fails
        held.append(torch.empty((free - leave) // block * block, dtype=torch.uint8, device="cuda"))

    yield take
    held.clear()
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("fails", ["pool", "staging"])
def test_a_budget_larger_than_free_device_memory_is_a_budget_error_that_keeps_nothing_allocated(real_rows, hog,
                                                                                               fails):
    """A byte budget of 100 GiB buys every expert of the 3-layer model (384 rows of 2.65 MB, ~1 GB) plus two
    staging layers (256 rows); the device has 256 MiB free (the pool fails) or the pool + 64 MiB (staging
    fails, after the decode routing record was registered: it is unregistered again)."""
    store = ExpertStore.from_checkpoint(real_rows, progress=False)
    R, L, E = store.bytes_per_expert, len(store.layers), store.num_experts
    pool_rows = L * E + E  # every expert + at most E decode scratch rows
    hog((256 << 20) if fails == "pool" else pool_rows * R + (64 << 20))
    before = torch.cuda.memory_allocated()
    with pytest.raises(BudgetError, match=r"cache\.budget bytes=\S+: allocating the expert cache on cuda.*ran out of "
                       r"device memory.*lower cache\.budget, or set cache\.budget=auto") as info:
        OffloadMoeCache(store, CacheConfig(budget="100GiB"), PrefillConfig(), "cuda")
    assert info.value.__context__ is None and info.value.__cause__ is None  # no traceback holds the partial pool
    del info
    gc.collect()
    assert torch.cuda.memory_allocated() == before  # nothing of the failed cache stays allocated
    store.close()


def test_generate_with_a_cache_that_cannot_be_allocated_exits_2_with_one_line_naming_the_budget(real_rows, hog,
                                                                                               capsys):
    hog(256 << 20)
    code = cli_main(["generate", "--checkpoint", real_rows, "--prompt-ids", "5,6,7", "--max-new-tokens", "2",
                     "--set", "device=cuda", "--set", "cache.budget=1.0", "--set", "logging.level=WARNING"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "cache.budget fraction=1" in err[0] and "Traceback" not in err[0], err


# ------------------------------------------------------------------------------ device OOM mid-run
OOM = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (injected)")


@pytest.mark.parametrize("fail_at", [1, 2, 3, 4])  # a boundary's evictions (every layer), then commits, ...
def test_a_device_oom_writing_the_residency_table_in_a_decode_admission_fails_the_request_and_the_next_is_correct(
        tiny, monkeypatch, fail_at):
    """At 6 slots every decode step misses and each boundary admits: the table writes (evictions, then the
    commits a boundary later) allocate index tensors (``slot_pool.index_tensor``)."""
    want = reference(tiny, "cache.budget=1.0")
    eng = _engine(tiny, "cache.budget=6 slots")
    calls: dict = {}
    monkeypatch.setattr(slot_pool_mod, "index_tensor", _raise_on_call(slot_pool_mod.index_tensor, fail_at, OOM, calls))
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        eng.generate(PROMPT_SHORT, NEW_TOKENS)
    assert calls["n"] == fail_at
    assert_residency_true(eng.cache)
    monkeypatch.undo()
    assert _answers(eng) == want
    assert_residency_true(eng.cache)
    assert eng.cache.stats()["total"]["bytes"]["decode_h2d"] > 0  # admissions ran again


def test_a_device_oom_in_a_prefill_admission_into_free_slots_fails_the_request_and_the_next_is_correct(
        tiny, monkeypatch):
    """A pool of every expert with 2 of 16 resident per layer: the staged prefill copies staged experts into
    the free slots (``staging._admit_free``: index tensors allocated on the device)."""
    want = reference(tiny, "cache.budget=1.0")
    eng = _engine(tiny, "cache.budget=1.0")
    eng.cache.set_residency({layer: [0, 1] for layer in eng.store.layers})
    calls: dict = {}
    monkeypatch.setattr(staging_mod, "index_tensor", _raise_on_call(staging_mod.index_tensor, 1, OOM, calls))
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        eng.generate(PROMPT_LONG, NEW_TOKENS)
    assert calls["n"] == 1
    assert_residency_true(eng.cache)
    monkeypatch.undo()
    assert _answers(eng) == want
    assert_residency_true(eng.cache)


def test_a_device_oom_in_the_prefill_hit_copy_falls_back_to_full_layer_copies_with_one_event_and_a_count(
        tiny, monkeypatch, events):
    """The gather fails with a device OOM (its index tensors, ``hit_copy.index_tensor``, or, where the hit copy reads
    the device slot table, ``kernels.copy.gather_resident``: the path the cache takes since the gather read the table;
    at 4c209c0 the injected fault sat only in the first and was never reached): the hit path is declined for the
    rest of the cache's life (``cache._hit_failed``), the request itself is answered correctly."""
    # read_in_place off: a layer with hits and misses is otherwise a mixed fill, whose hits are read from their
    # slots without any hit copy (staging.py), and the injected fault was never reached (3 failures at e31192f)
    want = reference(tiny, "cache.budget=0.5", "prefill.read_in_place=false")
    eng = _engine(tiny, "cache.budget=0.5", "prefill.read_in_place=false")
    assert eng.cache.hit_path == "gather" and (eng.cache.residency_map().sum() > 0)  # warmup left hits
    eng.cache.reset()
    calls: dict = {}
    monkeypatch.setattr(hit_copy_mod, "index_tensor", _raise_on_call(hit_copy_mod.index_tensor, 1, OOM, calls))
    monkeypatch.setattr(copy_kernels, "gather_resident", _raise_on_call(copy_kernels.gather_resident, 1, OOM, calls))
    assert eng.generate(PROMPT_LONG, NEW_TOKENS).token_ids == want["long"]
    st = eng.cache.stats()
    assert calls["n"] == 1 and st["hit_path"] == "full_layer_copy" and st["hit_d2d_fallbacks"].get("call_failed", 0) >= 1
    declined = [e for e in events() if e["event"] == "prefill_hit_d2d_unavailable"]
    assert len(declined) == 1 and declined[0]["reason"] == "call_failed" and "injected" in declined[0]["detail"]
    monkeypatch.undo()
    assert _answers(eng) == want
    assert_residency_true(eng.cache)


def test_a_real_device_oom_mid_request_is_a_request_error_or_a_counted_fallback_and_the_next_request_is_correct(
        tiny):
    """A real allocation failure: the caching allocator is capped a few MiB above what the warmed engine holds,
    then a batch of 8 x 2000 tokens is prefilled (activations of tens of MiB). Where it fails depends on the
    allocator (a prefill activation: request error; a graph capture or a hit copy: declined, counted); both
    are allowed. The cap is lifted and the same engine answers as before the fault."""
    prompts = [torch.randint(3, 300, (2000,), generator=torch.Generator().manual_seed(b)).tolist() for b in range(8)]
    eng = _engine(tiny, "cache.budget=0.5", "decode.max_cache_len=2048")
    before = [r.token_ids for r in eng.generate_batch(prompts, 4)]  # makes the batch-8 decoder and its graph
    want = _answers(eng)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    cap = (torch.cuda.memory_reserved() + (4 << 20)) / total
    torch.cuda.set_per_process_memory_fraction(cap)
    try:
        try:
            outcome = [r.token_ids for r in eng.generate_batch(prompts, 4)]
        except torch.OutOfMemoryError:
            outcome = "request_error"
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    if outcome != "request_error":  # nothing raised: then it is the right answer, and any decline is counted
        assert outcome == before
    torch.cuda.synchronize()
    assert_residency_true(eng.cache)
    assert [r.token_ids for r in eng.generate_batch(prompts, 4)] == before
    assert _answers(eng) == want


# ------------------------------------------------------------------------------ cudaMemcpyBatchAsync error codes
class _CudartReturning:
    """The loaded libcudart with one entry point replaced by a stand-in that returns an error code."""

    def __init__(self, lib, name: str, code: int):
        self._lib, self._name, self._code = lib, name, code

    def __getattr__(self, attr):
        return _returns(self._code) if attr == self._name else getattr(self._lib, attr)


def _break_resolve(monkeypatch):
    """The binding resolves again (its process-wide caches emptied until the test ends), and
    ``cudaRuntimeGetVersion`` returns cudaErrorInsufficientDriver (35) while ``_bind`` resolves it."""
    import ctypes

    real_cdll = ctypes.CDLL

    def cdll(path, *args, **kw):
        lib = real_cdll(path, *args, **kw)
        return _CudartReturning(lib, "cudaRuntimeGetVersion", 35) if "libcudart" in str(path) else lib

    monkeypatch.setattr(bm, "_runtime", None)
    monkeypatch.setattr(bm, "_loaded", {})
    monkeypatch.setattr(bm.ctypes, "CDLL", cdll)


def _break_probe(monkeypatch):
    """The real runtime, but ``cudaMemcpyBatchAsync`` returns cudaErrorMemoryAllocation (2) in the probe
    (the probe runs again: the per-device cache is emptied until the test ends)."""
    rt = bm._resolve_runtime()
    monkeypatch.setattr(bm, "_runtime", dataclasses.replace(rt, memcpy_batch=_returns(2)))
    monkeypatch.setattr(bm, "_loaded", {})


@pytest.mark.parametrize("hit_copy", ["batch_memcpy", "gather"])
@pytest.mark.parametrize("where", ["resolve", "probe"])
def test_the_batched_memcpy_failing_at_start_up_is_a_logged_counted_fallback_with_correct_output(
        real_rows, monkeypatch, events, where, hit_copy):
    """``hit_copy=batch_memcpy``: the hit path is declined (full-layer copies, counted per pass);
    ``gather`` (the H200 default): only the batched H2D of the misses is declined (per-run copies, counted
    per pass as ``batch_h2d:probe_failed:call_failed``). Either way the answers are the unfaulted ones."""
    want = reference(real_rows, "cache.budget=0.5", f"prefill.hit_copy={hit_copy}")
    (_break_resolve if where == "resolve" else _break_probe)(monkeypatch)
    eng = _engine(real_rows, "cache.budget=0.5", f"prefill.hit_copy={hit_copy}")
    eng.cache.reset()
    got = eng.generate(PROMPT_LONG, NEW_TOKENS).token_ids
    st = eng.cache.stats()
    assert got == want["long"]
    assert st["declined"].get("batch_h2d:probe_failed:call_failed", 0) >= 1
    if hit_copy == "batch_memcpy":
        assert st["hit_path"] == "full_layer_copy" and st["hit_d2d_fallbacks"].get("probe_failed:call_failed", 0) >= 1
    else:
        assert st["hit_path"] == "gather" and st["hit_d2d_fallbacks"] == {}
    names = [e["event"] for e in events()]
    assert names.count("batch_memcpy_unavailable") == 1
    detail = next(e for e in events() if e["event"] == "batch_memcpy_unavailable")["detail"]
    assert ("cudaErrorInsufficientDriver (35)" if where == "resolve" else "cudaErrorMemoryAllocation (2)") in detail


@pytest.mark.parametrize("where", ["resolve", "probe"])
def test_the_batched_memcpy_failing_at_start_up_with_on_unavailable_error_is_a_named_start_up_error(
        tiny, monkeypatch, where):
    (_break_resolve if where == "resolve" else _break_probe)(monkeypatch)
    with pytest.raises(HitPathUnavailable, match=r"probe_failed:call_failed.*prefill\.hit_copy_on_unavailable=fallback"):
        _engine(tiny, "prefill.hit_copy=batch_memcpy", "prefill.hit_copy_on_unavailable=error")


@pytest.mark.parametrize("persistent", [False, True], ids=["once", "every_call"])
def test_the_batched_memcpy_returning_an_error_mid_run_on_the_hit_copy_falls_back_with_correct_output(
        tiny, monkeypatch, events, persistent):
    """Tiny rows (< 256 KiB) never enter the batched H2D: only the hit copy (slot -> staging) uses the
    binding. Its call returns cudaErrorInvalidValue (1): full-layer copies for the rest of the cache's life.
    read_in_place off: mixed fills read hits from their slots and make no hit copy (staging.py)."""
    want = reference(tiny, "cache.budget=0.5", "prefill.hit_copy=batch_memcpy", "prefill.read_in_place=false")
    eng = _engine(tiny, "cache.budget=0.5", "prefill.hit_copy=batch_memcpy", "prefill.read_in_place=false")
    binding = eng.cache.staging.hit.batch
    real = binding._rt.memcpy_batch
    monkeypatch.setattr(binding, "_rt", dataclasses.replace(binding._rt, memcpy_batch=_returns(1, None if persistent
                                                                                              else real)))
    eng.cache.reset()
    assert eng.generate(PROMPT_LONG, NEW_TOKENS).token_ids == want["long"]
    st = eng.cache.stats()
    assert st["hit_path"] == "full_layer_copy" and st["hit_d2d_fallbacks"].get("call_failed", 0) >= 1
    (declined,) = [e for e in events() if e["event"] == "prefill_hit_d2d_unavailable"]
    assert declined["reason"] == "call_failed" and "cudaErrorInvalidValue (1)" in declined["detail"]
    assert _answers(eng) == want
    assert_residency_true(eng.cache)


@pytest.mark.parametrize("persistent", [False, True], ids=["once", "every_call"])
def test_the_batched_memcpy_returning_an_error_mid_run_on_the_h2d_misses_is_redone_per_run_and_counted(
        real_rows, monkeypatch, events, persistent):
    """2.65 MB rows: the misses go host -> staging in one batched call (``H2DRows``), decode admissions too.
    The call returns cudaErrorInvalidValue: the rows are copied per run, the batch path is dropped for this
    cache (one ``batch_memcpy_unavailable`` event, ``batch_h2d:call_failed`` counted), answers unchanged."""
    want = reference(real_rows, "cache.budget=0.5")
    eng = _engine(real_rows, "cache.budget=0.5")
    h2d = eng.cache.staging.h2d
    assert h2d.batch is not None and eng.cache.hit_path == "gather"
    real = h2d.batch._rt.memcpy_batch
    monkeypatch.setattr(h2d.batch, "_rt", dataclasses.replace(h2d.batch._rt, memcpy_batch=_returns(1, None if persistent
                                                                                                  else real)))
    eng.cache.reset()
    assert eng.generate(PROMPT_LONG, NEW_TOKENS).token_ids == want["long"]
    st = eng.cache.stats()
    assert h2d.batch is None and st["declined"].get("batch_h2d:call_failed", 0) >= 1
    assert st["hit_path"] == "gather" and st["hit_d2d_fallbacks"] == {}  # the gather does not use the binding
    (ev,) = [e for e in events() if e["event"] == "batch_memcpy_unavailable"]
    assert ev["reason"] == "call_failed" and ev["fallback"] == "copy_per_run"
    assert _answers(eng) == want
    assert_residency_true(eng.cache)


def test_a_sticky_cuda_error_from_earlier_async_work_makes_the_next_call_raise_a_named_error_and_the_process_exit(
        tiny):
    """A device-side assert (an out-of-bounds index, enqueued and not waited for) poisons the context. The
    next generate must raise naming it; so must a direct cudaMemcpyBatchAsync call (or, if the runtime
    enqueues it, the sync after it); the process must then exit on its own. A subprocess: the context is
    unusable afterwards, and a hang fails the test at the timeout instead of stalling the run."""
    script = textwrap.dedent(f"""
        import numpy as np, torch
        from moe_offload.config import load_config
        from moe_offload.engine import Engine
        from moe_offload.kernels import batch_memcpy as bm
        cfg = load_config(None, ["model.checkpoint={tiny}", "model.format=auto", "device=cuda", "dtype=bfloat16",
                                 "prefill.hit_copy=batch_memcpy", "logging.level=ERROR"])
        eng = Engine.from_config(cfg, progress=False)
        print("BEFORE", eng.generate({PROMPT_SHORT}, 4).token_ids, flush=True)
        binding = bm.load_batch_memcpy()
        src = torch.arange(4096, device="cuda").to(torch.uint8)
        dst = torch.zeros(4096, dtype=torch.uint8, device="cuda")
        stream = torch.cuda.Stream()
        x = torch.zeros(8, device="cuda")
        y = x[torch.tensor([100], device="cuda")]  # out of bounds: a device-side assert, and nothing waits for it
        for what, call in (("generate", lambda: eng.generate({PROMPT_LONG}, 4)),
                           ("batch_memcpy", lambda: (binding.copy(np.array([dst.data_ptr()], np.uint64),
                                                                  np.array([src.data_ptr()], np.uint64),
                                                                  np.array([4096], np.uint64), stream),
                                                     stream.synchronize()))):
            try:
                call()
                print("NO_ERROR", what, flush=True)
            except Exception as exc:
                print("RAISED", what, type(exc).__name__, str(exc).splitlines()[0][:300], flush=True)
        print("EXITING", flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=STICKY_TIMEOUT_S)
    out = proc.stdout
    assert "BEFORE" in out and "EXITING" in out, (out, proc.stderr[-3000:])
    raised = [line for line in out.splitlines() if line.startswith("RAISED")]
    assert [line.split()[1] for line in raised] == ["generate", "batch_memcpy"], out
    for line in raised:  # named: the CUDA error, not a wrong answer or a silent success
        assert "device-side assert" in line or "cudaErrorAssert" in line, line


# ------------------------------------------------------------------------------ CUDA graphs of the decode step
def test_a_decode_graph_capture_that_fails_runs_eagerly_with_one_event_a_count_and_the_same_answers(
        tiny, monkeypatch, events):
    """The capture (second step of the batch-3 decoder) raises inside the captured forward; the decoder
    declines graphs (``decode_graph_declined``, ``stats()["declined"]["decode_graph:capture_failed"]``)
    and decodes eagerly, from the same static KV cache, with the unfaulted answers."""
    want = reference(tiny, "cache.budget=0.5")
    eng = _engine(tiny, "cache.budget=0.5")
    cache = eng.cache
    def failing_in_capture(real):
        def call(*args, **kwargs):
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("operation not permitted when stream is capturing (injected)")
            return real(*args, **kwargs)
        return call

    # the plan runs in decode_route (compute.fused_moe_launches: with the router's top-k) or in decode_plan
    for name in ("decode_plan", "decode_route"):
        monkeypatch.setattr(cache, name, failing_in_capture(getattr(cache, name)))
    cache.reset()
    assert [r.token_ids for r in eng.generate_batch(BATCH, NEW_TOKENS)] == want["batch"]
    st = cache.stats()
    graphs = {k: n for k, n in st["declined"].items() if k.startswith("decode_graph")}
    assert graphs == {"decode_graph:capture_failed": 1} and not st["compute"].get("decode_graph_captures")
    (ev,) = [e for e in events() if e["event"] == "decode_graph_declined"]
    assert ev["reason"] == "capture_failed" and ev["fallback"] == "eager" and "injected" in ev["detail"]
    assert [r.token_ids for r in eng.generate_batch(BATCH, NEW_TOKENS)] == want["batch"]  # eager from now on
    assert cache.stats()["declined"]["decode_graph:capture_failed"] == 1  # counted once, at the capture
    monkeypatch.undo()
    assert _answers(eng) == want
    assert_residency_true(cache)


class _ReplayFailing:
    """A captured graph whose ``n``-th replay raises (as a replay behind a broken stream would)."""

    def __init__(self, graph, n: int):
        self.graph, self.n, self.calls = graph, n, 0

    def replay(self) -> None:
        self.calls += 1
        if self.calls == self.n:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture (injected)")
        self.graph.replay()


def test_a_decode_graph_replay_that_raises_fails_the_request_and_the_next_request_is_correct(tiny, monkeypatch):
    """The boundary before the replay has run (admissions scheduled), the replay raises: the step never ran,
    so its routing record is not admitted from; the decoder and its graph serve the next request."""
    want = reference(tiny, "cache.budget=6 slots")
    eng = _engine(tiny, "cache.budget=6 slots")
    eng.generate_batch(BATCH, NEW_TOKENS)  # the batch-3 decoder exists and its step is captured
    dec = eng._decoders[len(BATCH)]
    assert dec.graph is not None
    monkeypatch.setattr(dec, "graph", _ReplayFailing(dec.graph, 3))
    with pytest.raises(RuntimeError, match="injected"):
        eng.generate_batch(BATCH, NEW_TOKENS)
    assert_residency_true(eng.cache)
    assert [r.token_ids for r in eng.generate_batch(BATCH, NEW_TOKENS)] == want["batch"]
    monkeypatch.undo()
    assert _answers(eng) == want
    assert_residency_true(eng.cache)


# ------------------------------------------------------------------------------ a copy on the copy stream
COPY_FAILED = RuntimeError("CUDA error: unspecified launch failure in copy_ (injected)")


def test_a_prefill_miss_copy_failing_on_the_copy_stream_fails_the_request_and_the_next_is_correct(tiny,
                                                                                                  monkeypatch):
    """Tiny rows go host -> staging per run (``hit_copy.copy_rows_torch``) on the copy stream; the 2nd call is
    layer 1's misses, enqueued while layer 0 computes."""
    want = reference(tiny, "cache.budget=0.5")
    eng = _engine(tiny, "cache.budget=0.5")
    calls: dict = {}
    monkeypatch.setattr(hit_copy_mod, "copy_rows_torch", _raise_on_call(hit_copy_mod.copy_rows_torch, 2, COPY_FAILED,
                                                                        calls))
    with pytest.raises(RuntimeError, match="injected"):
        eng.generate(PROMPT_LONG, NEW_TOKENS)
    assert calls["n"] == 2
    assert_residency_true(eng.cache)
    monkeypatch.undo()
    assert _answers(eng) == want
    assert_residency_true(eng.cache)


def test_a_decode_admission_copy_failing_on_the_copy_stream_fails_the_request_and_the_next_is_correct(
        tiny, monkeypatch):
    """A batch of 3 x 5 tokens takes the routed path from its first forward (no staging copy), so the first
    per-run H2D copy is a decode admission: at 6 slots each boundary admits the last step's misses; their
    host -> slot copies (on the copy stream) raise; the victims go back to the free list."""
    want = reference(tiny, "cache.budget=6 slots")
    eng = _engine(tiny, "cache.budget=6 slots")
    calls: dict = {}
    monkeypatch.setattr(hit_copy_mod, "copy_rows_torch", _raise_on_call(hit_copy_mod.copy_rows_torch, 1, COPY_FAILED,
                                                                        calls))
    with pytest.raises(RuntimeError, match="injected"):
        eng.generate_batch(SHORT_BATCH, NEW_TOKENS)
    assert calls["n"] == 1
    assert_residency_true(eng.cache)
    monkeypatch.undo()
    eng.cache.reset()
    assert _answers(eng) == want
    assert eng.cache.stats()["total"]["bytes"]["decode_h2d"] > 0  # admissions resumed
    assert_residency_true(eng.cache)
