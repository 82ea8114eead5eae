"""Shared fixtures: tiny synthetic checkpoints (built once per session) and the gpu marker."""

from __future__ import annotations

import io
import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors through the interpreter in CI (set before triton is imported).
    os.environ.setdefault("TRITON_INTERPRET", "1")

FAMILY_PRESETS = ("tiny-qwen3-moe", "tiny-qwen3-next", "tiny-mixtral")
FORMATS = ("bf16", "nvfp4-modelopt", "nvfp4-ct")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def events():
    """Structured WARNING+ events logged during the test, parsed (``events()``)."""
    from moe_offload import log

    buf = io.StringIO()
    log.configure(level="WARNING", fmt="json", stream=buf)
    yield lambda: [json.loads(x) for x in buf.getvalue().splitlines() if x.startswith("{")]
    log.configure(level="WARNING")


@pytest.fixture
def compiled_without_interpreter():
    """``run(script)`` -> the last stdout line of ``script`` run in a fresh Python without TRITON_INTERPRET, so
    Triton compiles for real (e.g. for sm_90 through ``ASTSource``, no GPU needed); skips without Triton's
    NVIDIA backend. The interpreter runs kernels as Python and accepts code the compiler refuses."""
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}

    def run(script: str) -> str:
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout.strip().splitlines()[-1]

    return run


@pytest.fixture(scope="session")
def qwen3_layer_store():
    """``qwen3_layer_store(pin)`` -> an ExpertStore of one MoE layer of Qwen3-30B-A3B NVFP4 rows (128 x 2.65 MB;
    their bytes are whatever the allocation holds: the link-rate tests need real sizes, not real weights)."""
    from moe_offload.host_store import ExpertStore

    def make(pin: bool) -> ExpertStore:
        return ExpertStore.for_preset("qwen3-30b-a3b", 1, pin=pin)

    return make


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """``tiny_ckpt(preset, fmt)`` -> path of a synthetic checkpoint (built once per session)."""
    from moe_offload.checkpoint.synthetic import make_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    built: dict[tuple[str, str], str] = {}

    def get(preset: str, fmt: str) -> str:
        key = (preset, fmt)
        if key not in built:
            out = root / f"{preset}-{fmt}"
            make_checkpoint(preset, fmt, out, progress=False)
            built[key] = str(out)
        return built[key]

    return get


@pytest.fixture
def bf16_serve_bench(tiny_ckpt, capsys):
    """``bf16_serve_bench(device)`` -> (exit code, JSON result) of ``bench serve`` on the tiny model in bf16:
    1 / 4 / 16 clients, prompts of 64 and 256 tokens, 48 tokens each (tests/test_serve_consistency.py and its
    GPU twin)."""
    import json

    from moe_offload.cli import main

    def run(device: str) -> tuple[int, dict]:
        ckpt = tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt")
        rc = main(["bench", "serve", "--set", f"model.checkpoint={ckpt}", "--set", "model.format=auto",
                   "--set", f"device={device}", "--set", "dtype=bfloat16", "--set", "logging.level=WARNING",
                   "--clients", "1,4,16", "--requests-per-client", "2,2,1", "--prompt-lens", "64,256",
                   "--max-tokens", "48", "--json"])
        return rc, json.loads(capsys.readouterr().out)

    return run


@pytest.fixture(autouse=True)
def _fresh_log_once():
    from moe_offload import log

    log.reset_once_keys()
    yield


# ------------------------------------------------------------------ device memory held after GPU tests
# At c7b7054 on an H200, tests/gpu/test_faults_gpu.py run after the prefill-graph and router tests in one process found
# the device full (139.8 of 139.8 GiB in use, 3.9 GiB of it allocated by PyTorch) before its first test, and 18 of its
# tests failed with out-of-memory errors that say nothing of where the memory went. After each GPU test the hooks
# below collect garbage, empty torch's cache and read the device's memory in use (``mem_get_info``: every process on
# the device, which on the lent machine is this one); a test after which more than _LEAK_REPORT_BYTES is held above
# the first GPU test's level is listed at the end of the run, with PyTorch's allocated and reserved bytes. (A
# tests/gpu/conftest.py would shadow this module for the tests that import names from it.)
_LEAK_REPORT_BYTES = 2 << 30
_gpu_memory_held: list[tuple[str, int, int, int, int]] = []  # (test, bytes above the first's level, allocated,
# reserved, reserved in private pools)
_gpu_memory_start: list[int] = []
# At e31192f on an H100 the same sequence left 78 GiB reserved but unallocated after the faults module's first
# device-memory hog (torch allocated 0.28 GiB, reserved 78.3), which empty_cache did not release and later
# allocations could not use; run alone the module holds nothing. Blocks of a CUDA graph's private memory pool behave
# that way while the pool lives, so each report also gives the bytes reserved in private pools, and tests after which
# private pools grew by more than _POOL_REPORT_BYTES are listed with the stream-capture state.
_POOL_REPORT_BYTES = 256 << 20
_private_pools: list[int] = [0]
_pool_growth: list[tuple[str, int, bool]] = []  # (test, private-pool bytes added, current stream still capturing)


