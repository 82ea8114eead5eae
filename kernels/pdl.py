"""Programmatic dependent launch (PDL) for the decode step's Triton kernels (``compute.pdl_max_tokens``; sm_90+).

A captured decode step is ~15 short kernels a layer, and between two of them the GPU idles while the next one is
launched and its blocks are scheduled (at bb13400 on an H100: ~0.5 us a boundary, ~4 % of a batch-16 step's kernel
time; 0.25-0.3 us with PDL, the rest at torch's GEMMs; ``benchmarks/profile_decode.py``, README).
With PDL a kernel may be launched while the one before it on the stream still runs, so its launch and scheduling
overlap that kernel's tail. The contract that keeps results exact: every kernel launched with PDL calls
:func:`pdl_enter` first, which waits until the kernel before it has completed and its writes are visible
(``griddepcontrol.wait``: before it returns, the kernel reads and writes nothing), then lets the kernel after it be
launched (``griddepcontrol.launch_dependents``). A kernel before it that is not launched with PDL (torch's GEMMs and
copies) simply completes first, as without PDL; a kernel after it that is not launched with PDL waits for it to
complete, as always. In a CUDA graph the launch attribute becomes a programmatic edge, so replays keep it.

Which launches use it: the ones made inside :func:`launches` with ``True``. The engine enters it for decode steps
(one new token a sequence, eager or captured as a step's graph) of at most ``compute.pdl_max_tokens`` sequences
where :func:`unsupported` finds nothing against it (``Engine.pdl_launches``); prompts launch plainly. Measured on
H100s (benchmarks/results/HISTORY.md "3e491a3 / 3bf4dd6" and "bb13400 / 3ce9df3"): batch 1 gains 4.7 %, batch 16 / 64
are level or slightly ahead in an ABBA order (their earlier losses were single pairs within the noise); routed prompts
of 16-256 tokens were level with it and 64-token ones fully resident 3-6 % slower, hence decode steps only, up to 64
sequences.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

_ON: contextvars.ContextVar[bool] = contextvars.ContextVar("moe_offload_pdl", default=False)


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """The first statement of every kernel that takes ``USE_PDL``: with it, wait for the kernel before this one on
    the stream, then let the one after be launched; without it, nothing."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


def launch_kwargs() -> dict:
    """Keyword arguments for a Triton launch of a kernel that takes ``USE_PDL``: PDL inside ``launches(True)``,
    nothing otherwise (the kernel's default, ``USE_PDL=False``, compiles the wait out)."""
    return {"USE_PDL": True, "launch_pdl": True} if _ON.get() else {}


@contextlib.contextmanager
def launches(on: bool):
    """Triton launches made inside use PDL when ``on`` (this thread's context only)."""
    token = _ON.set(bool(on))
    try:
        yield
    finally:
        _ON.reset(token)


@functools.lru_cache(maxsize=1)
def _triton_has_launch_pdl() -> bool:
    from triton.backends.nvidia.compiler import CUDAOptions

    return "launch_pdl" in CUDAOptions.__dataclass_fields__


def unsupported(device: torch.device) -> str | None:
    """Why PDL cannot run on ``device`` (a sentence), or None where it can."""
    if device.type != "cuda":
        return f"PDL is a CUDA launch attribute; the device is {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        name = torch.cuda.get_device_name(device)
        return f"PDL needs compute capability 9.0 (Hopper) or later; {name} is {major}.{minor}"
    if not _triton_has_launch_pdl():
        return f"this Triton ({triton.__version__}) has no launch_pdl option"
    return None
