#!/bin/bash
# Three demo jobs at once (each --gpus 0 --ranks 1, seeds 1..N) with
# DATA.CACHE_SHARING=MODE (node or job), under pss-tree; each job's summary.json
# holds its samples/s, PSNR and its cache server's figures (bytes_filled: bytes
# read from disk into the cache; with node, cache.sharing.this_job is the job's own).
# N=1 gives a job's speed alone. On a small machine give each job one thread
# (OMP_NUM_THREADS=1 in the environment) or the jobs' libtorch threads thrash.
#   scripts/shared_cache_jobs.sh MODE DATA_ROOT OUT [STEPS=100] [N=3]
# DATA_ROOT: vrtspike synth --out DIR --seqs 12 --test-seqs 4 --frames 12 (the demo set).
set -euo pipefail
MODE=$1; DATA=$(realpath "$2"); OUT=$3; STEPS=${4:-100}; N=${5:-3}
REPO=$(cd "$(dirname "$0")/.." && pwd)
PSS_TREE=${PSS_TREE:-$REPO/../shared/tools/pss-tree}
rm -rf "$OUT"; mkdir -p "$OUT"
jobs() {
  for s in $(seq 1 "$N"); do
    "$REPO/target/debug/vrtspike-launch" --config "$REPO/configs/demo/unet_spike_demo.yaml" \
      --run-dir "$OUT/job$s" --gpus 0 --ranks 1 --max-restarts 0 --cache-linger-s 2 \
      --no-plan-check --set "DATA.CACHE_SHARING=$MODE" --set "TRAIN.SEED=$s" \
      --set "TRAIN.TOTAL_STEPS=$STEPS" --set "DATA.ROOT=$DATA" > "$OUT/job$s.out" 2>&1 &
  done
  wait
}
export -f jobs; export REPO OUT N MODE STEPS DATA
"$PSS_TREE" --interval 0.5 --json "$OUT/pss.json" -- bash -c jobs
