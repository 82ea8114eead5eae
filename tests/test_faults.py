"""The fault matrix on the CPU (issue 16): each external step fails in turn, and the outcome is one of
a named start-up error, a logged and counted fallback with correct output, or a clean request-level
error after which the next request is correct (equal to an unfaulted engine). Never a wrong answer,
never a hang.

Cases covered elsewhere (not repeated here; the README's "Reliability: the fault matrix" lists them):
- prefill hit copy raising mid-run: tests/test_cache.py::test_a_copy_failing_mid_run_switches_to_full_layer_copies_without_wrong_output
- decode admission copy raising between steps (cache level): tests/test_cache.py::test_a_failing_admission_copy_leaves_the_map_true_and_the_next_step_correct
- prefill admission gather raising: tests/test_cache.py::test_a_failing_prefill_admission_leaves_the_map_true
- a truncated safetensors file at open: tests/test_checkpoint.py::test_truncated_file_is_named

Faults are injected with monkeypatch on the seam that performs the step (the row copier, the expert
GEMM, the pin call, the safetensors handle). Outputs are compared with ``torch.equal``: on the CPU in
fp32 the offloaded engine computes from the same bytes in the same order whatever the residency, so
a correct answer is bit-identical (tests/test_soak.py checks that over thousands of steps).
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import moe_offload.cache as cache_mod
import moe_offload.compute.dequant as dequant_mod
import moe_offload.hit_copy as hit_copy_mod
import moe_offload.host_store as host_store
import moe_offload.slot_pool as slot_pool_mod
from moe_offload import uva
from moe_offload.checkpoint import reader as reader_mod
from moe_offload.checkpoint.reader import CheckpointError, CheckpointReader
from moe_offload.cli import main as cli_main
from moe_offload.config import load_config
from moe_offload.copy_paths import RowCopy
from moe_offload.engine import Engine
from moe_offload.host_store import ExpertStore
from moe_offload.kernels.batch_memcpy import BatchMemcpyError

PROMPT_LONG = list(range(40, 100))  # 60 tokens: the prefill path (> decode.max_tokens = 16)
PROMPT_SHORT = [7, 11, 13, 17, 19]  # 5 tokens: the decode path from the first forward
NEW_TOKENS = 6


def _engine(path: str, *extra: str) -> Engine:
    cfg = load_config(None, [f"model.checkpoint={path}", "model.format=auto", "device=cpu", "cache.budget=0.5",
                             "prefill.hit_copy=gather", "logging.level=WARNING", *extra])
    return Engine.from_config(cfg, progress=False)


def _fail_on_call(real, n: int, calls: dict):
    """``real`` that raises on its ``n``-th call (and only then): a fault in the middle of a pass."""

    def flaky(*args, **kw):
        calls["n"] = calls.get("n", 0) + 1
        if calls["n"] == n:
            raise RuntimeError("injected fault")
        return real(*args, **kw)

    return flaky


def _assert_residency_true(cache) -> None:
    """The map never lies: one owner per slot, host map == device table, and every expert the map
    calls resident holds its host bytes in its slot."""
    pool, store = cache.pool, cache.store
    owners = pool.owner_S[pool.owner_S >= 0]
    assert len(set(owners.tolist())) == owners.size
    assert np.array_equal(pool.table_LE.cpu().numpy(), pool.slot_of_LE)
    assert (pool.slot_of_LE >= 0).sum() == owners.size
    for layer in store.layers:
        for e, s in enumerate(cache.resident(layer).tolist()):
            if s >= 0:
                assert pool.owner_S[s] == pool.layer_pos[layer] * cache.E + e
                assert torch.equal(pool.rows_SR[s], store.rows(layer)[e])


@pytest.fixture(scope="module")
def nvfp4(tiny_ckpt):
    return tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt")


@pytest.fixture(scope="module")
def reference(nvfp4):
    """What an unfaulted engine answers: prefill logits of the long prompt, greedy ids of both prompts."""
    eng = _engine(nvfp4)
    logits, _ = eng.prefill(torch.tensor([PROMPT_LONG]))
    return {"logits": logits, "long": eng.generate(PROMPT_LONG, NEW_TOKENS).token_ids,
            "short": eng.generate(PROMPT_SHORT, NEW_TOKENS).token_ids}


# ------------------------------------------------------------------------------ start-up: pinning
def test_a_pin_failure_at_store_build_is_a_named_error_that_unpins_the_layers_already_pinned(nvfp4, monkeypatch):
    """cudaHostRegister failing on the third layer (pinned-memory limit): ``uva.UvaError`` naming the
    call, and the two layers registered before it are unregistered (not leaked as registered pages)."""
    pinned, unpinned = [], []

    def pin(t):
        if len(pinned) == 2:
            raise uva.UvaError("cudaHostRegister(6144 bytes, Mapped|Portable) failed: cudaErrorMemoryAllocation (2); "
                               "check the pinned-memory limit (ulimit -l)", code=2, name="cudaErrorMemoryAllocation")
        pinned.append(t.data_ptr())
        return True

    monkeypatch.setattr(host_store, "_pin", pin)
    monkeypatch.setattr(host_store, "_unpin", lambda ptrs: unpinned.extend(ptrs))
    with pytest.raises(uva.UvaError, match="cudaHostRegister.*cudaErrorMemoryAllocation"):
        ExpertStore.from_checkpoint(nvfp4, progress=False)
    assert len(pinned) == 2 and sorted(unpinned) == sorted(pinned)


def test_a_pin_failure_makes_generate_exit_with_one_line_naming_the_call(nvfp4, monkeypatch, capsys):
    def pin(t):
        raise uva.UvaError("cudaHostRegister(6144 bytes, Mapped|Portable) failed: cudaErrorNotSupported (801)")

    monkeypatch.setattr(host_store, "_pin", pin)
    code = cli_main(["generate", "--checkpoint", nvfp4, "--prompt-ids", "5,6,7", "--max-new-tokens", "2",
                     "--set", "device=cpu", "--set", "logging.level=WARNING"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "cudaHostRegister" in err[0] and "Traceback" not in err[0]


# ------------------------------------------------------------------------------ mid-run: copies
def test_a_prefill_miss_copy_raising_mid_pass_fails_the_request_and_the_next_prefill_is_correct(nvfp4, reference,
                                                                                                monkeypatch):
    eng = _engine(nvfp4)
    assert eng.cache.resident(eng.store.layers[0]).max() >= 0  # warmup left hits: the split path runs
    h2d = eng.cache.staging.h2d
    calls: dict = {}
    monkeypatch.setattr(h2d, "copy", _fail_on_call(h2d.copy, 2, calls))  # layer 1's misses, layer 0 computing
    with pytest.raises(RuntimeError, match="injected fault"):
        eng.prefill(torch.tensor([PROMPT_LONG]))
    assert calls["n"] == 2
    _assert_residency_true(eng.cache)
    monkeypatch.undo()
    logits, _ = eng.prefill(torch.tensor([PROMPT_LONG]))
    assert torch.equal(logits, reference["logits"])
    assert eng.generate(PROMPT_LONG, NEW_TOKENS).token_ids == reference["long"]
    _assert_residency_true(eng.cache)


def test_a_decode_admission_copy_raising_fails_the_request_and_the_next_generate_is_correct(nvfp4, reference,
                                                                                           monkeypatch):
    """At the minimum cache every decode step misses, so the boundary before step 2 admits: its host ->
    slot copy raises inside generate. (The cache-level invariants are in tests/test_cache.py.)"""
    eng = _engine(nvfp4, "cache.budget=4 slots")
    h2d = eng.cache.decode.h2d
    calls: dict = {}
    monkeypatch.setattr(h2d, "copy", _fail_on_call(h2d.copy, 1, calls))
    with pytest.raises(RuntimeError, match="injected fault"):
        eng.generate(PROMPT_SHORT, NEW_TOKENS)
    assert calls["n"] == 1
    _assert_residency_true(eng.cache)
    monkeypatch.undo()
    assert eng.generate(PROMPT_SHORT, NEW_TOKENS).token_ids == reference["short"]
    assert eng.cache.stats()["total"]["bytes"]["decode_h2d"] > 0  # admissions ran again after the fault
    _assert_residency_true(eng.cache)


# ------------------------------------------------------------------------------ mid-run: compute
@pytest.mark.parametrize("prompt,fail_at", [("long", 3), ("short", 7)], ids=["prefill_pass", "decode_step"])
def test_an_expert_gemm_raising_mid_forward_fails_the_request_and_the_next_request_is_correct(
        nvfp4, reference, monkeypatch, prompt, fail_at):
    """The expert GEMM raises at MoE layer 2 of a prefill pass (3rd call), or at layer 2 of the second
    decode step (7th call: 4 layers per step, the prompt itself is a decode-path step)."""
    eng = _engine(nvfp4)
    ids = PROMPT_LONG if prompt == "long" else PROMPT_SHORT
    calls: dict = {}
    monkeypatch.setattr(dequant_mod, "moe_grouped", _fail_on_call(dequant_mod.moe_grouped, fail_at, calls))
    with pytest.raises(RuntimeError, match="injected fault"):
        eng.generate(ids, NEW_TOKENS)
    assert calls["n"] == fail_at
    _assert_residency_true(eng.cache)
    monkeypatch.undo()
    assert eng.generate(ids, NEW_TOKENS).token_ids == reference[prompt]
    logits, _ = eng.prefill(torch.tensor([PROMPT_LONG]))
    assert torch.equal(logits, reference["logits"])


# ------------------------------------------------------------------------------ load: safetensors
def _copy_ckpt(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_an_io_error_reading_an_expert_tensor_is_a_named_error_naming_file_and_tensor(nvfp4, monkeypatch):
    real_open = reader_mod.safe_open

    class FailingSlice:
        def __init__(self, sl):
            self.sl = sl

        def __getitem__(self, idx):
            raise OSError(errno.EIO, "Input/output error")

    class FailingHandle:
        def __init__(self, h):
            self.h = h

        def get_slice(self, name):
            return FailingSlice(self.h.get_slice(name)) if ".experts." in name else self.h.get_slice(name)

        def get_tensor(self, name):
            return self.h.get_tensor(name)

    monkeypatch.setattr(reader_mod, "safe_open", lambda *a, **k: FailingHandle(real_open(*a, **k)))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: cannot read tensor \S+experts\S+ .*Input/output"):
        ExpertStore.from_checkpoint(nvfp4, progress=False)


def test_a_file_replaced_by_a_truncated_copy_after_the_headers_were_checked_is_a_named_error(nvfp4, tmp_path):
    ckpt = _copy_ckpt(nvfp4, tmp_path / "ckpt")
    reader = CheckpointReader(ckpt)  # headers validated against the original file
    f = ckpt / "model.safetensors"
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(f.read_bytes()[:-4096])
    os.replace(bad, f)  # an atomic replace (a re-download in progress, a sync tool) before the first read
    with pytest.raises(CheckpointError, match=r"model\.safetensors: (cannot open|changed on disk)"):
        ExpertStore.from_checkpoint(reader, progress=False)


def test_a_file_replaced_while_open_keeps_serving_the_opened_file(nvfp4, tmp_path):
    """Replaced by rename after the first read: the open handle keeps the old inode, so every expert
    still comes from the file that was validated (bit-identical to a clean load)."""
    ckpt = _copy_ckpt(nvfp4, tmp_path / "ckpt")
    reader = CheckpointReader(ckpt)
    reader.get(next(n for n in reader.names() if ".experts." not in n))  # the handle is open now
    f = ckpt / "model.safetensors"
    junk = tmp_path / "junk"
    junk.write_bytes(os.urandom(f.stat().st_size))
    os.replace(junk, f)
    got = ExpertStore.from_checkpoint(reader, progress=False)
    want = ExpertStore.from_checkpoint(nvfp4, progress=False)
    for layer in want.layers:
        assert torch.equal(got.rows(layer), want.rows(layer))


def test_a_file_truncated_in_place_while_open_is_a_named_error_not_a_crash(nvfp4, tmp_path):
    """Reads go through a memory map, where bytes past a truncated end kill the process (SIGBUS); the
    reader re-checks the file's size before every read. (A truncation between that check and the read
    itself still crashes: the window is narrowed, not closed.)"""
    ckpt = _copy_ckpt(nvfp4, tmp_path / "ckpt")
    script = textwrap.dedent(f"""
        import os
        from moe_offload.checkpoint.reader import CheckpointError, CheckpointReader
        from moe_offload.host_store import ExpertStore
        r = CheckpointReader({str(ckpt)!r})
        r.get(next(n for n in r.names() if ".experts." not in n))
        os.truncate({str(ckpt / "model.safetensors")!r}, 1000)
        try:
            ExpertStore.from_checkpoint(r, progress=False)
        except CheckpointError as exc:
            print("NAMED", exc)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "NAMED" in proc.stdout and "model.safetensors" in proc.stdout


