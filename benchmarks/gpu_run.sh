#!/usr/bin/env bash
# Everything one lent-GPU call runs, in order, writing under $OUT (results.tgz + logs).
# Usage on the device: bash benchmarks/gpu_run.sh [stage ...]
#   stages: tune_dequant build probe tune_gemv tune_moe ttft inplace_ab cache_tests profile tests copy fused kernels decode_smoke decode profile_decode serve soak
#           soak_bg soak_wait check_decode check_serve decode_paths serve_overhead observed flash decode_attn lookahead fused_tune tables_back compute_ab prefill_graphs piecewise flash_ttft
#           retune_aligned decode_split attn_sweep decode_ab set_ab sanitize decode_plan cond_copy ttft_ab fill_profile
#           decode_overlap link tma_probe
# link: benchmarks/link_probe.py, this host's SM-read and copy-engine rates on one real-size pinned layer (no checkpoint,
# seconds): $RES/link.json's "slow" says which kind of host this is, so a later call of the same machine can pick the
# measurements that host is for (exit 0 slow, 1 fast, 2 not measured:
# `python3 -c "import json,sys; sys.exit({True: 0, False: 1}.get(json.load(open('/tmp/res/link.json'))['slow'], 2))"`)
# tma_probe: benchmarks/tma_probe.py, SM reads of mapped host rows through TMA descriptors against plain loads and the
# copy engine (no checkpoint, seconds; equal rates on a fast H100 at fdd1739: HISTORY.md "fdd1739")
# decode_overlap: benchmarks/decode_overlap.py, a layer's miss copy on a second stream while the resident pairs compute
# (kernels/decode_moe.py decode_moe_nvfp4_split) against the serial layer, at T = 16 / 64 and 0-36 misses a layer; no
# checkpoint needed (~1 min; first run at 80a81c2, benchmarks/results/HISTORY.md)
# fill_profile: benchmarks/profile_prefill.py --trace --host-splits on a FILL_PROFILE_TOKENS (16)-token prompt at residency 0.37 / 0,
# prefill.routed_copy copy_engine then uva: where the whole device idles for the host (device_idle, per layer), i.e.
# where a routed fill's ~0.28 ms a layer goes (needs a build; ~1-2 min a side; FILL_PROFILE_COPIES picks the sides;
# first run at 80a81c2: the device idles ~235 us a layer between the routing read and the copy, host work);
# FILL_PROFILE_ARGS adds options (e.g. "--set prefill.routed_plan=device"), FILL_PROFILE_TAG a suffix to the names)
# decode_plan: benchmarks/decode_plan.py, the routing launches (top-k, register vs workspace plan, alignment, their
# fused forms) timed alone in CUDA graphs at 1/4/16/64 tokens; no checkpoint needed (~1 min; not yet run). The miss
# copy's rate across layouts and configs: the kernels stage with KERNELS_ARGS=--uva-only.
# sanitize: compute-sanitizer memcheck / synccheck / racecheck over the CPU-shaped tests of the cross-program kernels
# (they run on CUDA there), SANITIZE_K selects them; ~1-2 min a tool (not yet run).
# set_ab: the fused small ops' GPU tests, then bench decode with --set SET_AB and with its opposite (SET_AB_OFF,
# default SET_AB's =true as =false; e.g. SET_AB=compute.fused_qk_rope=true, ~4 min after the machine starts);
# AB_TESTS replaces its GPU test files (e.g. for compute.fused_moe_launches: "tests/gpu/test_decode_gpu.py
# tests/gpu/test_decode_kernels_gpu.py tests/gpu/test_fused_small_ops_gpu.py").
# Only a few files under $OUT come back per call (at b18b0cc a 9th plain file was left out, "count"): stages tar into results.tgz.
# decode_attn: compute.decode_attention sdpa vs triton (kernels/decode_attention.py): its GPU test, the decode kernel,
# KV-write and serving-graph tests, benchmarks/decode_attention.py (per layer in CUDA graphs), then bench decode at
# DECODE_ATTN_RESIDENCIES (1,0.37) x batch 1,4,16,64 with each, same machine (~2 x 2-3 min after a build).
# tune_gemv: benchmarks/tune_decode_gemv.py writes this GPU's decode GEMV tiles (incl. the split_x and down_per_pair
# variants) into kernels/decode_gemv_tuning.json, used by every later stage of the same machine, and copies the
# table to $OUT (commit it). Measured at fb04647: the first T (1) took ~290 s (Triton compiles every candidate once),
# T = 2/4/8/16 then took seconds to ~3 min each, so 300 s covered T = 1 only; TUNE_TIMEOUT defaults to 540. Issue 12's next run: "build tune_gemv" (~7 min), then within ~30 s "decode_attn"
# (with DECODE_ATTN_RESIDENCIES=1 it fits one call beside the tests).
# serve_overhead: benchmarks/serve_overhead.py at residency 1 (the d9f7bae serving TTFT/decode gap), with profiles;
# OVERHEAD_ARGS adds options (e.g. "--set model.layers=12": a 12-layer build on first use, ~1 min).
# observed: bench ttft at 16/64/256/1024 tokens, prefill path auto (observed routing on) beside staged.
# prefill_graphs: bench ttft with prefill.cuda_graphs on, then off (PG_ONLY_ON=1: on only), at PG_LENS x PG_RESIDENCIES,
# PG_PEERS (none; full_gpu at all 48 layers needs ~95 s to build and TTFT_TIMEOUT >= 330). Measured at da1eb4a:
# 16-1024 tokens x 5 residencies in ~100 s after a build; the full-depth peer call ~150 s.
# The device copy's git HEAD may be the session's base commit, not the tree sent: pass SERVE_CHECK_SHA=<sha of the
# tree> (it becomes --git-sha). Commands run after this script in the same call need the wheel install line
# above themselves (its PYTHONPATH is this script's).
# flash_ttft: the Flash-Next preset at FLASH_LAYERS (8): build, then bench ttft 1024 tokens staged at FLASH_RESIDENCIES.
# piecewise: bench ttft with prefill.piecewise_graphs on, then off, at PW_LENS (1024) x PW_RESIDENCIES (0,0.37,0.5,0.75;
# 1 is always added), PW_ARGS adds options (e.g. "--layers 8" for the Flash-Next preset with TTFT_CONFIG).
# flash: the Flash-Next preset at FLASH_LAYERS (8) layers: build, bench decode batch 1 at residency 0.37 (issue 12's
# per-layer figure), bench ttft 1024 tokens at residency 0/0.37/0.5/0.75 and 16-256 tokens staged vs routed (512 experts).
# decode_paths: bench decode with decode.path routed, then auto (the cost model stages large batches), same machine.
# check_serve: the "Serve it" targets (SERVE_CHECK_SHA): bench serve per residency (SERVE_CHECK_RESIDENCIES; every
# client its own prompt; --decode-reference times bench decode's cell on the same engine first, so check_decode,
# bench decode at residency 0.37,1 x batch 1,4,16,64, is optional), then
# benchmarks/serve_targets.py over them; two or three calls made while the machine is held (/tmp/res persists).
# build: the preset of TTFT_CONFIG into /tmp/moe-cache first, alone (beside other work it takes ~3 x longer).
# soak_bg starts one detached soak per residency in SOAK_RESIDENCIES (concurrently: a soak checks outputs and
# memory, not speed) and returns; soak_wait waits for them (at most SOAK_WAIT_S) in this call or a later one
# made while the machine is still held, so one soak can run longer than one call's 10 minutes (measured: a
# detached soak survives the end of its call while the next call follows within the ~30 s hold).
# Measured at 032db7c: two soaks started together, each with torch's default 16 CPU threads, loaded experts
# at ~3 per second (the 16.3 GB store needs 6144) and a pytest beside them finished one test in 7 minutes:
# CPU oversubscription of many small CPU ops per expert (scale checks). Each background soak now gets
# SOAK_THREADS (4) OpenMP threads: at edd2da4 two soaks loaded normally that way beside pytest (OMP_NUM_THREADS=4).
# A detached soak dies with the machine: at edd2da4 the next call came too late for the ~30 s hold, started a
# fresh machine and the soaks were lost after 6-7 minutes (their 60 s partial reports came back with the call
# before). Chain the calls at once, and keep the device-memory hog tests (test_faults_gpu.py -k budget) away
# from running soaks: they take all free device memory.
# PYTEST_K: a pytest -k expression (may hold spaces), e.g. PYTEST_K="not budget" keeps the memory hogs out.
# e.g. TTFT_ARGS="--prompt-lens 1024 --residency 0,0.37,0.5,0.75 --modes gather,batch_memcpy,off --git-sha <sha>"
# Carry .whl (pydantic and its needs, from ../shared/tools/device-wheels.sh).
set -uo pipefail
export PYTHONUNBUFFERED=1
RES=/tmp/res; mkdir -p "$RES"
stages="${*:-probe ttft tests copy fused}"
has() { [[ " $stages " == *" $1 "* ]]; }
# cap N: N seconds, or fewer so the stage ends (and its results are tarred) 15 s before the call's limit
# (CALL_LIMIT_S, default 600 - 10 for the start-up): a call killed at its limit brings back only what is tarred.
cap() { local left=$(( ${CALL_LIMIT_S:-590} - SECONDS - 15 )); (( left < $1 )) && echo $(( left > 1 ? left : 1 )) || echo "$1"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "install failed"; exit 1; }
# kernels/ has no __init__.py (it must not shadow the `kernels` distribution): check the editable install maps it
python3 -c "import moe_offload.kernels.fused_moe" || { echo "moe_offload.kernels does not import (setuptools $(python3 -c 'import setuptools; print(setuptools.__version__)'))"; exit 1; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c "import torch,transformers,triton;print(torch.__version__,torch.version.cuda,transformers.__version__,triton.__version__)"; git rev-parse HEAD;
  # the tree that was sent (HEAD above may be the session's base), untracked files that git does not ignore included:
  # locally, `cp .git/index /tmp/i && GIT_INDEX_FILE=/tmp/i git add -A && GIT_INDEX_FILE=/tmp/i git write-tree` on the
  # tree you sent gives the same hash (equal to `git rev-parse <sha>^{tree}` when nothing was uncommitted)
  cp .git/index /tmp/sent-index 2>/dev/null; echo "tree $(GIT_INDEX_FILE=/tmp/sent-index git add -A 2>/dev/null && GIT_INDEX_FILE=/tmp/sent-index git write-tree)"; } > "$RES/env.txt" 2>&1