def assert_allocator_releases(nbytes: int = 256 << 20) -> None:
    """torch's caching allocator still returns freed memory to the device (a failed CUDA graph capture left
    unended keeps it from doing so: moe_offload/graph_capture.py): ``nbytes`` allocated, freed, and released by
    ``empty_cache``."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    block = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    del block
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() <= before, "empty_cache released nothing: a capture still counts as underway"


def _private_pool_bytes() -> int:
    """Bytes reserved in private memory pools (CUDA graphs' pools): segments whose pool id is not the default."""
    return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
               if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0))


def _generator_left_capturing() -> bool:
    """The default CUDA generator still in capture mode outside a capture (a failed capture that was not ended:
    moe_offload/graph_capture.py): a random op raises. Draws one number when it is not."""
    try:
        torch.empty(1, device="cuda").uniform_()
    except RuntimeError as e:
        if "outside graph capture" in str(e):
            return True
        raise
    return False


@pytest.hookimpl(trylast=True)  # after the runner's own teardown: the test's fixtures are gone by then
def pytest_runtest_teardown(item, nextitem):
    if "gpu" not in item.keywords or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    import gc

    # What a failed capture can leave (moe_offload/graph_capture.py), repaired here so the tests after it run as they
    # would alone, and reported as the failure of the test that left it (at its teardown):
    # - a side stream current (torch.cuda.graph leaves it when capture_end raises; found at a21f336 on an H100);
    # - the default generator in capture mode (at 47c82c8 on an H100 39 later GPU tests failed at their first
    #   random op).
    left = []
    if torch.cuda.current_stream() != torch.cuda.default_stream():
        torch.cuda.set_stream(torch.cuda.default_stream())
        left.append("a side stream current (a failed capture not made with moe_offload.graph_capture.capture)")
    if not torch.cuda.is_current_stream_capturing() and _generator_left_capturing():
        from moe_offload.graph_capture import end_generator_capture

        end_generator_capture(torch.cuda.current_device())
        left.append("the default CUDA generator in capture mode (a failed capture that was not ended with "
                    "moe_offload.graph_capture.end_failed_capture)")
    if left:
        pytest.fail(f"{item.nodeid} left " + " and ".join(left), pytrace=False)

    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    used = total - free
    private = _private_pool_bytes()
    if private - _private_pools[0] > _POOL_REPORT_BYTES:
        _pool_growth.append((item.nodeid, private - _private_pools[0], torch.cuda.is_current_stream_capturing()))
    _private_pools[0] = private
    if not _gpu_memory_start:
        _gpu_memory_start.append(used)  # the first GPU test's context and module state are the baseline
    elif used - _gpu_memory_start[0] > _LEAK_REPORT_BYTES:
        _gpu_memory_held.append((item.nodeid, used - _gpu_memory_start[0], torch.cuda.memory_allocated(),
                                 torch.cuda.memory_reserved(), private))


def pytest_terminal_summary(terminalreporter):
    gib = 1 << 30
    if _pool_growth:
        terminalreporter.section("private memory pools (CUDA graphs) grown by > 256 MiB after GPU tests")
        for nodeid, added, capturing in _pool_growth:
            terminalreporter.write_line(f"{added / gib:7.2f} GiB more in private pools (current stream capturing: "
                                        f"{capturing}) after {nodeid}")
    if not _gpu_memory_held:
        return
    terminalreporter.section("device memory held after GPU tests (above the first GPU test's level, > 2 GiB)")
    for nodeid, above, allocated, reserved, private in _gpu_memory_held:
        terminalreporter.write_line(f"{above / gib:7.2f} GiB held (torch allocated {allocated / gib:.2f}, reserved "
                                    f"{reserved / gib:.2f}, of it in private pools {private / gib:.2f}) after {nodeid}")
