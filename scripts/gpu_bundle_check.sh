#!/usr/bin/env bash
# Proves the GPU bundle self-sufficient on this machine (`make gpu-bundle-check`):
#   scripts/gpu_bundle_check.sh BUNDLE_DIR VENV
# In a private mount namespace (root: `unshare --mount`), the venv's site-packages is
# bind-mounted at a stand-in path and the venv itself is hidden under an empty tmpfs,
# so the binaries' RUNPATH (which names the venv) leads nowhere; run-on-gpu.sh then
# finds torch through the system python3 with PYTHONPATH at the stand-in, as it finds
# the GPU host's /opt/torch/.venv there. Checked, in that namespace:
#   1. every library each bundled binary loads resolves into the bundle's lib/, the
#      stand-in torch folders or the C/C++ runtimes, none from the hidden venv;
#   2. `vrtspike info`: libtorch_cuda loaded, NCCL compiled in;
#   3. a 3-step CPU training through the bundled launcher completes;
#   4. `scripts/gpu_run.sh --smoke` runs its parts' plumbing (profile, reference
#      import, train) on CPU.
# The clean-up removes the stand-in only once its bind mount of the real
# site-packages is off (`release_standin`; sourcing this file defines it and runs
# nothing, for launcher/tests/bundle_check_cleanup.rs).
set -euo pipefail

# Unmounts the stand-in's bind mount of the venv's site-packages, then removes the
# stand-in and the work folder. A mount that stays (busy, or umount failed) is left
# with the stand-in, named, and the function fails: `rm -rf` through it would delete
# the real venv. `--one-file-system` keeps rm off any other mount below them.
release_standin() {
  local standin=$1 work=$2 status=0
  if mountpoint -q "$standin/site-packages"; then
    umount "$standin/site-packages" || status=$?
  fi
  if mountpoint -q "$standin/site-packages"; then
    echo "gpu_bundle_check.sh: $standin/site-packages is still mounted (the venv's site-packages): left in place, unmount it by hand" >&2
    status=1
  else
    rm -rf --one-file-system "$standin"
  fi
  rm -rf --one-file-system "$work"
  return "$status"
}

main() {
  bundle=$(cd "${1:?usage: gpu_bundle_check.sh BUNDLE_DIR VENV}" && pwd)
  venv=$(cd "${2:?usage: gpu_bundle_check.sh BUNDLE_DIR VENV}" && pwd)

  if [[ "$(id -u)" != 0 ]]; then
    echo "gpu_bundle_check.sh: needs root (a private mount namespace hides the venv)" >&2
    exit 1
  fi
  if [[ -z "${VRTSPIKE_BUNDLE_CHECK_INSIDE:-}" ]]; then
    exec env VRTSPIKE_BUNDLE_CHECK_INSIDE=1 unshare --mount --propagation private "$0" "$@"
  fi

  site=$(ls -d "$venv"/lib/python3*/site-packages)
  standin=$(mktemp -d /tmp/vrtspike-standin.XXXXXX)
  work=$(mktemp -d /tmp/vrtspike-bundle-check.XXXXXX)
  mkdir -p "$standin/site-packages"
  trap 'release_standin "$standin" "$work"' EXIT
  mount --bind -o ro "$site" "$standin/site-packages"
  mount -t tmpfs -o size=1m tmpfs "$venv"
  if [[ -e "$site/torch" ]]; then
    echo "gpu_bundle_check.sh: the venv is still visible" >&2
    exit 1
  fi
  export VRTSPIKE_TORCH_PYTHON=/usr/bin/python3
  export PYTHONPATH="$standin/site-packages"
  run="$bundle/run-on-gpu.sh"
  fail() { echo "gpu_bundle_check.sh: FAILED: $*" >&2; exit 1; }

  echo "== 1. libraries each bundled binary loads (venv hidden at $venv)"
  for bin in "$bundle"/bin/*; do
    trace=$("$run" env LD_TRACE_LOADED_OBJECTS=1 "$bin") || fail "tracing $(basename "$bin")"
    if grep -q "not found" <<< "$trace"; then
      fail "$(basename "$bin") misses: $(grep "not found" <<< "$trace" | tr -s ' \t' ' ')"
    fi
    while read -r name arrow path _; do
      [[ "$arrow" == "=>" ]] || continue
      case "$path" in
        "$bundle"/lib/*|"$standin"/*) ;;
        */libc.so.*|*/libm.so.*|*/libdl.so.*|*/libpthread.so.*|*/librt.so.*|*/libutil.so.*|*/libresolv.so.*) ;;
        */libstdc++.so.*|*/libgcc_s.so.*|*/ld-linux*) ;;
        *) fail "$(basename "$bin") loads $name from $path, outside the bundle and the stand-in torch" ;;
      esac
    done <<< "$trace"
    echo "$(basename "$bin"): $(grep -c "=>" <<< "$trace") libraries, all from the bundle, torch or the C/C++ runtimes"
  done

  echo "== 2. vrtspike info"
  info=$("$run" vrtspike info) || fail "vrtspike info"
  echo "$info"
  grep -q "^libtorch_cuda: loaded" <<< "$info" || fail "libtorch_cuda is not loaded"
  grep -q "^NCCL: compiled into the c10d shim" <<< "$info" || fail "NCCL is not compiled in"

  echo "== 3. a 3-step CPU training through the bundled launcher"
  "$run" vrtspike synth --out "$work/data" --seqs 2 --test-seqs 1 --frames 6 > /dev/null
  (cd "$work" && "$run" vrtspike-launch --gpus 0 --ranks 1 \
    --config "$bundle/configs/demo/unet_spike_demo.yaml" --run-dir "$work/run" \
    --set "DATA.ROOT=$work/data" --set TRAIN.TOTAL_STEPS=3 --set TRAIN.WARMUP_STEPS=0 --set LOG.VAL_EVERY_STEPS=3 \
    --set LOG.CKPT_EVERY_STEPS=3 --set DATA.CACHE_SIZE_GB=0.25) > "$work/launch.log" 2>&1 \
    || { tail -20 "$work/launch.log"; fail "the bundled launcher's training"; }
  grep -q '"status": *"completed"' "$work/run/summary.json" || fail "summary: $(cat "$work/run/summary.json")"
  grep -o '"steps": *[0-9]*' "$work/run/summary.json"

  echo "== 4. gpu_run.sh --smoke"
  "$bundle/scripts/gpu_run.sh" --smoke "$work/gpu-run" info profile reference train
  for json in info profile-baseline-ckpt profile-gopro-ckpt train-analyze; do
    python3 -c 'import json, sys; json.load(open(sys.argv[1]))' "$work/gpu-run/$json.json" \
      || fail "gpu_run.sh --smoke wrote no valid $json.json"
  done
  if grep -v '"rc": 0' "$work/gpu-run/parts.jsonl"; then
    fail "a gpu_run.sh --smoke part failed (above)"
  fi
  grep -q '"status": *"completed"' "$work/gpu-run/train-summary.json" || fail "gpu_run.sh --smoke: training did not complete"
  grep -q '"kind": *"train"' "$work/gpu-run/train-run/metrics.jsonl" || fail "gpu_run.sh --smoke: no train-run/metrics.jsonl"
  grep -q 'training step, fused' "$work/gpu-run/figures.txt" || fail "gpu_run.sh --smoke: figures.txt has no training step: $(cat "$work/gpu-run/figures.txt")"

  echo "gpu_bundle_check.sh: the bundle at $bundle ($(du -sh "$bundle" | cut -f1)) runs with the venv hidden"
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  main "$@"
fi