# the host's memory topology, for reading link rates across machines (the store's SM-read rate moved 45-51 GB/s between
# runs on one H100 at 1631575): NUMA nodes online, the GPU's node (-1: none exposed), THP mode
{ echo "numa nodes online: $(cat /sys/devices/system/node/online 2>/dev/null || echo unknown)"
  bus=$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader 2>/dev/null | head -1 | sed 's/^0000//' | tr 'A-F' 'a-f')
  echo "gpu $bus numa_node: $(cat /sys/bus/pci/devices/$bus/numa_node 2>/dev/null || echo unknown)"
  echo "thp: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null || echo unknown)"
  nproc; free -g | head -2; } > "$RES/host.txt" 2>&1
if has cond_copy; then  # benchmarks/conditional_copy.py: routed copies through graph IF nodes vs the copy engine and SM
  # reads, one layer's 128 experts; no checkpoint needed (~1 min; runs before any other stage)
  # (--tag=...: a value starting with "-" is read as an option otherwise, as at 4c209c0)
  timeout $(cap 120) python3 benchmarks/conditional_copy.py --out "$RES" \
    --tag="-${SERVE_CHECK_SHA:-unknown}" \
    > "$RES/conditional_copy.log" 2>&1
  tar czf "$OUT/results.tgz" -C "$RES" .
fi
if has tune_dequant; then  # NVFP4 dequant tiles for this GPU into kernels/dequant_tuning.json (used by the stages after)
  timeout ${TUNE_TIMEOUT:-200} python3 benchmarks/tune_dequant.py --write --report "$RES" --max-seconds ${TUNE_SECONDS:-120} \
    > "$RES/tune_dequant.log" 2>&1
  cp kernels/dequant_tuning.json "$RES/"; tar czf "$OUT/results.tgz" -C "$RES" .
fi
if has link; then
  timeout $(cap 60) python3 benchmarks/link_probe.py --out "$RES" > "$RES/link.log" 2>&1; cat "$RES/link.log"
