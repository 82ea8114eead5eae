"""A routed fill's copy entries planned on the device (``prefill.routed_plan: device``, kernels/routed_plan.py): the
Triton program (here under TRITON_INTERPRET) equals the plain-torch plan, the plan equals the runs of routed missing
experts worked out in numpy, and a routed fill that copies its planned entries stages the same rows, counts and
admissions as the host plan (tests/test_routed_fills.py runs both). The program on a GPU and the batched call of its
entries: tests/gpu/test_routed_plan_gpu.py."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_offload.cache import OffloadMoeCache
from moe_offload.config import CacheConfig, PrefillConfig
from moe_offload.host_store import ExpertStore
from moe_offload.kernels import routed_plan
from moe_offload.kernels.routed_plan import HEADER, out_words, plan_reference, plan_words

R, DST, SRC = 1000, 1 << 40, 1 << 41


def numpy_plan(ids: np.ndarray, table: np.ndarray) -> tuple[list[tuple[int, int]], int, np.ndarray, int]:
    """(runs [(first, rows)], routed, missing_E, bad) straight from the definition."""
    E = table.size
    valid = ids[(ids >= 0) & (ids < E)]
    routed = np.zeros(E, bool)
    routed[valid] = True
    miss = routed & (table < 0)
    runs, e = [], 0
    while e < E:
        if miss[e]:
            f = e
            while e < E and miss[e]:
                e += 1
            runs.append((f, e - f))
        else:
            e += 1
    return runs, int(routed.sum()), miss.astype(np.int64), int(ids.size - valid.size)


def check(plan: np.ndarray, ids: np.ndarray, table: np.ndarray) -> None:
    E = table.size
    runs, routed, miss, bad = numpy_plan(ids, table)
    n = len(runs)
    assert plan[:HEADER].tolist() == [n, routed, int(miss.sum()), bad]
    assert plan[HEADER:HEADER + n].tolist() == [DST + f * R for f, _ in runs]
    assert plan[HEADER + E:HEADER + E + n].tolist() == [SRC + f * R for f, _ in runs]
    assert plan[HEADER + 2 * E:HEADER + 2 * E + n].tolist() == [k * R for _, k in runs]
    assert np.array_equal(plan[HEADER + 3 * E:HEADER + 4 * E], miss)


def _case(seed: int, E: int, N: int, resident: float, bad: bool):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, E, N)
    if bad:
        ids[rng.integers(0, N)] = rng.choice([-1, E, E + 7])
    table = np.where(rng.random(E) < resident, rng.integers(0, 99, E), -1).astype(np.int32)
    return ids, table


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), E=st.sampled_from([1, 2, 8, 60, 128, 130]), N=st.integers(1, 200),
       resident=st.sampled_from([0.0, 0.3, 0.7, 1.0]), bad=st.booleans())
def test_the_reference_plan_is_the_runs_of_routed_missing_experts(seed, E, N, resident, bad):
    ids, table = _case(seed, E, N, resident, bad)
    plan = plan_reference(torch.from_numpy(ids), torch.from_numpy(table), R, DST, SRC)
    assert plan.shape == (plan_words(E),)
    check(plan.numpy(), ids, table)


@pytest.mark.parametrize("E,N,resident,bad,dtype", [
    (8, 5, 0.0, False, torch.int64), (128, 128, 0.37, False, torch.int64), (130, 300, 0.5, True, torch.int64),
    (128, 2048, 0.0, False, torch.int32), (512, 160, 0.37, True, torch.int64), (60, 64, 1.0, False, torch.int64),
    (64, 77, 0.2, False, torch.int16), (256, 5, 0.0, False, torch.uint8)])
def test_the_triton_program_writes_the_reference_plan(E, N, resident, bad, dtype):
    """The program itself (interpreted): ids in chunks past one (N > 64), E not a power of two, ids outside the layer,
    every expert resident (no runs), narrow and unsigned id types (a uint8 tail lane once read as expert 255)."""
    if routed_plan.triton is None:
        pytest.skip("triton is not installed")
    ids, table = _case(E * N, E, N, resident, bad)
    plan = torch.full((plan_words(E),), -5, dtype=torch.int64)  # stale words where the program writes none
    out = torch.full((out_words(E) + 3,), -7, dtype=torch.int64)  # e.g. mapped host words; 3 words past its part
    for copy_out in (False, True):  # without out_P the program is passed plan_P there and writes none of it
        plan.fill_(-5)
        routed_plan._plan_kernel[(1,)](torch.from_numpy(ids).to(dtype), N, torch.from_numpy(table), plan,
                                       out if copy_out else plan, E, R, DST, SRC,
                                       BLOCK_E=routed_plan.triton.next_power_of_2(E), CHUNK=64, COPY_OUT=copy_out)
        check(plan.numpy(), ids, table)
    # the words before the scratch, as the plan holds them (lanes replicated where E < 128, E not a power of two);
    # nothing past them
    assert torch.equal(out[:out_words(E)], plan[:out_words(E)])
    assert out[out_words(E):].tolist() == [-7] * 3


def test_out_words_receive_the_plan_less_its_scratch_and_offsets_from_a_zero_base():
    """``plan_routed_fill``'s ``out_P`` (the reference path off CUDA): the words before the scratch, the same as
    ``plan_P``'s; a dst base of 0 gives each run's offset in the staging rows (the graph plan adds the base)."""
    ids, table = _case(3, 128, 128, 0.37, False)
    ids_t, table_t = torch.from_numpy(ids), torch.from_numpy(table)
    plan, out = torch.zeros(plan_words(128), dtype=torch.int64), torch.full((out_words(128),), -1, dtype=torch.int64)
    routed_plan.plan_routed_fill(ids_t, table_t, plan, R, 0, SRC, out_P=out)
    assert torch.equal(out, plan[:out_words(128)])
    based = plan_reference(ids_t, table_t, R, DST, SRC)
    runs = int(out[0])
    assert runs > 0 and (out[HEADER:HEADER + runs] + DST).tolist() == based[HEADER:HEADER + runs].tolist()
    with pytest.raises(ValueError, match="out_P must be a contiguous int64 tensor of at least 516 words"):
        routed_plan.plan_routed_fill(ids_t, table_t, plan, R, 0, SRC, out_P=torch.zeros(515, dtype=torch.int64))


def test_a_plan_buffer_of_the_wrong_size_or_type_is_refused():
    table = torch.full((8,), -1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"plan_P must be int64 \[44\]"):
        routed_plan.plan_routed_fill(torch.zeros(4, dtype=torch.long), table, torch.zeros(43, dtype=torch.int64),
                                     R, DST, SRC)
    with pytest.raises(ValueError, match="plan_P must be int64"):
        routed_plan.plan_routed_fill(torch.zeros(4, dtype=torch.long), table, torch.zeros(44, dtype=torch.int32),
                                     R, DST, SRC)


def test_a_device_planned_fill_names_bad_ids_as_the_host_plan_does(tiny_ckpt):
    store = ExpertStore.from_checkpoint(tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt"), progress=False)
    cache = OffloadMoeCache(store, CacheConfig(budget="1.0"), PrefillConfig(hit_copy="gather", routed_copy="copy_engine",
                                                                           routed_plan="device"), "cpu")
    cache.set_residency({layer: [0] for layer in store.layers})
    layer, K, E = store.layers[0], store.geometry.top_k, store.num_experts
    for bad, match in ((-1, "routed expert ids include -1"), (E, f"routed expert ids reach {E}")):
        ids = torch.zeros((2, K), dtype=torch.long)
        ids[1, 0] = bad
        with pytest.raises(ValueError, match=f"layer {layer}: {match}"):
            with cache.prefill_pass(routed_fills=True):
                cache.stage_rows(layer, ids)
    assert cache.stats()["total"]["bytes"].get("prefill_routed_h2d", 0) == 0  # nothing was copied


def test_entries_unavailable_names_why_a_device_plan_cannot_be_copied():
    from moe_offload.hit_copy import H2DRows

    cuda = torch.device("cuda", 0)
    assert H2DRows().entries_unavailable(1 << 20, cuda) == "batch_memcpy_unavailable"
    assert H2DRows(batch=object(), min_batch_row_bytes=1 << 21).entries_unavailable(1 << 20, cuda) == "small_rows"
    assert H2DRows(batch=object(), min_batch_row_bytes=1 << 20).entries_unavailable(1 << 20, cuda) is None
    assert H2DRows().entries_unavailable(8, torch.device("cpu")) is None
    with pytest.raises(RuntimeError, match="needs the batched call"):
        H2DRows().copy_entries(np.zeros(1, np.uint64), np.zeros(1, np.uint64), np.zeros(1, np.uint64), list, cuda)


def test_a_declined_device_plan_logs_once_counts_each_fill_and_stages_by_the_host_plan(tiny_ckpt, caplog):
    """A fault injected where the entries cannot be copied (as on a CUDA device without the batched call): every fill
    takes the host plan and stages the right rows; one routed_plan_declined event, one count per fill."""
    import logging

    from moe_offload import log

    store = ExpertStore.from_checkpoint(tiny_ckpt("tiny-qwen3-moe", "bf16"), progress=False)
    cache = OffloadMoeCache(store, CacheConfig(budget="1.0"), PrefillConfig(hit_copy="gather", routed_copy="copy_engine",
                                                                           routed_plan="device"), "cpu")
    cache.set_residency({layer: [0] for layer in store.layers})
    cache.staging.h2d.entries_unavailable = lambda row_bytes, device: "batch_memcpy_unavailable"
    K = store.geometry.top_k
    with caplog.at_level(logging.INFO, logger=log.LOGGER_NAME):
        with cache.prefill_pass(routed_fills=True):
            for layer in store.layers:
                ids = torch.arange(1, 1 + 2 * K).reshape(2, K) % store.num_experts
                views, index_N = cache.stage_rows(layer, ids)
                for e in ids.unique().tolist():
                    for name, view in views.items():
                        assert torch.equal(view[int(index_N[e])], store.views(layer)[name][e])
                cache.done(layer)
    events = [r for r in caplog.records if getattr(r, "event_fields", {}).get("event") == "routed_plan_declined"]
    assert len(events) <= 1  # once per process (an earlier test may have logged it already)
    assert cache.stats()["declined"]["routed_plan:batch_memcpy_unavailable"] == len(store.layers)


class _FailingBatch:
    """A batched-copy binding whose ``fail_at``-th call raises (a fault injected); records the entries it took."""

    def __init__(self, fail_at: int | None = None):
        self.calls, self.fail_at = [], fail_at

    def copy(self, dst, src, size, stream):
        from moe_offload.kernels.batch_memcpy import BatchMemcpyError

        self.calls.append(len(size))
        if len(self.calls) == self.fail_at:
            raise BatchMemcpyError("cudaMemcpyBatchAsync failed: cudaErrorInvalidValue (1)", code=1,
                                   name="cudaErrorInvalidValue")


@pytest.mark.parametrize("fail_at", [None, 1, 2])
def test_planned_entries_go_first_two_then_the_rest_and_a_failed_call_is_redone_by_rows(fail_at):
    """``H2DRows.copy_entries`` with a batched binding: the first ``FIRST_ENTRIES`` entries in a call of their own,
    the rest in a second; a call that fails (first or second) drops the binding and the fallback's row copies land
    every row (host tensors here, so the copies are real)."""
    from moe_offload.copy_paths import RowCopy
    from moe_offload.hit_copy import FIRST_ENTRIES, H2DRows

    src, dst = torch.arange(6 * 8, dtype=torch.uint8).view(6, 8), torch.zeros(6, 8, dtype=torch.uint8)
    rows = np.array([0, 2, 3, 5])
    batch = _FailingBatch(fail_at)
    h2d = H2DRows(batch, 0, None)
    failures = []
    h2d.on_batch_failure = failures.append
    n = np.zeros(5, dtype=np.uint64)
    h2d.copy_entries(n, n, n, lambda: [RowCopy(dst, src, rows, rows)], torch.device("cpu"))
    assert batch.calls == ([FIRST_ENTRIES, 5 - FIRST_ENTRIES] if fail_at in (None, 2) else [FIRST_ENTRIES])
    if fail_at is None:
        assert h2d.batch is batch and not failures and not dst.any()  # the fake moved nothing: no fallback ran
    else:
        assert h2d.batch is None and len(failures) == 1
        assert torch.equal(dst[rows], src[rows]) and not dst[[1, 4]].any()


def test_the_start_up_check_catches_a_program_that_plans_wrong(monkeypatch):
    """``check_program`` (run by a CUDA cache before it takes the device plan) against a fault injected into the
    plan: one word off is named; the plain-torch plan passes it."""
    assert routed_plan.check_program(torch.device("cpu"), 128) is None
    assert routed_plan.check_program(torch.device("cpu"), 8) is None
    right = routed_plan.plan_routed_fill

    def off_by_one(ids_N, table_E, plan_P, *args, **kw):
        right(ids_N, table_E, plan_P, *args, **kw)
        plan_P[HEADER + 2 * table_E.shape[0]] += 1  # the first run's size

    monkeypatch.setattr(routed_plan, "plan_routed_fill", off_by_one)
    assert "differ from the reference" in routed_plan.check_program(torch.device("cpu"), 128)


def test_a_cache_whose_check_failed_stages_by_the_host_plan_and_counts_each_fill(tiny_ckpt):
    """What ``RoutedPlanBuffers.make`` returns when the check fails on a GPU (set here: a fault injected): every fill
    takes the host plan, stages the right rows, and counts ``routed_plan:check_failed``."""
    store = ExpertStore.from_checkpoint(tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt"), progress=False)
    cache = OffloadMoeCache(store, CacheConfig(budget="1.0"), PrefillConfig(hit_copy="gather", routed_copy="copy_engine",
                                                                           routed_plan="device"), "cpu")
    cache.set_residency({layer: [0, 3] for layer in store.layers})
    cache.staging.plan, cache.staging.plan_declined = None, "check_failed"
    assert cache.staging.plan_in_effect() == "host"
    K = store.geometry.top_k
    with cache.prefill_pass(routed_fills=True):
        for layer in store.layers:
            ids = (torch.arange(2 * K).reshape(2, K) * 3) % store.num_experts
            views, index_N = cache.stage_rows(layer, ids)
            for e in ids.unique().tolist():
                for name, view in views.items():
                    assert torch.equal(view[int(index_N[e])], store.views(layer)[name][e])
            cache.done(layer)
    assert cache.stats()["declined"]["routed_plan:check_failed"] == len(store.layers)


def test_a_plan_that_counts_bad_ids_the_ids_do_not_hold_is_an_error_not_a_silent_copy(tiny_ckpt, monkeypatch):
    """A fault injected into the plan (a bad-id count with every id inside the layer): the fill raises, naming the
    layer and the setting that avoids the program, instead of copying by a plan it cannot trust."""
    store = ExpertStore.from_checkpoint(tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt"), progress=False)
    cache = OffloadMoeCache(store, CacheConfig(budget="1.0"), PrefillConfig(hit_copy="gather", routed_copy="copy_engine",
                                                                           routed_plan="device"), "cpu")
    cache.set_residency({layer: [0] for layer in store.layers})
    right = routed_plan.plan_routed_fill

    def miscounts(ids_N, table_E, plan_P, *args, **kw):
        right(ids_N, table_E, plan_P, *args, **kw)
        plan_P[3] = 1

    monkeypatch.setattr(routed_plan, "plan_routed_fill", miscounts)
    layer, K = store.layers[0], store.geometry.top_k
    with pytest.raises(RuntimeError, match=f"layer {layer}: the routed plan counted 1 ids outside the layer.*"
                                           "prefill.routed_plan=host"):
        with cache.prefill_pass(routed_fills=True):
            cache.stage_rows(layer, torch.ones((2, K), dtype=torch.long))


def test_a_program_that_cannot_run_on_the_device_declines_the_device_plan_at_start_up(monkeypatch):
    """``RoutedPlanBuffers.make`` on CUDA runs the start-up check; a check that raises (a fault injected: as a program
    that does not compile for the GPU) declines the device plan instead of failing the cache."""
    from moe_offload.fill_plan import RoutedPlanBuffers

    def broken(device, E, N=200):
        raise RuntimeError("PTX .version 8.7 does not support .target sm_120 (injected)")

    monkeypatch.setattr(routed_plan, "check_program", broken)
    assert RoutedPlanBuffers.make(8, torch.device("cuda", 0)) == (None, "check_failed")