# ------------------------------------------------------------------------------ TP: a peer raising
TP_TIMEOUT_S = 150  # spawning two ranks and loading the tiny model takes ~10-20 s on 2 cores; a hang is 30 min


def test_a_tp_peer_raising_mid_step_under_gloo_ends_every_rank_with_a_named_error_in_bounded_time(nvfp4):
    """Rank 1's expert GEMM raises in its second prefill; rank 0 is inside the all-reduce of that layer.
    run_on_ranks must end every rank and raise naming the failing rank's error, well before any timeout.
    Run in a subprocess so a hang fails the test (TimeoutExpired) instead of stalling CI."""
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from moe_offload.config import load_config
        from moe_offload.launch import run_on_ranks
        import test_faults
        cfg = load_config(None, ["model.checkpoint={nvfp4}", "model.format=auto", "device=cpu", "cache.budget=0.5",
                                 "prefill.hit_copy=gather", "logging.level=ERROR", "parallel.tp=2",
                                 "prefill.warmup=false"])
        t0 = time.perf_counter()
        try:
            run_on_ranks(cfg, test_faults.tp_rank_that_fails)
            print("NO_ERROR")
        except RuntimeError as exc:
            print("ERROR", round(time.perf_counter() - t0, 1), str(exc).replace(chr(10), " | "))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=TP_TIMEOUT_S)
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.startswith("ERROR") and "a TP rank failed" in out, out[-3000:]
    assert "Process 1 terminated" in out and "injected TP fault on rank 1" in out  # names the rank and its error
    # run_on_ranks returned (spawn, load, two prefills, the fault) in seconds, not at gloo's 30-min timeout:
    # measured 15 s on 2 busy cores; 100 s leaves room for a slow CI host and is far below any collective timeout
    assert float(out.split()[1]) < 100