fi
if has tma_probe; then
  timeout $(cap 120) python3 benchmarks/tma_probe.py --out "$RES" > "$RES/tma_probe.log" 2>&1; tail -3 "$RES/tma_probe.log"
  tar czf "$OUT/results.tgz" -C "$RES" .
fi
if has build; then
  t0=$(date +%s)
  timeout ${BUILD_TIMEOUT:-400} python3 -c "from moe_offload.config import load_config; from moe_offload.engine import ensure_checkpoint; ensure_checkpoint(load_config('${TTFT_CONFIG:-configs/qwen3-30b-a3b-nvfp4.yaml}', ['model.cache_dir=/tmp/moe-cache']).model, False)" > "$RES/build.log" 2>&1
  echo "build rc=$? $(( $(date +%s) - t0 )) s" >> "$RES/build.log"
fi
has probe && moe-offload probe --json > "$RES/probe.json" 2> "$RES/probe.err"
if has tune_gemv; then  # decode GEMV tiles for this GPU into kernels/decode_gemv_tuning.json (used by the stages after)
  timeout ${TUNE_TIMEOUT:-540} python3 benchmarks/tune_decode_gemv.py --report "$RES" > "$RES/tune_gemv.log" 2>&1
  cp kernels/decode_gemv_tuning.json "$RES/"; tar czf "$OUT/results.tgz" -C "$RES" .
fi
if has tune_moe; then  # decode MoE tiles (the path above decode_gemv_tuning's gemv_max_pairs: from 3 tokens, 24 pairs, on the H200)
  # TUNE_MOE_MAXNREG (e.g. "none 112"): register caps tried with every tile (2 x the compiles; ~113 s for T = 4-64 uncapped);
  # ncu at b18b0cc: 8 CTAs/SM by registers, 9 by shared memory at 3 stages, so a cap pays only with fewer stages
  # TUNE_MOE_SHAPES: "qwen3-30b-a3b flash-next" also tunes the 512-expert shape (no H200 entry yet: its decode above the
  # GEMV's 160 pairs runs the table's untuned default tiles)
  timeout ${TUNE_TIMEOUT:-540} python3 benchmarks/tune_decode_moe.py --shapes ${TUNE_MOE_SHAPES:-qwen3-30b-a3b} --tokens ${TUNE_MOE_TOKENS:-32 64} \
    --layouts swap --maxnreg ${TUNE_MOE_MAXNREG:-none} \
    > "$RES/tune_moe.log" 2>&1
  cp kernels/decode_moe_tuning.json "$RES/"; tar czf "$OUT/results.tgz" -C "$RES" .
fi
if has retune_aligned; then  # the prefill tiles (fused_moe_tuning.json), the decode GEMV tiles (decode_gemv_tuning.json) and
  # the dequant tiles (dequant_tuning.json) re-measured on store-aligned rows: all were tuned before b18b0cc on unpadded
  # random banks, i.e. on byte loads (the decode tiles' re-tune there: down 44.3 -> 37.2 us at T = 16, decode_moe_split).
  # Each tuner has its own budget and its table is archived as soon as it ends (a call killed later keeps it); the
  # defaults (80 + 200 + 240 s) fill one 10-minute call: run this stage alone, after a call that ran tune_moe.
  # RETUNE_TOKENS: prefill token counts (256 is the H200 bucket of every prompt up to 256 tokens on the fused path)
  timeout ${RETUNE_DEQUANT_TIMEOUT:-80} python3 benchmarks/tune_dequant.py --write --report "$RES" --max-seconds 60 \
    > "$RES/tune_dequant_aligned.log" 2>&1
  cp kernels/dequant_tuning.json "$RES/"; tar czf "$OUT/results.tgz" -C "$RES" .
  timeout ${RETUNE_FUSED_TIMEOUT:-200} python3 benchmarks/tune_fused_moe.py --shapes qwen3-30b-a3b --layouts swap \
    --block-ms 32 64 128 --tokens ${RETUNE_TOKENS:-256 1024 2048 4096} > "$RES/tune_fused_aligned.log" 2>&1
  cp kernels/fused_moe_tuning.json "$RES/"; tar czf "$OUT/results.tgz" -C "$RES" .
  # T = 1 alone took ~290 s at fb04647 (every candidate compiles once); the table is written after the whole shape
  timeout ${RETUNE_GEMV_TIMEOUT:-240} python3 benchmarks/tune_decode_gemv.py --tokens 1 2 --report "$RES" > "$RES/tune_gemv_aligned.log" 2>&1
  cp kernels/decode_gemv_tuning.json "$RES/"; tar czf "$OUT/results.tgz" -C "$RES" .
fi
if has attn_sweep; then  # decode attention and the fused RMSNorm/rotary: their GPU tests, then every launch config of
  # benchmarks/decode_attention.py sweep_grid() at 1/4/16/64 rows (~1-3 min: one compile per distinct config)
  timeout 180 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_decode_attention_gpu.py \
    tests/gpu/test_fused_small_ops_gpu.py > "$RES/pytest_attn.log" 2>&1
  timeout ${ATTN_SWEEP_TIMEOUT:-300} python3 benchmarks/decode_attention.py --sweep --out "$RES" \
    --git-sha ${SERVE_CHECK_SHA:-unknown} > "$RES/attn_sweep.log" 2>&1
  tar czf "$OUT/results.tgz" -C "$RES" .
fi
if has decode_split; then  # the decode MoE kernels one by one at T = 16 / 64 against their HBM floors, padded vs unpadded rows
  timeout 120 python3 benchmarks/decode_moe_split.py --unaligned --json --git-sha ${SERVE_CHECK_SHA:-unknown} \
    > "$RES/decode_moe_split.json" 2> "$RES/decode_moe_split.log"
fi
if has ttft; then  # builds the preset on first use into /tmp/moe-cache (event preset_built gives the time)
  timeout $(cap ${TTFT_TIMEOUT:-500}) moe-offload bench ttft --config ${TTFT_CONFIG:-configs/qwen3-30b-a3b-nvfp4.yaml} \
    --set model.cache_dir=/tmp/moe-cache ${TTFT_ARGS:-} --out "$RES" --json > "$RES/ttft.json" 2> "$RES/ttft.log"
  tar czf "$OUT/results.tgz" -C "$RES" .   # early copy: survives a later timeout
