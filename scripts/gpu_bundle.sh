#!/usr/bin/env bash
# Puts together the GPU-host bundle (`make gpu-bundle`): one folder that runs on a
# GPU host holding only python3 + torch (2.11, CUDA 13 wheel), with nothing to fetch.
#   scripts/gpu_bundle.sh BUNDLE_DIR GPU_TEST_BIN [VRT_REF]
# BUNDLE_DIR is made anew: bin/ (vrtspike, vrtspike-cache, vrtspike-launch, gpu-tests; stripped),
# lib/ (the shared libraries the binaries need beyond libtorch, the C and C++
# runtimes: found with ldd), configs/, run-on-gpu.sh, scripts/gpu_run.sh (and its
# gpu_figures.py), the
# reference peer baselines/vrt_reference_step.py and, when VRT_REF is given (a
# checkout or git directory of the public JingyunLiang/VRT), vrt_ref/models/ for it.
# The bundle must stay under the device call's 64 MiB.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bundle=${1:?usage: gpu_bundle.sh BUNDLE_DIR GPU_TEST_BIN [VRT_REF]}
gpu_tests=${2:?usage: gpu_bundle.sh BUNDLE_DIR GPU_TEST_BIN [VRT_REF]}
vrt_ref=${3:-}
limit=$((64 * 1024 * 1024))

rm -rf "$bundle"
mkdir -p "$bundle/bin" "$bundle/lib" "$bundle/scripts" "$bundle/baselines"

# Binaries, stripped (debug info makes vrtspike 119 MB; stripped it is ~8 MB).
install -m 755 "$root/target/release/vrtspike" "$bundle/bin/vrtspike"
install -m 755 "$root/target/release/vrtspike-cache" "$bundle/bin/vrtspike-cache"
install -m 755 "$root/target/release/vrtspike-launch" "$bundle/bin/vrtspike-launch"
install -m 755 "$gpu_tests" "$bundle/bin/gpu-tests"
strip "$bundle"/bin/*

# Libraries: what ldd resolves outside libtorch (the host's torch/lib and nvidia/*
# wheels) and outside the C and C++ runtimes every host with torch has.
system_lib() {
  case "$1" in
    linux-vdso.so.*|ld-linux*|libc.so.*|libm.so.*|libdl.so.*|libpthread.so.*|librt.so.*) return 0 ;;
    libutil.so.*|libresolv.so.*|libstdc++.so.*|libgcc_s.so.*) return 0 ;;
  esac
  return 1
}
for bin in "$bundle"/bin/*; do
  ldd "$bin" | while read -r name arrow path _; do
    [[ "$arrow" == "=>" ]] || continue
    if [[ "$path" == "not" ]]; then
      echo "gpu_bundle.sh: $bin needs $name, which ldd cannot find here" >&2
      exit 1
    fi
    case "$path" in */torch/lib/*|*/nvidia/*) continue ;; esac
    system_lib "$name" && continue
    [[ -e "$bundle/lib/$name" ]] || cp -L "$path" "$bundle/lib/$name"
  done
done
chmod 644 "$bundle"/lib/*

cp -r "$root/configs" "$bundle/configs"
install -m 755 "$root/scripts/run-on-gpu.sh" "$bundle/run-on-gpu.sh"
install -m 755 "$root/scripts/gpu_run.sh" "$bundle/scripts/gpu_run.sh"
install -m 755 "$root/scripts/gpu_figures.py" "$bundle/scripts/gpu_figures.py"
peer="$root/../shared/baselines/vrt_reference_step.py"
if [[ -f "$peer" ]]; then
  install -m 644 "$peer" "$bundle/baselines/vrt_reference_step.py"
else
  echo "gpu_bundle.sh: no $peer: the bundle has no PyTorch peer" >&2
fi

if [[ -n "$vrt_ref" ]]; then
  mkdir -p "$bundle/vrt_ref/models"
  if [[ -f "$vrt_ref/models/network_vrt.py" ]]; then
    cp "$vrt_ref/models/network_vrt.py" "$bundle/vrt_ref/models/"
  elif git --git-dir="$vrt_ref" cat-file -e HEAD:models/network_vrt.py 2>/dev/null; then
    git --git-dir="$vrt_ref" show HEAD:models/network_vrt.py > "$bundle/vrt_ref/models/network_vrt.py"
  else
    echo "gpu_bundle.sh: $vrt_ref holds no models/network_vrt.py (JingyunLiang/VRT)" >&2
    exit 1
  fi
else
  echo "gpu_bundle.sh: no VRT_REF given: gpu_run.sh will skip the PyTorch reference" >&2
fi

{
  echo "vrtspike GPU bundle"
  echo "commit: $(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)$(git -C "$root" diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m)"
  echo "libraries carried: $(cd "$bundle/lib" && ls | tr '\n' ' ')"
} > "$bundle/BUILD.txt"

size=$(du -sb "$bundle" | cut -f1)
echo "GPU bundle: $bundle, $((size / 1024 / 1024)) MiB ($size bytes; the device call carries at most 64 MiB)"
if (( size >= limit )); then
  echo "gpu_bundle.sh: the bundle is $size bytes, over 64 MiB" >&2
  exit 1
fi