def tp_rank_that_fails(cfg, tp):
    """Per-rank job of the TP case (module level: spawned ranks import it by name)."""
    from moe_offload.launch import build_tp_engine

    rt = build_tp_engine(cfg, tp, progress=False)
    rt.engine.prefill(torch.tensor([PROMPT_LONG]))
    if tp.rank == 1:
        real = dequant_mod.moe_grouped

        def broken(*a, **k):
            raise RuntimeError("injected TP fault on rank 1")

        dequant_mod.moe_grouped = broken
        try:
            rt.engine.prefill(torch.tensor([PROMPT_LONG]))
        finally:
            dequant_mod.moe_grouped = real
    else:
        rt.engine.prefill(torch.tensor([PROMPT_LONG]))
    return {"rank": tp.rank}


# ------------------------------------------------------------------------------ device memory (OOM) on the CPU
def _oom_on_call(real, n: int, calls: dict):
    """``real`` that raises a device OOM on its ``n``-th call (and only then)."""

    def flaky(*args, **kw):
        calls["n"] = calls.get("n", 0) + 1
        if calls["n"] == n:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(*args, **kw)

    return flaky


@pytest.mark.parametrize("fail_at", [1, 2, 3, 4], ids=["evict_first_boundary", "commit_first_boundary",
                                                       "evict_second_boundary", "commit_second_boundary"])