fi
if has inplace_ab; then  # bench ttft at residency 1 with prefill.read_in_place off: the A/B of the ttft stage's r=1 cell
  timeout ${TTFT_OFF_TIMEOUT:-120} moe-offload bench ttft --config ${TTFT_CONFIG:-configs/qwen3-30b-a3b-nvfp4.yaml} \
    --set model.cache_dir=/tmp/moe-cache --set prefill.read_in_place=false --prompt-lens 1024 --residency 1 \
    --modes gather --peers none --reps 3 --git-sha ${SERVE_CHECK_SHA:-unknown} --out "$RES/ttft-gathered" --json \
    > "$RES/ttft-gathered.json" 2> "$RES/ttft-gathered.log"
  tar czf "$OUT/results.tgz" -C "$RES" .
fi
if has cache_tests; then  # the CPU cache tests on CUDA (device auto): the in-place read with Triton, graphs and streams
  timeout ${CACHE_TESTS_TIMEOUT:-90} python3 -m pytest -q -p no:cacheprovider tests/test_cache.py \
    -k "${CACHE_TESTS_K:-in_place or chunked}" > "$RES/pytest_cache_cuda.log" 2>&1
  tar czf "$OUT/results.tgz" -C "$RES" .
fi
has profile && timeout ${PROFILE_TIMEOUT:-240} python3 benchmarks/profile_prefill.py --config configs/qwen3-30b-a3b-nvfp4.yaml \
  --set model.cache_dir=/tmp/moe-cache ${PROFILE_ARGS:---layers 12 --residency 1,0.5} --out "$RES" > "$RES/profile.log" 2>&1
has tests && timeout ${TESTS_TIMEOUT:-420} python3 -m pytest -m gpu -q -p no:cacheprovider ${PYTEST_K:+-k "$PYTEST_K"} ${PYTEST_ARGS:-} ${PYTEST_PATHS:-tests/gpu} 2>&1 | tail -80 > "$RES/pytest_gpu.log"
has kernels && timeout ${KERNELS_TIMEOUT:-240} python3 benchmarks/decode_kernels.py --out "$RES" ${KERNELS_ARGS:-} \
  --git-sha ${SERVE_CHECK_SHA:-unknown} > "$RES/decode_kernels.log" 2>&1
if has decode_smoke; then  # generate on a truncated real-size model: decode tok/s per residency, graphs on/off
  timeout ${SMOKE_TIMEOUT:-300} python3 - > "$RES/decode_smoke.log" 2>&1 <<'PY'
import json, time, torch
from moe_offload.config import load_config
from moe_offload.engine import Engine
from moe_offload.bench.sweep import resident_sets
L = 8
for graphs in (True, False):
    cfg = load_config("configs/qwen3-30b-a3b-nvfp4.yaml", [f"model.layers={L}", "model.cache_dir=/tmp/moe-cache",
                      "cache.budget=1.0", f"decode.cuda_graphs={str(graphs).lower()}", "decode.max_cache_len=1200"])
    eng = Engine.from_config(cfg, progress=False)
    E = eng.store.num_experts
    for r in (1.0, 0.37, 0.0):
        sets = resident_sets(eng.store.layers, E, {r: round(r * E)}, 0)[r]
        eng.cache.set_residency(sets)
        prompt = torch.randint(3, 150000, (1024,), generator=torch.Generator().manual_seed(0)).tolist()
        eng.generate(prompt, 8)
        eng.cache.reset()
        res = eng.generate(prompt, 65)
        st = res.stats
        print(json.dumps({"layers": L, "graphs": graphs, "residency": r, "decode_tok_s": res.decode_tok_s,
                          "ttft_s": res.ttft_s, "hit_rate": st["hit_rate"], "declined": st["declined"],
                          "compute": st["compute"], "bytes": st["total"]["bytes"]}), flush=True)
    eng.close()
PY
fi
has profile_decode && timeout ${PROFILE_DECODE_TIMEOUT:-300} python3 benchmarks/profile_decode.py \
  --config ${TTFT_CONFIG:-configs/qwen3-30b-a3b-nvfp4.yaml} --set model.cache_dir=/tmp/moe-cache ${PROFILE_DECODE_ARGS:---layers 8} \
  --out "$RES" > "$RES/profile_decode.log" 2>&1
if has decode; then  # the 16-cell grid took > 400 s on the H200 at 9710d5e (residency 0, batch 64 ran last): split it
  # by --residency over two calls (the report is rewritten after each cell, so a timeout keeps the cells done)
  timeout $(cap ${DECODE_TIMEOUT:-540}) moe-offload bench decode --config ${TTFT_CONFIG:-configs/qwen3-30b-a3b-nvfp4.yaml} \
    --set model.cache_dir=/tmp/moe-cache ${DECODE_ARGS:-} --out "$RES" --json > "$RES/decode.json" 2> "$RES/decode.log"
  tar czf "$OUT/results.tgz" -C "$RES" .
fi
if has serve; then  # a live server per residency, N concurrent streaming clients (SERVE_ARGS: --clients ... --git-sha)
  for r in ${SERVE_RESIDENCIES:-0.37 1.0}; do
    timeout ${SERVE_TIMEOUT:-240} moe-offload bench serve --config ${TTFT_CONFIG:-configs/qwen3-30b-a3b-nvfp4.yaml} \
      --set model.cache_dir=/tmp/moe-cache --set cache.budget=$r ${SERVE_ARGS:-} --out "$RES/serve-r$r" --json \
      > "$RES/serve-r$r.json" 2> "$RES/serve-r$r.log"
    tar czf "$OUT/results.tgz" -C "$RES" .
  done
fi
if has check_decode; then  # bench decode at the check_serve residencies and batches (~3-5 min)
  timeout ${DECODE_TIMEOUT:-400} moe-offload bench decode --config ${TTFT_CONFIG:-configs/qwen3-30b-a3b-nvfp4.yaml} \
    --set model.cache_dir=/tmp/moe-cache --residency 0.37,1 --batch 1,4,16,64 --steps 64 --reps 1 --peers none \
    --git-sha ${SERVE_CHECK_SHA:-unknown} --out "$RES/check" --json > "$RES/check-decode.json" 2> "$RES/check-decode.log"
  tar czf "$OUT/results.tgz" -C "$RES" .
