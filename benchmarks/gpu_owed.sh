#!/usr/bin/env bash
# README "GPU runs still owed", picked by the kind of host that came: one lent-GPU call per invocation, in order,
# on one machine (chain the calls at once: /tmp/res, /tmp/moe-cache and link.json live only while it is held).
# Usage on the device: SERVE_CHECK_SHA=<sha> bash benchmarks/gpu_owed.sh 1   (then 2, 3, ...)
#   call 1 (any host): the link stage (which kind of host: benchmarks/link_probe.py), the TMA probe
#           (benchmarks/tma_probe.py, seconds), decode.miss_copy tma's GPU tests, then the build where a later call
#           needs it (owed 7);
#   call 2 (any host): decode.miss_copy tma against uva in bench decode, ABBA, residency 0.5, batch 16 / 64 (owed 7);
#   call 3 (any host): the same in bench ttft, 16 / 64 / 256 tokens at residency 0 / 0.37, ABBA (owed 7);
#           calls 2-3 end at once unless the probe's production miss copy (its miss_copy entry) through the TMA was
#           right and faster than with plain loads (a copy no faster in isolation cannot make a step faster);
#   call 4: slow SM reads: routed fills against SM reads at 16 / 64 / 256 tokens, ABBA (owed 1);
#   call 5: slow: decode.path host against routed at residency 0.37, batch 16 / 32 / 64, with the link tests (owed 2);
#   call 6: slow: decode.path fills against host at residency 0.5, batch 8 / 16 / 32 (owed 3), then fill_profile (4).
#   Fast SM reads: calls 4-6 say nothing more is owed there and end. (The graph plan's run, owed 6, was done at
#   700c00c / 55d8348 on a fast H100: HISTORY.md "700c00c".)
# Each call ends within the device's 10 minutes (gpu_run.sh caps every stage); results in $OUT/results.tgz.
set -uo pipefail
call="${1:?call number: 1-6}"
kind() {  # slow / fast / unknown, from the link stage's report of this machine
  python3 -c "import json; d=json.load(open('/tmp/res/link.json')); print({True: 'slow', False: 'fast'}.get(d['slow'], 'unknown'))" \
    2>/dev/null || echo unknown
}
# run N stage...: gpu_run.sh with at most N seconds of this call (its stages end, and are tarred, within them)
run() { local n=$1; shift; local left=$(( 590 - SECONDS )); (( n > left )) && n=$left
  CALL_LIMIT_S=$n bash benchmarks/gpu_run.sh "$@"; }
tma_pays() {  # whether the probe's production copy through the TMA copied right and ran faster than plain loads
  python3 -c "import json,sys; m=json.load(open('/tmp/res/tma_probe.json'))['miss_copy']; sys.exit(0 if m.get('tma_ok') and m.get('ldg_ok') and m['tma_GBps'] > m['ldg_GBps'] else 1)" \
    2>/dev/null
}
if [[ $call == 1 ]]; then
  PYTEST_PATHS=tests/gpu/test_miss_copy_tma_gpu.py run 590 link tma_probe tests
  k=$(kind); echo "host: $k"
  # the build (~160 s) serves only the calls that follow: the TMA A/Bs where the probe says they can pay, and the
  # slow-host items
  if tma_pays || [[ $k == slow ]]; then run 590 build; else echo "no build: nothing owed here needs the checkpoint"; fi
  exit 0
fi
k=$(kind); echo "host: $k"
[[ -d /tmp/moe-cache ]] || { echo "no build on this machine (a fresh start?): run call 1 first"; exit 1; }
if [[ $call == 2 || $call == 3 ]]; then
  tma_pays || { echo "the TMA probe's miss copy was wrong, failed or no faster than plain loads here: no A/B to run"; exit 0; }
  if [[ $call == 2 ]]; then
    SET_AB=decode.miss_copy=tma SET_AB_OFF=decode.miss_copy=uva AB_SIDES="on off off on" AB_RESIDENCY=0.5 \
      AB_BATCH=16,64 AB_TESTS=tests/gpu/test_miss_copy_tma_gpu.py run 590 set_ab
  else
    TTFT_AB=decode.miss_copy=tma TTFT_AB_OFF=decode.miss_copy=uva run 590 ttft_ab
  fi
elif [[ $k != slow ]]; then
  echo "$k host: nothing more is owed after call 3 (README \"GPU runs still owed\")"
elif [[ $call == 4 ]]; then
  TTFT_AB=prefill.routed_copy=copy_engine TTFT_AB_OFF=prefill.routed_copy=uva run 590 ttft_ab
elif [[ $call == 5 ]]; then
  SET_AB=decode.path=host SET_AB_OFF=decode.path=routed AB_SIDES="on off" AB_RESIDENCY=0.37 AB_BATCH=16,32,64 \
    AB_TESTS=tests/gpu/test_link_rates_gpu.py run 590 set_ab
elif [[ $call == 6 ]]; then
  SET_AB=decode.path=fills SET_AB_OFF=decode.path=host AB_SIDES="on off" AB_RESIDENCY=0.5 AB_BATCH=8,16,32 \
    AB_TESTS=tests/gpu/test_link_rates_gpu.py run 430 set_ab
  FILL_PROFILE_COPIES=copy_engine run 590 fill_profile
fi