def test_a_device_oom_writing_the_residency_table_fails_the_request_and_later_answers_stay_correct(
        nvfp4, monkeypatch, fail_at):
    """The device table writes of decode admissions allocate index tensors (``slot_pool.index_tensor``): at a
    boundary the victims' evictions of every layer (one upload: call 1), a boundary later their commits (call 2)
    and that boundary's evictions (call 3), then their commits (call 4). Before the fix an OOM there left the
    device table pointing at slots the host map had given up; they were refilled with other experts and later
    decode steps read the wrong expert (wrong answers within 40 requests at 6 slots)."""
    eng = _engine(nvfp4, "cache.budget=6 slots")
    ref = _engine(nvfp4, "cache.budget=1.0")
    calls: dict = {}
    monkeypatch.setattr(slot_pool_mod, "index_tensor", _oom_on_call(slot_pool_mod.index_tensor, fail_at, calls))
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        eng.generate(PROMPT_SHORT, NEW_TOKENS)
    assert calls["n"] == fail_at
    _assert_residency_true(eng.cache)
    pool = eng.cache.pool
    assert set(np.flatnonzero(pool.owner_S >= 0)) | set(pool.policy._free) == set(range(eng.cache.num_slots))
    monkeypatch.undo()
    rng = random.Random(fail_at)
    for _ in range(12):
        prompt = [rng.randrange(3, 300) for _ in range(rng.randint(1, 40))]
        assert eng.generate(prompt, 10).token_ids == ref.generate(prompt, 10).token_ids, prompt
        _assert_residency_true(eng.cache)