fi
if has decode_ab; then  # bench decode with the tree, then with AB_FILES as of AB_REV (e.g. AB_REV=4fae0d1
  # AB_FILES="kernels/rmsnorm.py kernels/rotary.py": f2b8264's fused small ops off), same machine, back to back;
  # the files are restored afterwards. AB_RESIDENCY (1), AB_BATCH (1,16,64); ~1.5 min per side after a build.
  # AB_SIDES (e.g. "tree base base tree", ABBA) and AB_REPS (1) as in set_ab; with AB_SIDES the files get the position.
  for f in ${AB_FILES:?}; do rm -f "/tmp/ab-keep-$(basename "$f")"; cp "$f" "/tmp/ab-keep-$(basename "$f")"; done
  i=0
  for side in ${AB_SIDES:-tree base}; do
    i=$((i + 1)); tag=$side; [[ -n ${AB_SIDES:-} ]] && tag=$side-$i
    for f in ${AB_FILES}; do
      if [[ $side == base ]]; then git show "${AB_REV:?}:$f" > "$f" || exit 3; else cp "/tmp/ab-keep-$(basename "$f")" "$f"; fi
    done
    timeout ${DECODE_TIMEOUT:-200} moe-offload bench decode --config ${TTFT_CONFIG:-configs/qwen3-30b-a3b-nvfp4.yaml} \
      --set model.cache_dir=/tmp/moe-cache --residency ${AB_RESIDENCY:-1} --batch ${AB_BATCH:-1,16,64} --steps 64 \
      --reps ${AB_REPS:-1} --peers none --git-sha ${SERVE_CHECK_SHA:-unknown}-$tag --out "$RES/ab-$tag" --json \
      > "$RES/ab-$tag.json" 2> "$RES/ab-$tag.log"
    tar czf "$OUT/results.tgz" -C "$RES" .
  done
  for f in ${AB_FILES}; do cp "/tmp/ab-keep-$(basename "$f")" "$f"; done
fi
if has sanitize; then  # compute-sanitizer (Firecracker machines only, KINDS.md) over the small-shape tests of the kernels
  # whose programs hand work to each other through global memory (compute.fused_moe_launches: the route/plan/align
  # launch, the in-launch sums over K): memcheck, synccheck (barriers in uniform branches) and racecheck, each a log
  for tool in memcheck synccheck racecheck; do
    timeout ${SANITIZE_TIMEOUT:-150} compute-sanitizer --tool $tool --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
      tests/test_decode_miss.py tests/test_decode_moe.py tests/test_decode_gemv.py \
      -k "${SANITIZE_K:-route_and_serve_small or miss_plans_alignment or serve_misses_plan_copies or sums_over_k}" > "$RES/sanitize-$tool.log" 2>&1
    echo "rc=$?" >> "$RES/sanitize-$tool.log"
    tar czf "$OUT/results.tgz" -C "$RES" .
  done
fi
if has decode_plan; then
  timeout ${PLAN_TIMEOUT:-150} python3 benchmarks/decode_plan.py --out "$RES" --git-sha ${SERVE_CHECK_SHA:-unknown} \
    > "$RES/decode_plan.log" 2>&1
  tar czf "$OUT/results.tgz" -C "$RES" .
fi
if has set_ab; then  # bench decode with SET_AB (e.g. "compute.fused_qk_rope=true"), then without, same machine, back to
  # back, after the GPU tests of the fused small ops; AB_RESIDENCY (1), AB_BATCH (1,16,64); ~1 min per side after a build
  timeout $(cap 180) python3 -m pytest -m gpu -q -p no:cacheprovider ${AB_TESTS:-tests/gpu/test_fused_residuals_gpu.py \
    tests/gpu/test_fused_small_ops_gpu.py} > "$RES/pytest_set_ab.log" 2>&1
  # the off side sets SET_AB_OFF, by default SET_AB with =true turned into =false (a default that is now on, e.g.
  # compute.fused_qk_rope since 8eb2030, must be turned off explicitly); without either it runs the defaults
  off="${SET_AB_OFF:-${SET_AB/=true/=false}}"; [[ $off == "$SET_AB" ]] && off=""
  # AB_SIDES: the order of the sides, e.g. "on off off on" (ABBA: at 3e491a3 the same code differed by 5-21 % between
  # two single-rep invocations, so one pair decides little); with it each side's files get its position (-1, -2, ...).
  # AB_REPS: timed runs per cell (1)
  i=0
  for side in ${AB_SIDES:-on off}; do
    i=$((i + 1)); tag=$side; [[ -n ${AB_SIDES:-} ]] && tag=$side-$i
    extra=(); [[ $side == on ]] && extra=(--set "${SET_AB:?}"); [[ $side == off && -n $off ]] && extra=(--set "$off")
    # each side ends (and is tarred) before the call's limit (cap); with under a minute left no side starts
    (( $(cap 60) < 60 )) && { echo "set_ab: side $tag skipped, the call's limit is near" >> "$RES/set-ab-skipped.txt"; continue; }
    timeout $(cap ${DECODE_TIMEOUT:-200}) moe-offload bench decode --config ${TTFT_CONFIG:-configs/qwen3-30b-a3b-nvfp4.yaml} \
      --set model.cache_dir=/tmp/moe-cache "${extra[@]}" --residency ${AB_RESIDENCY:-1} --batch ${AB_BATCH:-1,16,64} \
      --steps 64 --reps ${AB_REPS:-1} --peers none --git-sha ${SERVE_CHECK_SHA:-unknown}-$tag --out "$RES/set-ab-$tag" \
      --json > "$RES/set-ab-$tag.json" 2> "$RES/set-ab-$tag.log"
    tar czf "$OUT/results.tgz" -C "$RES" .
  done
fi
if has lookahead; then  # decode.lookahead off, then on: its GPU tests, then bench decode at LOOKAHEAD_RESIDENCIES x 1/4/16 (~4 min)
  timeout 180 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_lookahead_gpu.py > "$RES/pytest_lookahead.log" 2>&1
  for la in false true; do
    timeout ${DECODE_TIMEOUT:-300} moe-offload bench decode --config ${TTFT_CONFIG:-configs/qwen3-30b-a3b-nvfp4.yaml} \
      --set model.cache_dir=/tmp/moe-cache --set decode.lookahead=$la --residency ${LOOKAHEAD_RESIDENCIES:-0.37} \
      --batch 1,4,16 --steps 64 --reps 1 --peers none --git-sha ${SERVE_CHECK_SHA:-unknown} --out "$RES/lookahead-$la" \
      --json > "$RES/lookahead-$la.json" 2> "$RES/lookahead-$la.log"
    tar czf "$OUT/results.tgz" -C "$RES" .
  done
