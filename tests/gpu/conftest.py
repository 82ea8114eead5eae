"""GPU tests: device memory that an earlier test leaves held is reported by test name.

At c7b7054 on an H200, ``tests/gpu/test_faults_gpu.py`` run after the prefill-graph and router tests in one process
found the device full (139.8 of 139.8 GiB in use, 3.9 GiB of it allocated by PyTorch) before its first test, and 18 of
its tests failed with out-of-memory errors that say nothing of where the memory went. After each test this fixture
collects garbage, empties torch's cache and reads the device's memory in use (``mem_get_info``: every process on
the device, which on the lent machine is this one); a test after which more than ``LEAK_REPORT_BYTES`` is held
above the session's start is listed at the end of the run, with PyTorch's allocated and reserved bytes."""

from __future__ import annotations

import gc

import pytest
import torch

LEAK_REPORT_BYTES = 2 << 30
_held: list[tuple[str, int, int, int]] = []  # (test, device bytes in use above the start, allocated, reserved)
_start: list[int] = []


def _in_use() -> int:
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return total - free


@pytest.fixture(autouse=True)
def _device_memory_held_after(request):
    yield
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    used = _in_use()
    if not _start:
        _start.append(used)  # the first test's context and module state are the baseline
        return
    if used - _start[0] > LEAK_REPORT_BYTES:
        _held.append((request.node.nodeid, used - _start[0], torch.cuda.memory_allocated(),
                      torch.cuda.memory_reserved()))


def pytest_terminal_summary(terminalreporter):
    if not _held:
        return
    terminalreporter.section("device memory held after GPU tests (above the first test's, > 2 GiB)")
    gib = 1 << 30
    for nodeid, above, allocated, reserved in _held:
        terminalreporter.write_line(f"{above / gib:7.2f} GiB held (torch allocated {allocated / gib:.2f}, reserved "
                                    f"{reserved / gib:.2f}) after {nodeid}")
