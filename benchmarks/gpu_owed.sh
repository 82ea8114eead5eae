#!/usr/bin/env bash
# README "GPU runs still owed", picked by the kind of host that came: one lent-GPU call per invocation, in order,
# on one machine (chain the calls at once: /tmp/res, /tmp/moe-cache and link.json live only while it is held).
# Usage on the device: SERVE_CHECK_SHA=<sha> bash benchmarks/gpu_owed.sh 1   (then 2, 3, 4)
#   call 1 (any host): the link stage (which kind of host: benchmarks/link_probe.py), the TMA probe (seconds: its
#           miss_copy_row_align entry times 16-byte rows, page rows (owed 8, done at 1631575) and page rows in
#           huge-page memory (owed 9, done at d87958f)), then on a slow-SM host the build;
#   call 2: slow SM reads: routed fills against SM reads at 16 / 64 / 256 tokens, ABBA (owed 1);
#   call 3: slow: decode.path host against routed at residency 0.37, batch 16 / 32 / 64, with the link tests (owed 2);
#   call 4: slow: decode.path fills against host at residency 0.5, batch 8 / 16 / 32 (owed 3), then fill_profile (4).
#   Fast SM reads: calls 2-4 say nothing more is owed there and end. (The graph plan's run, owed 6, was done at
#   700c00c / 55d8348 on a fast H100: HISTORY.md "700c00c"; the TMA probe, owed 7, at fdd1739: HISTORY.md "fdd1739".)
# Each call ends within the device's 10 minutes (gpu_run.sh caps every stage); results in $OUT/results.tgz.
set -uo pipefail
call="${1:?call number: 1-4}"
kind() {  # slow / fast / unknown, from the link stage's report of this machine
  python3 -c "import json; d=json.load(open('/tmp/res/link.json')); print({True: 'slow', False: 'fast'}.get(d['slow'], 'unknown'))" \
    2>/dev/null || echo unknown
}
# run N stage...: gpu_run.sh with at most N seconds of this call (its stages end, and are tarred, within them)
run() { local n=$1; shift; local left=$(( 590 - SECONDS )); (( n > left )) && n=$left
  CALL_LIMIT_S=$n bash benchmarks/gpu_run.sh "$@"; }
if [[ $call == 1 ]]; then
  run 590 link tma_probe
  k=$(kind); echo "host: $k"
  if [[ $k == slow ]]; then run 590 build; else echo "$k host: nothing more is owed here (README \"GPU runs still owed\")"; fi
  exit 0
fi
k=$(kind); echo "host: $k"
if [[ $k != slow ]]; then
  echo "$k host: nothing more is owed here after call 1 (README \"GPU runs still owed\")"; exit 0
fi
[[ -d /tmp/moe-cache ]] || { echo "no build on this machine (a fresh start?): run call 1 first"; exit 1; }
if [[ $call == 2 ]]; then
  TTFT_AB=prefill.routed_copy=copy_engine TTFT_AB_OFF=prefill.routed_copy=uva run 590 ttft_ab
elif [[ $call == 3 ]]; then
  SET_AB=decode.path=host SET_AB_OFF=decode.path=routed AB_SIDES="on off" AB_RESIDENCY=0.37 AB_BATCH=16,32,64 \
    AB_TESTS=tests/gpu/test_link_rates_gpu.py run 590 set_ab
elif [[ $call == 4 ]]; then
  SET_AB=decode.path=fills SET_AB_OFF=decode.path=host AB_SIDES="on off" AB_RESIDENCY=0.5 AB_BATCH=8,16,32 \
    AB_TESTS=tests/gpu/test_link_rates_gpu.py run 430 set_ab
  FILL_PROFILE_COPIES=copy_engine run 590 fill_profile
fi