fi
if has decode_paths; then  # decode.path routed vs auto (large batches staged) at low residency, same session (~2 x 2 min)
  for dp in routed auto; do
    timeout ${DECODE_TIMEOUT:-300} moe-offload bench decode --config ${TTFT_CONFIG:-configs/qwen3-30b-a3b-nvfp4.yaml} \
      --set model.cache_dir=/tmp/moe-cache --set decode.path=$dp --residency ${DECODE_PATHS_RESIDENCIES:-0.1,0.37} \
      --batch 16,32,64 --steps 32 --reps 1 --peers none --git-sha ${SERVE_CHECK_SHA:-unknown} \
      --out "$RES/decode-path-$dp" --json > "$RES/decode-path-$dp.json" 2> "$RES/decode-path-$dp.log"
    tar czf "$OUT/results.tgz" -C "$RES" .
  done
fi
if has decode_attn; then
  timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_decode_attention_gpu.py \
    tests/gpu/test_decode_kernels_gpu.py tests/gpu/test_decode_gpu.py tests/gpu/test_kv_write_gpu.py \
    tests/gpu/test_serve_graph_gpu.py > "$RES/pytest_decode_attn.log" 2>&1
  timeout 120 python3 benchmarks/decode_attention.py --out "$RES" --git-sha ${SERVE_CHECK_SHA:-unknown} \
    > "$RES/decode_attention.log" 2>&1
  for da in sdpa triton; do
    timeout ${DECODE_TIMEOUT:-300} moe-offload bench decode --config ${TTFT_CONFIG:-configs/qwen3-30b-a3b-nvfp4.yaml} \
      --set model.cache_dir=/tmp/moe-cache --set compute.decode_attention=$da --residency ${DECODE_ATTN_RESIDENCIES:-1,0.37} \
      --batch 1,4,16,64 --steps 64 --reps 1 --peers none --git-sha ${SERVE_CHECK_SHA:-unknown} \
      --out "$RES/decode-attn-$da" --json > "$RES/decode-attn-$da.json" 2> "$RES/decode-attn-$da.log"
    tar czf "$OUT/results.tgz" -C "$RES" .
  done
fi
if has check_serve; then  # bench serve per residency (~2-5 min each), then serve_targets over what this machine holds
  for r in ${SERVE_CHECK_RESIDENCIES:-0.37 1.0}; do
    # 128 tokens: at 64 clients the prompts are prefilled one at a time (64 x 90-200 ms), so with the 64 tokens
    # of the edd2da4 run no decode step held all 64 rows; 128-step streams outlast the admissions
    timeout ${SERVE_TIMEOUT:-400} moe-offload bench serve --config ${TTFT_CONFIG:-configs/qwen3-30b-a3b-nvfp4.yaml} \
      --set model.cache_dir=/tmp/moe-cache --set cache.budget=$r --clients 1,4,16,64 --requests-per-client 5,2,1,1 \
      --prompt-lens 1024 --max-tokens 128 --set serve.max_batch=64 --set decode.max_tokens=64 \
      --set decode.max_cache_len=1152 --decode-reference ${SERVE_CHECK_ARGS:-} --git-sha ${SERVE_CHECK_SHA:-unknown} \
      --out "$RES/check-serve-r$r" --json > "$RES/check-serve-r$r.json" 2> "$RES/check-serve-r$r.log"
    tar czf "$OUT/results.tgz" -C "$RES" .
  done
  # levels carry their same-run decode reference (--decode-reference); check-decode.json only adds its sha
  python3 benchmarks/serve_targets.py --serve $(ls "$RES"/check-serve-r*.json) \
    $([[ -s "$RES/check-decode.json" ]] && echo --decode "$RES/check-decode.json") --out "$RES/check" > "$RES/check-targets.log" 2>&1
  tar czf "$OUT/results.tgz" -C "$RES" .
fi
if has soak_bg; then
  for r in ${SOAK_RESIDENCIES:-0.1 0.5}; do
    mkdir -p "$RES/soak-r$r"
    OMP_NUM_THREADS=${SOAK_THREADS:-4} setsid nohup timeout ${SOAK_TIMEOUT:-1500} moe-offload bench soak --config ${TTFT_CONFIG:-configs/qwen3-30b-a3b-nvfp4.yaml} \
      --set model.cache_dir=/tmp/moe-cache --residencies $r ${SOAK_ARGS:-} --out "$RES/soak-r$r" --json \
      > "$RES/soak-r$r/soak.json" 2> "$RES/soak-r$r/soak.log" < /dev/null &
    echo $! >> /tmp/soak.pids
  done
  sleep 5; echo "soak_bg started: $(cat /tmp/soak.pids | tr '\n' ' ')" > "$RES/soak_bg.log"
fi
if has soak; then  # SOAK_ARGS: --residencies ... --minutes ...
  timeout ${SOAK_TIMEOUT:-560} moe-offload bench soak --config ${TTFT_CONFIG:-configs/qwen3-30b-a3b-nvfp4.yaml} \
    --set model.cache_dir=/tmp/moe-cache ${SOAK_ARGS:-} --out "$RES" --json > "$RES/soak.json" 2> "$RES/soak.log"
  tar czf "$OUT/results.tgz" -C "$RES" .
fi
if has soak_wait; then
  t0=$(date +%s); until=${SOAK_UNTIL:-$(( t0 + ${SOAK_WAIT_S:-560} ))}  # SOAK_UNTIL: an epoch second (a call's deadline)
  for pid in $(cat /tmp/soak.pids 2>/dev/null); do
    while kill -0 "$pid" 2>/dev/null && (( $(date +%s) < until )); do sleep 5; done
  done
  { echo "soak_wait $(( $(date +%s) - t0 )) s"; for pid in $(cat /tmp/soak.pids 2>/dev/null); do
    kill -0 "$pid" 2>/dev/null && echo "$pid still running" || echo "$pid done"; done; } >> "$RES/soak_bg.log"
  tar czf "$OUT/results.tgz" -C "$RES" .
