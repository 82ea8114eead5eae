"""The one source of knobs: a typed config tree (pydantic v2) loaded from YAML plus ``--set a.b=c``.

Unknown keys and out-of-range values are errors that name the key, the bad value and what is
accepted. No environment variable changes behaviour.

This module owns the tree (the section models and their validators). Reading one (the YAML, the overrides, the
error text) and writing one out as a plain dict is config_load.py's; how byte sizes and the cache budget are
written is config_values.py's. Their public names stay importable from here.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from moe_offload.config_values import Budget, parse_bytes
from moe_offload.presets import PRESET_NAMES

PRESETS = PRESET_NAMES
#: largest token count of a forward on the routed-only path (decode_path.py): its routing record and
#: the kernels' single-program loops (kernels/decode_miss.py's plan, kernels/moe_align.py decode_align) hold
#: T*K pairs at once, and K <= 256 keeps T*K within Triton's 2**20-element tensor limit
ROUTED_MAX_TOKENS_LIMIT = 4096
FORMATS = ("bf16", "nvfp4-modelopt", "nvfp4-ct")


class ConfigError(ValueError):
    """A config value or key is wrong; the message names the key and the fix."""


#: seeds of the CLI and the config: torch.manual_seed takes -2^63 .. 2^64 - 1 (others fail with "Overflow when
#: unpacking long long", which names nothing) and numpy's generators (the benches' resident sets) none below 0
SEED_MIN, SEED_MAX = 0, (1 << 64) - 1


def seed_arg(text: str) -> int:
    """argparse type of every ``--seed``: an integer in [``SEED_MIN``, ``SEED_MAX``]."""
    import argparse

    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not SEED_MIN <= v <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"must be in [{SEED_MIN}, {SEED_MAX}] (a 64-bit seed), got {text}")
    return v


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Strict):
    checkpoint: str | None = Field(None, description="HF checkpoint dir; null builds `preset` on first use")
    preset: Literal[PRESETS] = "tiny-qwen3-moe"  # type: ignore[valid-type]
    format: Literal["auto", "bf16", "nvfp4-modelopt", "nvfp4-ct"] = "auto"
    layers: int | None = Field(None, ge=1, description="truncate a preset to this many layers")
    seed: int = Field(0, ge=SEED_MIN, le=SEED_MAX)
    cache_dir: str | None = Field(None, description="where presets are built; default ~/.cache/moe-offload")

    @field_validator("checkpoint", "cache_dir")
    @classmethod
    def _not_blank(cls, v: str | None) -> str | None:
        # an unset shell variable (--checkpoint "$DIR") must not silently mean "build the preset" or "here"
        if v is not None and not v.strip():
            raise ValueError("an empty path; give a directory, or null (leave it out) for the default")
        return v


class CacheConfig(_Strict):
    budget: Budget = Budget(kind="fraction", value=0.5)
    policy: Literal["balanced", "lru"] = Field(
        "balanced", description="which slot a new expert takes. balanced: each MoE layer owns an equal share of the "
        "slots (S // L, the first S % L layers one more) and evicts its own least recently used expert; lru: one "
        "least-recently-used order over every layer. Prefill copies a layer's misses behind the layer before it, so a "
        "layer with no residents is PCIe-bound while a fully resident one has nothing to hide: residents spread "
        "evenly give the fastest prefill at a given budget (moe_offload/slot_pool.py)")
    auto_reserve: str = "8GiB"
    admit_per_step: int = Field(512, ge=0, le=65536, description="experts missed by a decode step that enter "
                                "slots before the next step (copied between steps; 0 = never admit in decode). "
                                "The first decode steps after a prefill miss the experts decode routes to but the "
                                "prompt did not: 512 admits them within a step or two, where 64 took ~17 steps "
                                "(benchmarks/results/HISTORY.md 'a21f336 on an H100': batch 4 at residency "
                                "0.37, 423 against 278 tok/s)")
    admit_filter: Literal["none", "frequency"] = Field(
        "none", description="which missed experts a decode boundary admits (up to admit_per_step). none: every "
        "one. frequency: one routed at least as often (decayed counts) as the resident it would evict, or any where "
        "its layer may take a free slot; one missed once in a while is read from host memory and evicts nothing. "
        "none by an ABBA on an H100 at 4c209c0 (residency 0.37): frequency was 0.7-1.0 % slower at batch 1 / 4 "
        "and level at 16 / 64 (hits +0.9 points at batch 16), though on the routing model of "
        "benchmarks/boundary_host.py it raised the hit rate far more (README Decisions)")

    @field_validator("budget", mode="before")
    @classmethod
    def _parse_budget(cls, v: Any) -> Budget:
        return Budget.parse(v)

    @field_validator("auto_reserve")
    @classmethod
    def _check_reserve(cls, v: str) -> str:
        parse_bytes(v)
        return v


class PrefillConfig(_Strict):
    overlap: bool = True
    hit_copy: Literal["off", "auto", "batch_memcpy", "gather"] = Field(
        "auto", description="how prefill hits (resident experts) reach staging: off = the whole layer over PCIe; "
        "auto = per GPU and row size from measurements (moe_offload/hit_copy_table.json)")
    hit_copy_on_unavailable: Literal["fallback", "error"] = "fallback"
    warmup: bool = True
    warmup_tokens: int = Field(128, ge=1, le=65536)
    chunk_tokens: int = Field(8192, ge=16, description="prompts longer than this are prefilled in chunks")
    read_in_place: bool = Field(True, description="a layer whose experts are all resident is read from its slots "
                                "(no copy into staging); needs a device hit path (hit_copy not off)")
    dequant_chunk_bytes: str = Field("2GiB", description="dequantized weights held at once by the torch compute path")
    dequant_chunk_experts: int | None = Field(None, ge=1, le=65536, description="fixed chunk in experts (overrides the bytes)")
    routed_max_tokens: Literal["auto"] | int = Field(
        "auto", description="forwards of at most this many tokens (and never fewer than decode.max_tokens unless "
        "decode.path resolves to auto, as host does where prefill.measure_link measured the link) read only "
        "their routed experts (resident ones in place, missing ones over PCIe by SMs) instead of staging the whole "
        "layer; auto = the largest T for which the cost model of moe_offload/prefill_path_table.json predicts that "
        f"this pays (on CUDA; decode.max_tokens on a CPU); an integer in [0, {ROUTED_MAX_TOKENS_LIMIT}] fixes it")
    measure_link: bool = Field(True, description="with routed_max_tokens auto on CUDA: the cache times this host's "
                               "copy-engine copy and the decode path's SM reads of mapped host memory on 8 and 32 "
                               "experts of the pinned store at start-up (the slope between them; tens of ms; stores "
                               "too small to time keep the table's rates) and the cost model decides with those two "
                               "rates instead of the table's (moe_offload/link_rates.py): the SM-read rate depends on "
                               "the host (46-47 vs 25.7 GB/s on two H100 hosts, benchmarks/results/HISTORY.md); "
                               "false = the table's rates")
    routed_copy: Literal["uva", "copy_engine", "auto"] = Field(
        "auto", description="how a prefill that reads only its routed experts gets the missing ones: uva = SMs read "
        "them from mapped host memory inside the graph (no host sync); copy_engine = a piecewise graph (one per "
        "stretch between experts calls) whose experts calls read the layer's routing on the host (one sync a layer, "
        "~0.28 ms) and copy only the routed missing experts over the copy engine; auto = on a host where "
        "prefill.measure_link measured SM reads below 0.78 x the copy engine's rate "
        "(benchmarks/results/HISTORY.md), copy_engine for the "
        "prompts whose expected routed misses make that cheaper at the measured rates, else uva. Decode steps always "
        "read over UVA (moe_offload/prefill_graph.py, moe_offload/link_rates.py)")
    routed_plan: Literal["host", "device", "graph"] = Field(
        "graph", description="how a routed fill (routed_copy copy_engine) works out its copies: device = one kernel "
        "on the compute stream, the host reads back batched-copy entries (kernels/routed_plan.py); graph = the same, "
        "its words written into mapped host memory, and in a routed-fill prefill graph the kernel is captured at the end "
        "of the stretch before each experts call, so the host only waits for its words (moe_offload/fill_plan.py; "
        "0.89-1.03 x device's TTFT, 0.966 x on average, ABBA on an H100 at 700c00c); host = numpy on the routing "
        "read back (2-14 % slower than device on an H100, README Config keys)")
    cuda_graphs: bool = Field(True, description="with decode.cuda_graphs on CUDA: a fresh batch's prefill (generate, "
                              "bench ttft) is padded to a length bucket and replayed as one CUDA graph where its experts "
                              "calls need no host work: routed prompts, or a cache holding every expert "
                              "(moe_offload/prefill_graph.py)")
    piecewise_graphs: bool = Field(True, description="with cuda_graphs: a fresh batch's prefill whose layers are staged "
                                   "(missing experts) is captured as one CUDA graph per stretch between two experts calls "
                                   "(attention, norms, router), the staged experts calls running eagerly between the "
                                   "replays (moe_offload/prefill_graph.py)")
    routed_adaptive_max_tokens: int = Field(
        256, ge=0, le=ROUTED_MAX_TOKENS_LIMIT, description="with routed_max_tokens auto: single prompts of up to "
        "this many tokens may also read only their routed experts where the routing this cache observed (distinct "
        "experts per layer, per prompt length) makes the cost model predict that 20% cheaper than staging; 0 = off. "
        "Sizes the routing record and the decode scratch rows (min(tokens x top-k, experts)). Off under tensor "
        "parallelism (moe_offload/prefill_path.py)")

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data: Any) -> Any:
        """``hit_d2d`` / ``hit_d2d_on_unavailable`` (before 0.2) are accepted for one release, each with one
        ``config_key_deprecated`` event naming the new key: ``hit_d2d: false`` means ``hit_copy: off``."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if data.get("hit_copy") is False:  # YAML 1.1 reads a bare `off` as false
            data["hit_copy"] = "off"
        if "hit_d2d" in data:
            old = data.pop("hit_d2d")
            if not isinstance(old, bool):
                raise ValueError(f"prefill.hit_d2d (deprecated) must be a boolean, got {old!r}; use prefill.hit_copy")
            if old is False:  # the old switch wins over a hit_copy from the file it overrides
                data["hit_copy"] = "off"
            _deprecated("prefill.hit_d2d", "prefill.hit_copy (off | auto | batch_memcpy | gather)")
        if "hit_d2d_on_unavailable" in data:
            data.setdefault("hit_copy_on_unavailable", data.pop("hit_d2d_on_unavailable"))
            data.pop("hit_d2d_on_unavailable", None)
            _deprecated("prefill.hit_d2d_on_unavailable", "prefill.hit_copy_on_unavailable")
        return data

    @field_validator("routed_max_tokens", mode="before")
    @classmethod
    def _check_routed_max_tokens(cls, v: Any) -> Any:
        if isinstance(v, str) and v.strip().lower() == "auto":
            return "auto"
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= ROUTED_MAX_TOKENS_LIMIT:
            raise ValueError(f"accepted: 'auto' or an integer token count in [0, {ROUTED_MAX_TOKENS_LIMIT}] "
                             "(0: only decode.max_tokens takes the routed path)")
        return v

    @field_validator("dequant_chunk_bytes")
    @classmethod
    def _check_chunk_bytes(cls, v: str) -> str:
        if parse_bytes(v) <= 0:
            raise ValueError("must be a positive byte size such as '2GiB'")
        return v


