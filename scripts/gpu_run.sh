#!/usr/bin/env bash
# The GPU run, from inside the GPU bundle (`make gpu-bundle`): everything issues 19
# and 34 measure on one GPU host, in one device call, each part under its own time
# limit so one hang cannot eat the call, one JSON per part and its log in OUT_DIR.
#
#   gpu-bundle/scripts/gpu_run.sh OUT_DIR [PART...]        # parts: info tests profile train reference
#   gpu-bundle/scripts/gpu_run.sh --smoke OUT_DIR [PART...] # the plumbing, on CPU, tiny
#
# Parts (default: all, in this order; about 6 minutes on one H100, so run it with
# DEADLINE_S=400 in a call of at most 7 minutes):
#   info       vrtspike info --json, nvidia-smi                            info.json
#   tests      the GPU test suite (make test-gpu's binary)                 tests.json, logs/tests.log
#   profile    vrtspike profile --device cuda --bf16, 6 frames x 256, with
#              activation checkpointing: the baseline VRT-Spike (the model
#              `train` trains) with whole training steps under the fused and
#              the per-parameter AdamW (the update's time), and the VRT GoPro
#              config with the fused one                                   profile-*.json
#   train      vrtspike-launch --gpus 1, the baseline with checkpointing on a
#              `vrtspike synth --gopro` set for TRAIN_STEPS steps (default
#              40), then a full-frame 720x1280 validation of 12 frames by
#              tiles (TRAIN_SETS: more KEY=VALUE settings, space-separated);
#              the run directory (no checkpoints) in train-run/             train-*.json
#   reference  the public VRT in PyTorch (baselines/vrt_reference_step.py on
#              vrt_ref/), same shape, checkpointing, whole training steps with
#              the fused AdamW: eager, then torch.compile (its compile time
#              apart)                                                      reference-*.json
# `nvidia-smi dmon` samples the SMs every second of the call into dmon.txt.
# parts.jsonl has one line per part (rc, seconds, limit); summary.txt the table;
# figures.txt the figures issue 34 asks for, computed from all of the above.
#
# DEADLINE_S (optional): the whole script's budget in seconds, for a device call with
# a hard limit. Each part's limit is cut to what is left of it (less RESERVE_S, 20 s
# by default, for the packing after it), and a part with under 10 s left is skipped
# and named as such, so whatever ran comes back instead of dying with the call.
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
run="$here/run-on-gpu.sh"
smoke=0
if [[ "${1:-}" == "--smoke" ]]; then
  smoke=1
  shift