fi
if has serve_overhead; then  # ~2 min at 48 layers
  timeout ${OVERHEAD_TIMEOUT:-300} python3 benchmarks/serve_overhead.py --config ${TTFT_CONFIG:-configs/qwen3-30b-a3b-nvfp4.yaml} \
    --set model.cache_dir=/tmp/moe-cache --set cache.budget=${OVERHEAD_RESIDENCY:-1.0} --set serve.max_batch=64 \
    --set decode.max_tokens=64 --set decode.max_cache_len=1152 ${OVERHEAD_ARGS:-} --profile "$RES/serve-overhead-prof" --out "$RES" \
    > "$RES/serve_overhead.log" 2>&1
  tar czf "$OUT/results.tgz" -C "$RES" .
fi
if has ttft_ab; then  # bench ttft with --set TTFT_AB, then TTFT_AB_OFF, in the order of AB_SIDES (default "on off off
  # on"), same machine; TTFT_AB_ARGS (default: 16 / 64 / 256 tokens at residency 0 / 0.37, 3 reps). The first use is
  # issue 14's routed fills on a slow-SM host: TTFT_AB=prefill.routed_copy=copy_engine TTFT_AB_OFF=prefill.routed_copy=uva
  # (~40 s a side after a build)
  i=0
  for side in ${AB_SIDES:-on off off on}; do
    i=$((i + 1)); tag=$side-$i
    (( $(cap 60) < 60 )) && { echo "ttft_ab: side $tag skipped, the call's limit is near" >> "$RES/ttft-ab-skipped.txt"; continue; }
    [[ $side == on ]] && set_arg="${TTFT_AB:?}" || set_arg="${TTFT_AB_OFF:?}"
    timeout $(cap ${TTFT_TIMEOUT:-200}) moe-offload bench ttft --config ${TTFT_CONFIG:-configs/qwen3-30b-a3b-nvfp4.yaml} \
      --set model.cache_dir=/tmp/moe-cache --set "$set_arg" \
      ${TTFT_AB_ARGS:---prompt-lens 16,64,256 --residency 0,0.37 --modes gather --reps 3 --peers none} \
      --git-sha ${SERVE_CHECK_SHA:-unknown}-$tag --out "$RES/ttft-ab-$tag" --json > "$RES/ttft-ab-$tag.json" \
      2> "$RES/ttft-ab-$tag.log"
    tar czf "$OUT/results.tgz" -C "$RES" .
  done
fi
if has decode_overlap; then
  timeout $(cap 240) python3 benchmarks/decode_overlap.py --out "$RES/decode-overlap" --git-sha ${SERVE_CHECK_SHA:-unknown} \
    > "$RES/decode-overlap.log" 2>&1
  tar czf "$OUT/results.tgz" -C "$RES" .
fi
if has fill_profile; then
  for copy in ${FILL_PROFILE_COPIES:-copy_engine uva}; do
    (( $(cap 60) < 60 )) && { echo "fill_profile: $copy skipped, the call's limit is near" >> "$RES/fill-profile-skipped.txt"; continue; }
    timeout $(cap 200) python3 benchmarks/profile_prefill.py --config ${TTFT_CONFIG:-configs/qwen3-30b-a3b-nvfp4.yaml} \
      --set model.cache_dir=/tmp/moe-cache --set prefill.routed_copy=$copy --tokens ${FILL_PROFILE_TOKENS:-16} \
      --residency 0.37,0 --reps 3 --trace --host-splits ${FILL_PROFILE_ARGS:-} \
      --out "$RES/fill-profile-$copy-${FILL_PROFILE_TOKENS:-16}${FILL_PROFILE_TAG:-}" \
      > "$RES/fill-profile-$copy-${FILL_PROFILE_TOKENS:-16}${FILL_PROFILE_TAG:-}.log" 2>&1
    tar czf "$OUT/results.tgz" -C "$RES" .
  done
fi
if has observed; then  # observed routing (prefill path auto) vs staged at short prompts (~2 min)
  timeout ${TTFT_TIMEOUT:-300} moe-offload bench ttft --config ${TTFT_CONFIG:-configs/qwen3-30b-a3b-nvfp4.yaml} \
    --set model.cache_dir=/tmp/moe-cache --prompt-lens 16,64,256,1024 --residency 0.37,0.5 --modes gather \
    --prefill-path auto,staged --reps 3 --peers none --git-sha ${SERVE_CHECK_SHA:-unknown} --out "$RES/observed" \
    --json > "$RES/observed.json" 2> "$RES/observed.log"
  tar czf "$OUT/results.tgz" -C "$RES" .
fi
if has flash; then  # ~4 min of build beside nothing, ~3 min of benches
  F="--config configs/flash-next-nvfp4.yaml --set model.cache_dir=/tmp/moe-cache"
  timeout ${BUILD_TIMEOUT:-400} python3 -c "from moe_offload.config import load_config; from moe_offload.engine import ensure_checkpoint; ensure_checkpoint(load_config('configs/flash-next-nvfp4.yaml', ['model.cache_dir=/tmp/moe-cache', 'model.layers=${FLASH_LAYERS:-8}']).model, False)" > "$RES/flash-build.log" 2>&1
  timeout ${DECODE_TIMEOUT:-200} moe-offload bench decode $F --layers ${FLASH_LAYERS:-8} --residency 0.37,1 --batch 1 \
    --steps 64 --reps 1 --peers none --git-sha ${SERVE_CHECK_SHA:-unknown} --out "$RES/flash" --json > "$RES/flash-decode.json" 2> "$RES/flash-decode.log"
  tar czf "$OUT/results.tgz" -C "$RES" .
  timeout ${TTFT_TIMEOUT:-300} moe-offload bench ttft $F --layers ${FLASH_LAYERS:-8} --prompt-lens 16,64,256,1024 \
    --residency 0,0.37,0.5,0.75 --modes gather --prefill-path staged,routed --reps 3 --peers none \
    --git-sha ${SERVE_CHECK_SHA:-unknown} --out "$RES/flash" --json > "$RES/flash-ttft.json" 2> "$RES/flash-ttft.log"
  tar czf "$OUT/results.tgz" -C "$RES" .