def _deprecated(old: str, new: str) -> None:
    from moe_offload import log

    log.log_once(f"config_key_deprecated:{old}", "config_key_deprecated", 30, old_key=old, use=new,
                 detail="accepted in this release only")


class DecodeConfig(_Strict):
    max_tokens: int = Field(16, ge=1, le=ROUTED_MAX_TOKENS_LIMIT, description="a step of at most this many tokens "
                            "takes the decode (routed-only) path, which a CUDA graph can capture (with decode.path "
                            "routed always; host and auto may stage steps above the cost model's threshold); the graph "
                            "decoders' batch cap (prefill.routed_max_tokens may route longer forwards the same way)")
    cuda_graphs: bool = Field(True, description="on CUDA, replay each decode step (every layer + LM head) as one "
                              "CUDA graph over a static KV cache (one graph per batch size)")
    path: Literal["host", "routed", "auto", "fills"] = Field(
        "host", description="routed: every step of at most decode.max_tokens rows reads only its routed experts "
        "(graph-captured); auto: prefill.routed_max_tokens may be lower than decode.max_tokens, and steps of more "
        "rows than it take the staged path (whole missing layers over the copy engine, eagerly: large batches at "
        "low residency, where the cost model predicts staging is cheaper); host: auto wherever prefill.measure_link "
        "measured this host's rates, with the threshold never below 16 rows on a host whose SM reads of mapped "
        "memory run below 0.78 x its copy engine's rate (batch 64 / 32 at residency 0.37 ran 1.88 / 1.52 x faster "
        "staged on such an H100, batch 16 the same) and never below 32 rows elsewhere (on a fast H100 at residency "
        "0.5 batch 64 ran 17 % faster staged, batch 32 8 % slower); routed where nothing was measured (an integer "
        "prefill.routed_max_tokens, tensor parallelism, a CPU) (moe_offload/link_rates.py decode_path; one "
        "decode_path_chosen event). An embedder that captures its own steps sets routed; fills (an experiment: on a fast H100 at 86df175 its threshold kept batch 16 routed, 0.8 % from host; not yet timed where it is meant to apply): auto on any host, with staged "
        "steps that stage only their routed misses over the copy engine after one host sync a layer (routed fills, "
        "moe_offload/staging.py) where the cost model says that beats whole missing layers, and a threshold that "
        "weighs them too, never below 8 rows (link_rates.FILLS_MIN_TOKENS). Aimed at batch 8-32 on hosts whose SM "
        "reads are slow: batch 16 at residency 0.5 ran at 2.0 x its PCIe floor there, routed, bound by the SM reads "
        "(benchmarks/results/HISTORY.md \"80a81c2\")")
    lookahead: bool = Field(False, description="prefetch: at each MoE layer of a decode step, the next MoE layer's "
                            "router applied to this layer's input predicts its experts, and the predicted missing "
                            "ones are copied from host memory on a side stream while this layer computes "
                            "(moe_offload/lookahead.py; 2 x min(max_tokens x top-k, E) pool rows more); off until a "
                            "GPU run shows it pays (bench decode reports recall, precision and the bytes)")
    miss_copy: Literal["uva", "copy_engine"] = Field(
        "uva", description="how a captured routed step (decode steps, routed prefill graphs) gets its missing experts. "
        "uva: SMs read them from mapped host memory with plain loads (kernels/decode_miss.py; tensor-descriptor "
        "loads through the TMA read that memory no faster: benchmarks/tma_probe.py, README Decisions). copy_engine: "
        "the copy engine copies them inside the graph, one conditional node per expert enabled on the device from "
        "the step's routing (moe_offload/graph_copy.py; CUDA >= 12.4, NVRTC, max_tokens x top-k >= experts, lookahead off). An "
        "experiment, correct but slower everywhere measured: on an H100 whose SM reads ran at ~29 GB/s (10cf59a) "
        "decode lost 38-56 % and 16-256-token prompts took 1.6 x as long, since 128 conditional nodes cost 0.12 ms "
        "a layer and their copies ran at 12-17 GB/s (benchmarks/results/HISTORY.md \"10cf59a\"). Eager forwards read "
        "over UVA either way; a declined setting logs decode_miss_copy_declined")
    overlap_misses_from: int = Field(0, ge=0, description="on CUDA, routed-path forwards (decode steps, short "
                                     "prompts) of at least this many tokens copy their missing experts on a side "
                                     "stream while the pairs read from slots compute; the missed pairs compute after "
                                     "the copy, and one sum over K gives the bits of the one-pass layer "
                                     "(kernels/decode_moe.py decode_moe_nvfp4_split; the fused tile kernels only, "
                                     "not the GEMVs; declined with one decode_miss_overlap_declined event under "
                                     "decode.lookahead or decode.miss_copy copy_engine). 0 = never, the default: on an H100 "
                                     "whose SM reads ran at 27 GB/s it hid at most the 0.12-0.18 ms of compute a "
                                     "layer against 0.75-3.5 ms of reads (4.6 % at best, 3-15 % slower with few "
                                     "misses; benchmarks/decode_overlap.py, benchmarks/results/HISTORY.md "
                                     "\"80a81c2\"); end to end on a fast H100, 16 against 0, +1.2 % tok/s at batch 16 and nothing at batch 64, "
                                     "residency 0.5 (ABBA, \"74b55da\")")
    run_ahead: bool = Field(True, description="greedy decoding (temperature 0), whose argmax and finiteness flag "
                            "are computed on the device and read back in one copy: the next step is enqueued before "
                            "the host reads this step's tokens, so the host's work between steps (reading the "
                            "tokens, stop checks, streaming, the step boundary) overlaps the GPU's next step instead "
                            "of idling it; a step enqueued after every sequence stopped is discarded. A cache short of "
                            "some experts then admits from the routing of the step before the one in flight (one step "
                            "later), so its boundary does not wait for the running step either (moe_offload/"
                            "decode_boundary.py, 'read late'). On since 47c82c8's ABBA on an H100: +4.4 / +4.3 % tok/s at "
                            "residency 0.37 batch 1 / 4 (misses +27 / +11 %, median step -14 %), +1.0 / +0.4 % fully "
                            "resident at batch 1 / 16 (e31192f); batch 16 / 64 with misses not yet timed in this "
                            "form (benchmarks/results/HISTORY.md, 47c82c8 on an H100)")
    max_cache_len: int = Field(4096, ge=16, le=1 << 20, description="positions of the static KV cache of a graph "
                               "decoder (prompt + new tokens); longer requests decode eagerly")
    max_new_tokens: int = Field(32, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=100.0, description="0 = greedy")
    top_k: int = Field(0, ge=0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop_token_ids: list[int] = Field(default_factory=list)
    stop_at_eos: bool = Field(True, description="`moe-offload generate` also stops at the checkpoint's EOS ids "
                              "(generation_config.json, else config.json eos_token_id)")


class ParallelConfig(_Strict):
    tp: int = Field(1, ge=1, le=64)
    reduce: Literal["runtime", "host"] = "runtime"
    check_interval: int = Field(0, ge=0, description="check residency agreement across ranks every N steps; 0 = on demand only")
    timeout_s: float = Field(600.0, ge=1.0, le=86400.0, description="a collective that waits longer (a peer died or "
                             "hangs) fails with an error on every rank instead of hanging")


class ComputeConfig(_Strict):
    backend: Literal["auto", "torch", "triton"] = "auto"
    cuda_graphs: bool = Field(True, description="replay the prefill expert compute of a seen prompt-chunk length "
                              "as a CUDA graph (CUDA only; cuts ~40 launches per layer to one)")
    decode_kernel: Literal["auto", "gemv", "tiles"] = Field(
        "auto", description="NVFP4 decode kernel on CUDA: gemv (kernels/decode_gemv.py), tiles "
        "(kernels/decode_moe.py), auto = gemv up to the routed-pair count in decode_gemv_tuning.json")
    decode_attention: Literal["sdpa", "triton"] = Field(
        "triton", description="one-position grouped-query attention on CUDA (with fused_norms): triton = split-K "
        "kernels/decode_attention.py (two launches, reads only the visible positions; on the H200 1.5-2.1 x faster "
        "than SDPA per layer at 1-64 rows, 149.9 -> 172.8 tok/s at batch 1), sdpa = torch's SDPA on the "
        "folded query")
    fused_norms: bool = Field(True, description="on CUDA, the decode step's small ops are fused: each RMSNorm and "
                              "rotary one kernel (kernels/rmsnorm.py, kernels/rotary.py), the router's softmax + "
                              "top-k + renorm one kernel (kernels/router.py), q/k/v one GEMM, grouped-query decode "
                              "attention without repeated K/V, each residual add inside the next norm or the MoE's "
                              "sum over K (kernels/moe_sum.py) (moe_offload/integrations/)")
    fused_qk_rope: bool = Field(True, description="with fused_norms, on CUDA: Qwen3-MoE's q/k RMSNorms, rotary and "
                                "KV-cache write in one kernel over the decoder's static cache (kernels/qk_norm_rope.py; "
                                "the same bits as the three kernels it replaces, on an H100 and in the CPU tests)")
    fused_moe_launches: bool = Field(True, description="on CUDA, the NVFP4 decode path's MoE in fewer launches: the "
                                     "miss plan and the tile kernels' alignment in one; with fused_norms the swapped "
                                     "tiles' split activations written by the norm before the MoE; with "
                                     "route_plan_max_pairs the router's top-k in the plan's launch; with moe_sum_in_down "
                                     "the sum over K inside the down launch. The same bits as the launches false keeps "
                                     "(kernels/decode_route.py, decode_miss.py, rmsnorm.py, fused_moe_swap.py)")
    route_plan_max_pairs: int = Field(0, ge=0, le=128, description="with fused_moe_launches: the router's top-k, the "
                                      "miss plan and the alignment in one launch (kernels/decode_route.py) for decode "
                                      "steps of up to this many routed pairs (tokens x top-k); 0 = never. Off by "
                                      "default: measured on an H100 at 3ad5d89, that launch took 48.8 us at 128 pairs "
                                      "(batch 16) against ~10 us for the three it replaces "
                                      "(benchmarks/results/HISTORY.md)")
    moe_sum_in_down: bool = Field(False, description="with fused_moe_launches: the down launch sums each token's "
                                  "top-k terms itself (kernels/fused_moe_swap.py, decode_gemv.py; Triton >= 3.5 for "
                                  "the swapped tiles) instead of a separate sum launch (kernels/moe_sum.py). Off by "
                                  "default: on an H100 at 8bcd799 the separate sum was faster at batch 16 and 64 "
                                  "(1550.6 vs 1507.6 and 4221.5 vs 4109.7 tok/s fully resident) and level at batch 1")
    router_gemm_max_tokens: int = Field(0, ge=0, le=4096, description="with fused_norms, on CUDA: forwards of at "
                                        "most this many tokens compute each router's logits, softmax, top-k and "
                                        "renormalisation in one launch (kernels/router.py router_gemm_topk) instead "
                                        "of torch's GEMM and the top-k kernel (at bb13400 on an H100 those took 5.0 "
                                        "and 2.4 us a layer at batch 1). Its fp32 sums run in another order than "
                                        "torch's GEMM (a logit may differ in its last bit). A forward that "
                                        "route_plan_max_pairs covers keeps that launch. 0 = off, the default: on "
                                        "an H200 at c7b7054 (ABBA, fully resident) it was level at batch 1 and 12 / "
                                        "9 % slower at batch 16 / 64 (benchmarks/results/HISTORY.md)")
    pdl_max_tokens: int = Field(64, ge=0, le=4096, description="on CUDA sm_90+, decode steps of at most this "
                                "many sequences (one new token each; eager or captured) launch their Triton kernels "
                                "(kernels/ in a decode step) with programmatic dependent launch: each may be launched "
                                "while the one before it runs and waits for it to complete before touching memory, "
                                "so launch gaps shrink and results keep their bits (kernels/pdl.py); 0 = never. "
                                "Prompts, routed ones included, launch plainly (at bb13400 16-256-token prompts were "
                                "level with it and 64-token ones fully resident 3-6 % slower). 64 (every decode "
                                "bucket measured) from H100 A/Bs: batch 1 fully resident +4.7 % over five pairs "
                                "(3e491a3 / 3bf4dd6); batch 16 / 64 +0.6 / +1.6 % in an ABBA order of 3 reps a "
                                "side (bb13400; benchmarks/results/HISTORY.md). A CUDA device without it: one "
                                "pdl_declined event")
    graph_after: int = Field(2, ge=1, le=1000, description="capture a shape on its n-th call (earlier calls run eagerly)")
    max_graphs: int = Field(16, ge=1, le=1024, description="captured shapes kept (least recently used dropped)")


class ServeConfig(_Strict):
    """``moe-offload serve``: batch and queue bounds, model length, names (moe_offload/serve/)."""

    max_batch: int = Field(16, ge=1, le=4096, description="sequences decoded together in one forward")
    max_queue: int = Field(64, ge=0, le=1_000_000, description="requests waiting for a batch slot; more get 429")
    max_model_len: int | None = Field(None, ge=2, description="prompt + max_tokens limit; null = the model's max positions")
    default_max_tokens: int = Field(16, ge=1, description="max_tokens of a request that gives none")
    model_name: str | None = Field(None, description="the id /v1/models reports; null = the checkpoint dir's name")
    prefill_batch_tokens: int = Field(
        0, ge=0, le=1 << 20, description="prefill several waiting prompts in one forward, left-padded, while "
        "prompts x the longest of them stays within this many tokens, at most prefill.chunk_tokens (each layer's "
        "missing experts are then copied once for all of them); 0 = one prompt per forward. Full-attention models only (others: one event, one at "
        "a time). Off by default until measured on a GPU")
    kv_cache: Literal["auto", "static", "dynamic"] = Field(
        "auto", description="decode batch KV: static (per-row preallocated cache, each step a CUDA graph replay on "
        "CUDA), dynamic (one left-padded transformers cache, eager); auto = static on CUDA with decode.cuda_graphs")


class LoggingConfig(_Strict):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    format: Literal["text", "json"] = "text"


class OffloadConfig(_Strict):
    model: ModelConfig = ModelConfig()
    device: str = "auto"
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    cache: CacheConfig = CacheConfig()
    prefill: PrefillConfig = PrefillConfig()
    decode: DecodeConfig = DecodeConfig()
    parallel: ParallelConfig = ParallelConfig()
    compute: ComputeConfig = ComputeConfig()
    serve: ServeConfig = ServeConfig()
    logging: LoggingConfig = LoggingConfig()

    @field_validator("device")
    @classmethod
    def _check_device(cls, v: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", v):
            raise ValueError(f"{v!r}; accepted: 'auto', 'cpu', 'cuda', 'cuda:N'")
        return v


#: config_load.py's public names, importable from here as before. Looked up on first use: config_load imports this
#: module's models, so importing it here at load time would be circular (and fail for whoever imports it first)
_LOADER_NAMES = ("load_config", "default_config_text", "config_to_dict")


def __getattr__(name: str) -> Any:
    if name in _LOADER_NAMES:
        from moe_offload import config_load

        return getattr(config_load, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