fi
out=${1:?usage: gpu_run.sh [--smoke] OUT_DIR [PART...]}
shift
parts=("$@")
[[ ${#parts[@]} -gt 0 ]] || parts=(info tests profile train reference)
mkdir -p "$out/logs"
out=$(cd "$out" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/vrtspike-gpu-run.XXXXXX")
dmon_pid=
cleanup() {
  [[ -n "$dmon_pid" ]] && kill "$dmon_pid" 2> /dev/null
  rm -rf "$work"
}
trap cleanup EXIT
script_start=$(date +%s)
deadline=${DEADLINE_S:-0}
reserve=${RESERVE_S:-20}

# clip_limit LIMIT: LIMIT, or what is left of DEADLINE_S (less the reserve) if less.
clip_limit() {
  local limit=$1
  (( deadline > 0 )) || { echo "$limit"; return; }
  local left=$(( deadline - reserve - ($(date +%s) - script_start) ))
  (( left < limit )) && limit=$left
  echo "$limit"
}

if (( smoke )); then
  device=cpu; frames=3; size=32; iters=1; precision=()
  baseline=configs/tiny/vrt_spike_tiny.yaml; gopro=configs/tiny/vrt_spike_tiny.yaml
  train_steps=${TRAIN_STEPS:-3}
else
  device=cuda; frames=6; size=256; iters=3; precision=(--bf16)
  baseline=configs/deblur/vrt_spike_baseline.yaml; gopro=configs/deblur/vrt_gopro_deblur.yaml
  train_steps=${TRAIN_STEPS:-40}
fi
ckpt=(--set MODEL.USE_CHECKPOINT_ATTN=true --set MODEL.USE_CHECKPOINT_FFN=true)

# part NAME LIMIT_S JSON_OUT COMMAND...: runs COMMAND under `timeout` with its stdout
# in JSON_OUT (or the log when JSON_OUT is -) and stderr in logs/NAME.log.
part() {
  local name=$1 limit json=$3
  limit=$(clip_limit "$2")
  shift 3
  if (( limit < 10 )); then
    printf '{"part": "%s", "rc": -1, "seconds": 0, "limit_s": %d, "skipped": "DEADLINE_S reached"}\n' "$name" "$limit" >> "$out/parts.jsonl"
    printf '%-28s %8s   %s\n' "$name" "-" "skipped: DEADLINE_S=${deadline}s reached" | tee -a "$out/summary.txt"
    return 0
  fi
  local stdout="$out/logs/$name.out"
  [[ "$json" != "-" ]] && stdout="$out/$json"
  local start end rc
  start=$(date +%s.%N)
  (cd "$here" && timeout --kill-after=15 "$limit" "$@") > "$stdout" 2> "$out/logs/$name.log"
  rc=$?
  end=$(date +%s.%N)
  local seconds
  seconds=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", b - a }')
  local verdict=ok
  (( rc == 124 || rc == 137 )) && verdict="TIMED OUT after ${limit}s"
  (( rc != 0 && rc != 124 && rc != 137 )) && verdict="failed (exit $rc)"
  printf '{"part": "%s", "rc": %d, "seconds": %s, "limit_s": %d}\n' "$name" "$rc" "$seconds" "$limit" >> "$out/parts.jsonl"
  printf '%-28s %8ss  %s\n' "$name" "$seconds" "$verdict" | tee -a "$out/summary.txt"
  return 0
}

part_info() {
  part info 60 info.json "$run" vrtspike info --json
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit \
      --format=csv > "$out/nvidia-smi.csv" 2>> "$out/logs/info.log"
  fi
}

part_tests() {
  if (( smoke )); then
    echo "tests: skipped in --smoke (they need a GPU)" | tee -a "$out/summary.txt"
    return
  fi
  part tests 240 - "$run" gpu-tests --test-threads 1 --nocapture
  # The harness's own lines, as JSON: passed/failed counts and the failures' names.
  python3 - "$out/logs/tests.out" "$out/logs/tests.log" > "$out/tests.json" <<'EOF'
import json, re, sys
text = open(sys.argv[1]).read() + open(sys.argv[2]).read()
results = re.findall(r"^test (\S+) \.\.\. (ok|FAILED|ignored)", text, re.M)
summary = re.search(r"test result: (\w+)\. (\d+) passed; (\d+) failed", text)
print(json.dumps({
    "passed": [n for n, r in results if r == "ok"],
    "failed": [n for n, r in results if r == "FAILED"],
    "result": summary.group(1) if summary else "no summary (crashed or timed out)",
    "figures": re.findall(r"^(NCCL world 1.*|SDPA's choice.*)$", text, re.M),
}, indent=1))
EOF
}

part_profile() {
  local common=(--device "$device" --frames "$frames" --size "$size" --iters "$iters" "${precision[@]}" --json "${ckpt[@]}")
  part profile-baseline-ckpt 150 profile-baseline-ckpt.json "$run" vrtspike profile --config "$baseline" "${common[@]}" --optimizer fused,loop
  part profile-gopro-ckpt 150 profile-gopro-ckpt.json "$run" vrtspike profile --config "$gopro" "${common[@]}" --optimizer fused
}

# The reference imports `distutils.version`, gone from Python 3.12's standard library
# (setuptools usually puts it back); without it, a stand-in with LooseVersion.
reference_pythonpath() {
  local python=$1
  if (( ! smoke )) && "$python" -c 'from distutils.version import LooseVersion' 2> /dev/null; then
    return
  fi
  mkdir -p "$work/pyshim/distutils"
  : > "$work/pyshim/distutils/__init__.py"
  cat > "$work/pyshim/distutils/version.py" <<'EOF'
import re
class LooseVersion:
    def __init__(self, text):
        self.version = [int(p) if p.isdigit() else p for p in re.findall(r"\d+|[a-z]+", str(text))]
    def _key(self, other):
        return other.version if isinstance(other, LooseVersion) else LooseVersion(other).version
    def __lt__(self, other): return self.version < self._key(other)
    def __le__(self, other): return self.version <= self._key(other)
    def __gt__(self, other): return self.version > self._key(other)
    def __ge__(self, other): return self.version >= self._key(other)
    def __eq__(self, other): return self.version == self._key(other)
EOF
  echo "$work/pyshim"
}

part_reference() {
  if [[ ! -f "$here/vrt_ref/models/network_vrt.py" || ! -f "$here/baselines/vrt_reference_step.py" ]]; then
    echo "reference: skipped (the bundle has no vrt_ref/ or baselines/: make gpu-bundle VRT_REF=...)" | tee -a "$out/summary.txt"
    return
  fi
  local python
  python=$("$run" sh -c 'echo "$VRTSPIKE_TORCH_PYTHON"')
  local shim pythonpath
  shim=$(reference_pythonpath "$python")
  pythonpath="${shim:+$shim:}${PYTHONPATH:-}"
  local args=(--ref vrt_ref --device "$device" --frames "$frames" --size "$size" --iters "$iters")
  (( smoke )) || args+=(--bf16)
  if (( smoke )); then
    # The smoke's python may lack torchvision and einops: check the plumbing only
    # (torch found, the reference parses, the distutils stand-in works).
    part reference-import 120 - env PYTHONPATH="$pythonpath" "$python" -c '
import ast, torch
from distutils.version import LooseVersion
ast.parse(open("vrt_ref/models/network_vrt.py").read())
assert LooseVersion("0.26.0+cu130") >= LooseVersion("0.9.0") and LooseVersion("1.10") > "1.9"
print("reference plumbing ok, torch", torch.__version__)'
    return
  fi
  part reference-ckpt 150 reference-ckpt.json env PYTHONPATH="$pythonpath" "$python" baselines/vrt_reference_step.py "${args[@]}" --ckpt --optimizer fused
  part reference-ckpt-compile 240 reference-ckpt-compile.json env PYTHONPATH="$pythonpath" "$python" baselines/vrt_reference_step.py "${args[@]}" --ckpt --optimizer fused --compile
}

part_train() {
  local data="$work/data" rundir="$work/run"
  local synth=(--seqs 2 --test-seqs 1 --frames 12 --gopro)
  local sets=(--set "DATA.ROOT=$data" --set TRAIN.AMP_ENABLED=true --set "TRAIN.TOTAL_STEPS=$train_steps"
    --set TRAIN.WARMUP_STEPS=10 --set "LOG.VAL_EVERY_STEPS=$train_steps" --set "LOG.CKPT_EVERY_STEPS=$train_steps"
    --set LOG.LOG_EVERY_STEPS=10 --set LOG.MEM_EVERY_STEPS=10 --set DATA.VAL_CROP_SIZE=null
    --set DATA.VAL_TILE=256 --set DATA.CACHE_SIZE_GB=2 "${ckpt[@]}")
  local launch=(--gpus 1)
  if (( smoke )); then
    synth=(--seqs 2 --test-seqs 1 --frames 6)
    sets=(--set "DATA.ROOT=$data" --set "TRAIN.TOTAL_STEPS=$train_steps" --set TRAIN.WARMUP_STEPS=0 --set "LOG.VAL_EVERY_STEPS=$train_steps"
      --set "LOG.CKPT_EVERY_STEPS=$train_steps" --set DATA.CACHE_SIZE_GB=0.25)
    launch=(--gpus 0 --ranks 1)
  fi
  # TRAIN_SETS: more `KEY=VALUE` settings for the training, space-separated (say,
  # activation checkpointing for a card of the user's 48 GB).
  local extra
  read -r -a extra <<< "${TRAIN_SETS:-}"
  for setting in "${extra[@]}"; do sets+=(--set "$setting"); done
  local config=$baseline
  (( smoke )) && config=configs/demo/unet_spike_demo.yaml
  part train-synth 120 - "$run" vrtspike synth --out "$data" "${synth[@]}"
  part train 420 - "$run" vrtspike-launch "${launch[@]}" --config "$config" --run-dir "$rundir" "${sets[@]}"
  cp "$rundir/summary.json" "$out/train-summary.json" 2>> "$out/logs/train.log"
  part train-analyze 60 train-analyze.json "$run" vrtspike analyze "$rundir" --json
  # The run directory beside the profile of the same model: metrics, config, logs.
  mkdir -p "$out/train-run"
  (cd "$rundir" && tar cf - --exclude=./checkpoints --exclude=./tb .) | tar xf - -C "$out/train-run" 2>> "$out/logs/train.log"
}

# The SMs' busy share every second of the call (nvidia-smi dmon), with the date and
# time of each line for figures.txt to cut the training and validation windows.
start_dmon() {
  (( smoke )) && return
  command -v nvidia-smi > /dev/null || return
  nvidia-smi dmon -s u -o DT -d 1 > "$out/dmon.txt" 2>> "$out/logs/info.log" &
  dmon_pid=$!
}

echo "gpu_run.sh: parts ${parts[*]}$( (( smoke )) && echo ' (smoke, CPU)')" | tee "$out/summary.txt"
: > "$out/parts.jsonl"
start_dmon
for name in "${parts[@]}"; do
  case "$name" in
    info|tests|profile|reference|train) "part_$name" ;;
    *) echo "gpu_run.sh: unknown part $name (info tests profile train reference)" >&2; exit 2 ;;
  esac
done
[[ -n "$dmon_pid" ]] && kill "$dmon_pid" 2> /dev/null && dmon_pid=

# The figures of whatever parts ran, one line each, in figures.txt and on stdout (a
# device call returns only the end of its output): scripts/gpu_figures.py.
python3 "$here/scripts/gpu_figures.py" "$out" | tee "$out/figures.txt"