fi
if has fused_tune; then  # fused NVFP4 MoE tiles for this GPU (swapped kernels by default; prefill sizes with the dequant
  # comparison compute.backend auto reads, then decode 16-64 rows beside the GEMV); TUNE_SHAPES (qwen3-30b-a3b, flash-next);
  # tables copied to $OUT (commit them). Measured at 1ee779e: ~4 min for qwen3-30b-a3b at 5 prefill and 5 decode sizes
  timeout ${TUNE_FUSED_TIMEOUT:-300} python3 benchmarks/tune_fused_moe.py --shapes ${TUNE_SHAPES:-qwen3-30b-a3b} \
    --tokens ${TUNE_FUSED_TOKENS:-128 1024 8192} --block-ms ${TUNE_FUSED_BLOCK_MS:-32 64 128} \
    --layouts ${TUNE_FUSED_LAYOUTS:-swap} > "$RES/tune_fused.log" 2>&1
  cp kernels/fused_moe_tuning.json "$RES/"; tar czf "$OUT/results.tgz" -C "$RES" .
  timeout ${TUNE_MOE_TIMEOUT:-240} python3 benchmarks/tune_decode_moe.py --shapes ${TUNE_SHAPES:-qwen3-30b-a3b} --tokens ${TUNE_MOE_TOKENS:-16 32 64} \
    --layouts ${TUNE_FUSED_LAYOUTS:-swap} > "$RES/tune_moe.log" 2>&1
  cp kernels/decode_moe_tuning.json "$RES/"; tar czf "$OUT/results.tgz" -C "$RES" .
  mkdir -p /tmp/tables; cp kernels/fused_moe_tuning.json kernels/decode_moe_tuning.json /tmp/tables/  # for tables_back
fi
# tables_back: a later call on the same warm machine gets the tables fused_tune wrote (the call's tree has the old ones)
if has prefill_graphs; then  # prefill.cuda_graphs on vs off (moe_offload/prefill_graph.py), same machine (~2 x 1-2 min)
  for pg in true false; do
    timeout ${TTFT_TIMEOUT:-240} moe-offload bench ttft --config ${TTFT_CONFIG:-configs/qwen3-30b-a3b-nvfp4.yaml} \
      --set model.cache_dir=/tmp/moe-cache --set prefill.cuda_graphs=$pg --prompt-lens ${PG_LENS:-16,64,256,1024} \
      --residency ${PG_RESIDENCIES:-0.37,1} --modes gather --reps 3 --peers ${PG_PEERS:-none} \
      --git-sha ${SERVE_CHECK_SHA:-unknown} --out "$RES/prefill-graphs-$pg" --json > "$RES/prefill-graphs-$pg.json" \
      2> "$RES/prefill-graphs-$pg.log"
    tar czf "$OUT/results.tgz" -C "$RES" .
    [ -n "${PG_ONLY_ON:-}" ] && break
  done
fi
if has piecewise; then  # prefill.piecewise_graphs on vs off (staged prefills captured per stretch), same machine
  for pw in true false; do
    timeout ${TTFT_TIMEOUT:-240} moe-offload bench ttft --config ${TTFT_CONFIG:-configs/qwen3-30b-a3b-nvfp4.yaml} \
      --set model.cache_dir=/tmp/moe-cache --set prefill.piecewise_graphs=$pw ${PW_ARGS:-} --prompt-lens ${PW_LENS:-1024} \
      --residency ${PW_RESIDENCIES:-0,0.37,0.5,0.75} --modes gather --reps ${PW_REPS:-3} --peers none \
      --git-sha ${SERVE_CHECK_SHA:-unknown} --out "$RES/piecewise-$pw" --json > "$RES/piecewise-$pw.json" \
      2> "$RES/piecewise-$pw.log"
    tar czf "$OUT/results.tgz" -C "$RES" .
  done
fi
if has flash_ttft; then  # Flash-Next at FLASH_LAYERS (8): build (~135-150 s alone), then bench ttft 1024 tokens staged at
  # FLASH_RESIDENCIES (0,0.37,0.5,0.75; ~60 s); what issue 14's 512-expert cells were measured with at 071bfc1-5fbdf1e
  timeout ${BUILD_TIMEOUT:-400} python3 -c "from moe_offload.config import load_config; from moe_offload.engine import ensure_checkpoint; ensure_checkpoint(load_config('configs/flash-next-nvfp4.yaml', ['model.cache_dir=/tmp/moe-cache', 'model.layers=${FLASH_LAYERS:-8}']).model, False)" > "$RES/flash-build.log" 2>&1
  timeout ${TTFT_TIMEOUT:-200} moe-offload bench ttft --config configs/flash-next-nvfp4.yaml --set model.cache_dir=/tmp/moe-cache \
    --layers ${FLASH_LAYERS:-8} --prompt-lens 1024 --residency ${FLASH_RESIDENCIES:-0,0.37,0.5,0.75} --modes gather \
    --prefill-path staged --reps 3 --peers none --git-sha ${SERVE_CHECK_SHA:-unknown} --out "$RES/flash-ttft" --json \
    > "$RES/flash-ttft.json" 2> "$RES/flash-ttft.log"
  tar czf "$OUT/results.tgz" -C "$RES" .
fi
has tables_back && cp /tmp/tables/*.json kernels/
if has compute_ab; then  # compute.backend auto (fused kernels where the table measured them faster) vs torch, same machine
  for cb in auto torch; do
    timeout ${TTFT_TIMEOUT:-200} moe-offload bench ttft --config ${TTFT_CONFIG:-configs/qwen3-30b-a3b-nvfp4.yaml} \
      --set model.cache_dir=/tmp/moe-cache --set compute.backend=$cb --prompt-lens ${COMPUTE_AB_LENS:-256,1024,4096} \
      --residency ${COMPUTE_AB_RESIDENCIES:-1} --modes gather --reps 3 --peers none --git-sha ${SERVE_CHECK_SHA:-unknown} \
      --out "$RES/compute-$cb" --json > "$RES/compute-$cb.json" 2> "$RES/compute-$cb.log"
    tar czf "$OUT/results.tgz" -C "$RES" .
  done
fi
has copy && timeout 180 python3 benchmarks/copy_paths.py --out "$RES" > "$RES/copy_paths.log" 2>&1
has fused && timeout 180 python3 benchmarks/fused_moe.py --out "$RES" > "$RES/fused_moe.log" 2>&1
tar czf "$OUT/results.tgz" -C "$RES" .
cp "$RES"/*.log "$OUT/" 2>/dev/null; ls -la "$RES"
