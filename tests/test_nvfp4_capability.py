"""An NVFP4 checkpoint on a CUDA GPU the NVFP4 Triton kernels do not compile for (an A100: Triton loads E4M3 scales
as fp8e4nv only from sm_89) runs the format's torch dequantization + grouped_mm, says so once, and counts each call;
``compute.backend: triton`` is refused by name. The GPU's capability is injected (this machine has no GPU); the
fallback compute then runs for real on CPU tensors against the reference MoE."""

import logging
import os
from types import SimpleNamespace

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from moe_offload import log  # noqa: E402
from moe_offload.compute import AutoNvfp4Compute, DequantGroupedCompute, make_compute  # noqa: E402
from moe_offload.compute.decode import DecodeCompute  # noqa: E402
from moe_offload.config import OffloadConfig  # noqa: E402
from moe_offload.formats.nvfp4 import Nvfp4ModelOptFormat  # noqa: E402
from moe_offload.kernels import nvfp4 as kernels_nvfp4  # noqa: E402
from moe_offload.kernels.fused_moe import moe_reference  # noqa: E402
from moe_offload.stats import CacheStats  # noqa: E402
from test_decode_moe import make_pool, routing  # noqa: E402

FMT = Nvfp4ModelOptFormat()
GPU = torch.device("cuda", 0)  # never touched: only its capability is asked, and that is injected
H, I, E, K, T = 64, 32, 6, 2, 5


def _store():
    return SimpleNamespace(geometry=SimpleNamespace(hidden=H), inter=I)


@pytest.fixture
def sm80(monkeypatch):
    monkeypatch.setattr(kernels_nvfp4, "_capability", lambda index: (8, 0))
    log.reset_once_keys()


def test_an_a100_gets_the_torch_dequant_with_one_event_and_a_count_per_call(sm80, caplog):
    with caplog.at_level(logging.WARNING, logger=log.LOGGER_NAME):
        compute = make_compute(OffloadConfig(), FMT, _store(), GPU, torch.float32)
        decode = DecodeCompute(FMT, compute, GPU, fused=True)
    assert isinstance(compute, DequantGroupedCompute) and not compute._triton
    assert not decode.fused and decode.name == "torch+row_gather"
    events = [r.event_fields for r in caplog.records if r.getMessage() == "nvfp4_kernels_unavailable"]
    assert len(events) == 1 and "8.9" in events[0]["reason"] and "8.0" in events[0]["reason"]
    assert events[0]["fallback"] == "torch dequantize + grouped_mm"

    stats = CacheStats()
    compute.bind(stats)
    _, views = make_pool(E, H, I)
    gen = torch.Generator().manual_seed(1)
    rows, weights = routing(T, K, E, "random", gen)
    hidden = torch.randn(T, H, generator=gen)
    for _ in range(2):
        out = compute(hidden, rows, weights, views, E)
    torch.testing.assert_close(out, moe_reference(hidden, rows, weights, *FMT.dequantize(views, torch.float32)),
                               rtol=1e-5, atol=1e-5)
    assert stats.snapshot()["declined"] == {"nvfp4_kernels:capability": 2}


def test_backend_triton_on_an_a100_is_refused_naming_the_capability_and_the_fix(sm80):
    cfg = OffloadConfig.model_validate({"compute": {"backend": "triton"}})
    with pytest.raises(RuntimeError, match=r"capability 8\.9.*8\.0.*compute.backend to auto or torch"):
        make_compute(cfg, FMT, _store(), GPU, torch.bfloat16)


def test_a_hopper_gpu_keeps_the_kernels_and_logs_nothing(monkeypatch, caplog):
    monkeypatch.setattr(kernels_nvfp4, "_capability", lambda index: (9, 0))
    log.reset_once_keys()
    with caplog.at_level(logging.WARNING, logger=log.LOGGER_NAME):
        compute = make_compute(OffloadConfig(), FMT, _store(), GPU, torch.bfloat16)
    assert isinstance(compute, AutoNvfp4Compute)
    assert not [r for r in caplog.records if r.getMessage() == "nvfp4_kernels_unavailable"]


def test_probe_reports_whether_the_nvfp4_kernels_run_on_the_gpu(monkeypatch):
    """``moe-offload probe``'s ``nvfp4`` entry (``nvfp4_kernel_report``): an A100 falls back (and why), an H100 runs
    the kernels with the PTX weight conversion and the in-launch sum over K, which a Triton before 3.5 declines."""
    from moe_offload.kernels.nvfp4 import nvfp4_kernel_report

    monkeypatch.setattr(kernels_nvfp4, "_capability", lambda index: (8, 0))
    a100 = nvfp4_kernel_report(GPU)
    assert a100["capability"] == "8.0" and not a100["kernels"] and not a100["ptx_weight_conversion"]
    assert a100["fallback"] == "torch dequantize + grouped_mm" and "fp8e4nv" in a100["reason"]
    monkeypatch.setattr(kernels_nvfp4, "_capability", lambda index: (9, 0))
    assert nvfp4_kernel_report(GPU) == {"capability": "9.0", "kernels": True, "fallback": None, "reason": None,
                                        "ptx_weight_conversion": True, "down_sums_over_k": True,
                                        "down_sums_over_k_reason": None}
    import triton

    monkeypatch.setattr(triton, "__version__", "3.4.0")  # tensor atomics' results reach one thread per value there
    old = nvfp4_kernel_report(GPU)
    assert not old["down_sums_over_k"] and ">= 3.5" in old["down_sums_over_k_reason"]
