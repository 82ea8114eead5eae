"""``compute.pdl_max_tokens`` (kernels/pdl.py): programmatic dependent launch for the decode step's Triton kernels.

On CPU it never takes effect (a CUDA launch attribute); a CUDA device that cannot use it declines it (one event, a
count per forward that asked for it).
What can be checked without a GPU is the contract each kernel keeps: every kernel a decode-path forward launches
takes ``USE_PDL`` and starts with ``pdl_enter``, and compiled for sm_90 its wait comes before any memory access.
The launches themselves are tested on CUDA (tests/gpu/test_decode_gpu.py: the same bits with and without it,
eager and replayed).
"""

import ast
import importlib
import inspect
import logging
import re
import textwrap

import pytest
import torch

from moe_offload import log
from moe_offload.config import load_config
from moe_offload.engine import Engine
from moe_offload.kernels import pdl

#: the kernels/ modules a decode-path forward launches kernels from (their every ``*_kernel`` takes USE_PDL)
DECODE_MODULES = ["decode_attention", "decode_gemv", "decode_miss", "decode_moe", "decode_route", "fused_moe",
                  "fused_moe_ab", "fused_moe_swap", "kv_write", "moe_align", "moe_sum", "qk_norm_rope", "rmsnorm", "rotary", "router"]


def test_launches_turn_the_keyword_arguments_on_only_inside():
    assert pdl.launch_kwargs() == {}
    with pdl.launches(True):
        assert pdl.launch_kwargs() == {"USE_PDL": True, "launch_pdl": True}
        with pdl.launches(False):
            assert pdl.launch_kwargs() == {}
        assert pdl.launch_kwargs() == {"USE_PDL": True, "launch_pdl": True}
    assert pdl.launch_kwargs() == {}
    with pytest.raises(RuntimeError), pdl.launches(True):
        raise RuntimeError("a failed forward")
    assert pdl.launch_kwargs() == {}  # reset on the way out of an exception too


def test_the_cpu_is_named_as_the_reason():
    assert "CUDA" in pdl.unsupported(torch.device("cpu"))


@pytest.mark.parametrize("name", DECODE_MODULES)
def test_every_decode_kernel_takes_use_pdl_and_waits_first(name):
    mod = importlib.import_module(f"moe_offload.kernels.{name}")
    # a JITFunction, or the interpreter's stand-in under TRITON_INTERPRET=1
    kernels = {n: f for n, f in vars(mod).items() if n.endswith("_kernel") and hasattr(f, "arg_names")}
    assert kernels, name
    for n, fn in kernels.items():
        assert fn.arg_names[-1] == "USE_PDL", f"{name}.{n} does not take USE_PDL last"
        body = ast.parse(textwrap.dedent(inspect.getsource(fn.fn))).body[0].body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        assert ast.unparse(body[0]) == "pdl_enter(USE_PDL)", f"{name}.{n} starts with {ast.unparse(body[0])!r}"
    # and every launch of them passes the switch
    src = inspect.getsource(mod)
    for n in kernels:
        for call in re.finditer(rf"\b{n}\[", src):
            end = src.find("\n\n", call.start())
            assert "**pdl.launch_kwargs()" in src[call.start():end if end > 0 else None], f"a launch of {n}"


_COMPILE_SM90 = r'''
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moe_offload.kernels.moe_sum import _sum_pairs_kernel as fn

names = fn.arg_names
sig = {n: "constexpr" if n in ("RESIDUAL", "BLOCK", "USE_PDL") else ("*bf16" if n.endswith("_ptr") else "i32")
       for n in names}
out = {}
for on in (True, False):
    consts = {"RESIDUAL": True, "BLOCK": 1024, "USE_PDL": on}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"launch_pdl": on}).asm["ptx"]
    body = ptx[ptx.index(".entry"):]
    find = lambda pat: (m.start() if (m := re.search(pat, body)) else -1)
    out[str(on)] = [find(r"griddepcontrol\.wait"), find(r"griddepcontrol\.launch_dependents"),
                    find(r"\b(ld|st|atom|red)\.global")]
print(json.dumps(out))
'''