@pytest.mark.parametrize("error", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)"),
    # a kernel's first launch loading its module into full device memory (the H200 at edd2da4, SlotPool's torch.full)
    torch.AcceleratorError("CUDA error: out of memory (injected)")], ids=["allocator", "kernel_launch"])
def test_a_device_oom_allocating_the_cache_is_a_budget_error_naming_the_setting(nvfp4, monkeypatch, capsys, error):
    """torch's OOM text names no setting; the cache's start-up error names cache.budget and the fix (the GPU
    variant with a real allocation is tests/gpu/test_faults_gpu.py)."""
    def staging(*args, **kw):
        raise error

    monkeypatch.setattr(cache_mod, "PrefillStaging", staging)
    with pytest.raises(cache_mod.BudgetError, match=r"cache\.budget fraction=0\.5: allocating the expert cache.*"
                       r"ran out of device memory \(CUDA (error: )?out of memory.*lower cache\.budget"):
        _engine(nvfp4)
    code = cli_main(["generate", "--checkpoint", nvfp4, "--prompt-ids", "5,6,7", "--max-new-tokens", "2",
                     "--set", "device=cpu", "--set", "cache.budget=0.5", "--set", "logging.level=WARNING"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "cache.budget" in err[0] and "Traceback" not in err[0]


class _FailingBatch:
    """A batched-copy binding whose runtime call returns an error code (``BatchMemcpy._raise_on_error``)."""

    calls = 0

    def copy(self, dst, src, size, stream) -> None:
        self.calls += 1
        raise BatchMemcpyError("cudaMemcpyBatchAsync(3 entries, stream 0x5) failed: cudaErrorInvalidValue (1)",
                               code=1, name="cudaErrorInvalidValue")


def test_a_batched_h2d_call_failing_mid_run_is_redone_per_run_and_the_batch_path_dropped_with_one_event(
        monkeypatch):
    events = []
    monkeypatch.setattr(hit_copy_mod.log, "log_once", lambda key, name, *a, **kw: events.append((name, kw)))
    host = torch.arange(8 * 32, dtype=torch.int32).view(torch.uint8).view(8, 128)
    dev = torch.zeros(6, 128, dtype=torch.uint8)
    batch, failures = _FailingBatch(), []
    h2d = hit_copy_mod.H2DRows(batch, min_batch_row_bytes=64)
    h2d.on_batch_failure = failures.append
    h2d.copy([RowCopy(dev, host, np.array([0, 1, 4]), np.array([2, 3, 7]))], coalesce=True)
    assert batch.calls == 1 and h2d.batch is None and len(failures) == 1
    assert [(n, kw["reason"], kw["fallback"]) for n, kw in events] == [("batch_memcpy_unavailable", "call_failed",
                                                                        "copy_per_run")]
    want = torch.zeros_like(dev)
    want[[0, 1, 4]] = host[[2, 3, 7]]
    assert torch.equal(dev, want)
    h2d.copy([RowCopy(dev, host, np.array([5]), np.array([0]))], coalesce=False)  # per run from now on
    assert batch.calls == 1 and torch.equal(dev[5], host[0]) and len(failures) == 1


def test_a_cuda_error_other_than_out_of_memory_at_cache_build_is_not_reported_as_a_budget_error(nvfp4, monkeypatch):
    """Only CUDA's out-of-memory becomes the budget error; any other accelerator error keeps its own text."""
    def staging(*args, **kw):
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered (injected)")

    monkeypatch.setattr(cache_mod, "PrefillStaging", staging)
    with pytest.raises(torch.AcceleratorError, match="illegal memory access"):
        _engine(nvfp4)
