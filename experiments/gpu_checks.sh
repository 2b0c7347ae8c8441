#!/usr/bin/env bash
# The GPU measurements issue 17 still lists, as steps one device call can hold (each well
# under the 600 s a call may run). Run through a bundle (experiments/gpu_bundle.py), which
# sets SPECJAX_CACHE and SPECJAX_DATA_DIR; results go to $OUT (8 files at most come back).
#
#   bash experiments/gpu_checks.sh STEP [STEP ...]     STEP: forward, fixed, profile,
#                                                      adaptive, dispatch, loops, all
#
#   forward   issue 17's step-cost table in bf16 (experiments/bench_gpu.py, steps timed as host
#             calls and inside a jitted loop, AR decoding against the HBM roofline) for
#             FORWARD_MODELS (default: SmolLM2's real weights, random-init 1.5B and 8B
#             shapes). The shapes need no bundle, so they can run in the call that carries
#             the bundle's first part (FORWARD_MODELS=shape:llama-8b,shape:qwen2-1.5b).
#             FORWARD_DRAFTS names the draft rows to time (bench_gpu.py --drafts; fewer
#             rows compile sooner: a model's rows took 74-81 s per timing mode on an H200)
#   fixed     the device-loop drafters end to end in --dtype mixed: 0 mismatches now that
#             float32 dots ask for HIGHEST precision (efe3747), and FR-Spec's selection
#             share now that its head rows are gathered once (a94978f)
#   profile   KnapSpec's latency profile at two cache sizes (what `adaptive` and `loops`
#             read; a profile saved by an older specjax is refused: measure it here), or
#             with PROFILE_FROM=FILE the one a past run printed (the last line of
#             `specjax profile`, whole since 2026-11-27), saved where KnapSpec looks
#   adaptive  `profile`, then SWIFT, CLaSp and KnapSpec end to end (their plans change per
#             round: traced)
#   dispatch  `profile`, then the same drafters with their plans as host data
#             (SPECJAX_PLAN_PATH=dispatch: a program per sub-layer, no conditional), to set
#             beside `adaptive` (issue 85: the default per backend is chosen from these)
#   loops     CLaSp, SWIFT, KnapSpec and 8bit with the host loop against the device loop
#             (the adaptive drafters run their rounds between selections there since
#             2026-11-27; experiments/bench_loops.py, --dtype mixed): same tokens, the
#             speed ratio, AR on the same prompts. After `profile`, which KnapSpec reads
#
# Each step's time limit in seconds can be lowered to fit a lease: FIXED_S, PROFILE_S,
# ADAPTIVE_S, LOOPS_S, FORWARD_S. CUDA-graph conditionals were measured and dropped
# (docs/decisions/gpu.md, G1).
set -uo pipefail
MODEL=${MODEL:-smollm2-135m-instruct}
OUT=${OUT:-/tmp/gpu-checks}
RUNS=${RUNS:-/tmp/gpu-checks-runs}  # bench folders stay here; their results are copied to $OUT
# Overridable for a smoke run on a CPU: CATEGORIES, MAX_NEW_TOKENS, FIXED, ADAPTIVE.
PROMPTS=(--per-category 1 --max-turns 1 --max-new-tokens "${MAX_NEW_TOKENS:-64}"
         --categories "${CATEGORIES:-writing,roleplay,reasoning,math,coding,extraction}")
mkdir -p "$OUT" "$RUNS"
log() { echo "[gpu_checks $(date +%T)] $*" | tee -a "$OUT/checks.log"; }

bench() {  # NAME DRAFTERS SECONDS
  local dir="$RUNS/$1"
  mkdir -p "$dir"
  cp "$SPECJAX_CACHE"/plans/*.json "$dir"/ 2>/dev/null || true  # carried Self-SD plans
  log "bench $1: $2"
  timeout "$3" python3 -m specjax.cli bench --model "$MODEL" --dtype mixed --drafters "$2" \
    "${PROMPTS[@]}" --out "$dir" --resume 2>&1 | tail -n 25 | tee -a "$OUT/checks.log"
  cp "$dir/results.jsonl" "$OUT/bench-$1.jsonl" 2>/dev/null
  cp "$dir/summary.md" "$OUT/bench-$1.md" 2>/dev/null
  return 0
}

forward() {  # NAME XLA_FLAGS MODELS SECONDS
  log "bench_gpu $1: $3 (XLA_FLAGS=$2)"
  # specjax from this checkout: without a bundle, nothing else puts it on the path
  PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_FLAGS="$2" timeout "$4" \
    python3 -m experiments.bench_gpu --models "$3" --repeats 5 --chain 10 --loop-steps 32 \
    ${FORWARD_DRAFTS:+--drafts "$FORWARD_DRAFTS"} --out "$OUT/forward-$1.jsonl" 2>&1 \
    | grep -v '%|' | tail -n 45 | tee -a "$OUT/checks.log"
}

step() {
  case "$1" in
    fixed) bench fixed "${FIXED:-8bit,frspec,dynaspec,self_sd,early_exit}" "${FIXED_S:-420}" ;;
    forward)
      nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw,memory.used \
        --format=csv 2>&1 | tee -a "$OUT/checks.log"
      forward bf16 "" "${FORWARD_MODELS:-$MODEL,shape:qwen2-1.5b,shape:llama-8b}" \
        "${FORWARD_S:-420}" ;;
    profile)
      if [ -n "${PROFILE_FROM:-}" ]; then
        log "profile from $PROFILE_FROM"
        python3 -c 'import json, sys
from specjax.selection import profiler as p
line = open(sys.argv[1]).read().strip().splitlines()[-1]
print(p.save_profile(p.LatencyProfile.from_json(json.loads(line))))' "$PROFILE_FROM" \
          2>&1 | tee -a "$OUT/checks.log"
      else
        log "profile"
        timeout "${PROFILE_S:-150}" python3 -m specjax.cli profile --model "$MODEL" \
          --dtype mixed --lengths 256,512 > "$OUT/profile.json" 2>> "$OUT/checks.log"
      fi ;;
    adaptive)
      step profile
      bench adaptive "${ADAPTIVE:-swift,clasp,knapspec}" "${ADAPTIVE_S:-400}" ;;
    dispatch)
      step profile
      SPECJAX_PLAN_PATH=dispatch bench dispatch "${ADAPTIVE:-swift,clasp,knapspec}" \
        "${ADAPTIVE_S:-400}" ;;
    loops)
      log "bench_loops"
      timeout "${LOOPS_S:-400}" python3 -m experiments.bench_loops --model "$MODEL" \
        --dtype mixed --drafters "${LOOPS:-clasp,swift,knapspec,8bit}" --repeats 2 2>&1 \
        | grep -v '%|' | tail -n 8 | tee -a "$OUT/checks.log" "$OUT/loops.txt" ;;
    all) step fixed; step adaptive ;;
    *) echo "unknown step '$1' (forward, fixed, profile, adaptive, dispatch, loops, all)" >&2
       exit 2 ;;
  esac
}

[ $# -gt 0 ] || set -- all
for s in "$@"; do step "$s"; done
log "done"
python3 -c 'import json, os, sys; print(json.dumps({"steps": sys.argv[2:], "out": sys.argv[1],
  "files": sorted(os.listdir(sys.argv[1]))}))' "$OUT" "$@"