def test_compiled_for_sm90_the_wait_comes_before_every_memory_access(compiled_without_interpreter):
    import json

    got = json.loads(compiled_without_interpreter(_COMPILE_SM90))
    wait, launch, first_mem = got["True"]
    assert 0 <= wait < launch < first_mem, got
    assert got["False"][:2] == [-1, -1] and got["False"][2] >= 0, got  # without it: no griddepcontrol at all


def _engine(path, *extra):
    cfg = load_config(None, [f"model.checkpoint={path}", "model.format=auto", "logging.level=WARNING", *extra])
    return Engine.from_config(cfg, progress=False)


def test_on_a_cpu_it_is_off_and_the_tokens_are_those_without_it(tiny_ckpt, caplog):
    path = tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt")
    prompt = list(range(10, 30))
    want = _engine(path, "cache.budget=0.37", "compute.pdl_max_tokens=0").generate(prompt, 8).token_ids
    with caplog.at_level(logging.INFO, logger=log.LOGGER_NAME):
        eng = _engine(path, "cache.budget=0.37", "compute.pdl_max_tokens=64")
        assert eng.pdl is False
        assert eng.generate(prompt, 8).token_ids == want
    assert not [r for r in caplog.records if getattr(r, "event_fields", {}).get("event") == "pdl_declined"]
    assert "pdl:unsupported" not in eng.cache.stats()["declined"]


def test_decode_steps_enter_it_and_prompts_on_the_routed_path_launch_plainly(tiny_ckpt, monkeypatch):
    """Which forwards ask for PDL (``Engine.run_model``): decode steps, one new token a sequence; never a prompt,
    routed ones included (at bb13400 routed prompts gained nothing with it and 64-token ones lost 3-6 %). A spy
    on the real methods records each forward's tokens, sequences and path, and each ``pdl_launches`` call."""
    eng = _engine(tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt"), "cache.budget=0.37", "prefill.routed_max_tokens=64",
                  "decode.max_tokens=64")
    forwards, asked = [], []
    begin, launches = eng.cache.begin_forward, Engine.pdl_launches
    def spy(tokens, sequences):
        forwards.append((tokens, sequences, routed := begin(tokens, sequences)))
        return routed

    monkeypatch.setattr(eng.cache, "begin_forward", spy)
    monkeypatch.setattr(Engine, "pdl_launches", lambda self, tokens: asked.append(tokens) or launches(self, tokens))
    eng.generate(list(range(10, 30)), 4)
    eng.generate_batch([list(range(5, 17)), list(range(40, 52))], 3)
    assert (20, 1, True) in forwards and (24, 2, True) in forwards  # both prompts took the routed path
    assert asked and asked == [t for t, s, routed in forwards if routed and t == s]
    assert set(asked) == {1, 2}


def test_a_cuda_device_that_cannot_declines_it_once_and_counts_each_forward_that_asked(monkeypatch, caplog):
    """Fault injection: a CUDA device whose check fails (an sm_80 GPU, or a Triton without ``launch_pdl``) on a
    stand-in engine (no GPU here); the launches stay plain."""
    from collections import Counter
    from types import SimpleNamespace

    from moe_offload.config import OffloadConfig

    monkeypatch.setattr(pdl, "unsupported", lambda device: "PDL needs compute capability 9.0 (Hopper) or later")
    eng = SimpleNamespace(cfg=OffloadConfig(), device=torch.device("cuda", 0),
                          cache=SimpleNamespace(counters=SimpleNamespace(declined=Counter())))
    with caplog.at_level(logging.INFO, logger=log.LOGGER_NAME):
        eng.pdl = Engine._pdl_usable(eng)
    assert eng.pdl is False
    events = [r.event_fields for r in caplog.records if getattr(r, "event_fields", {}).get("event") == "pdl_declined"]
    assert len(events) == 1 and events[0]["setting"] == "compute.pdl_max_tokens" and "9.0" in events[0]["reason"]
    for tokens in (1, 64, 65):  # the default asks for it up to 64 tokens
        with Engine.pdl_launches(eng, tokens):
            assert pdl.launch_kwargs() == {}
    assert eng.cache.counters.declined == {"pdl:unsupported": 2}
