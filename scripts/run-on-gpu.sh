#!/usr/bin/env bash
# Runs a command of the GPU bundle (`make gpu-bundle`) with the host's own libtorch:
#   run-on-gpu.sh vrtspike info
#   run-on-gpu.sh vrtspike-launch --gpus 1 --config configs/deblur/vrt_spike_baseline.yaml ...
#   run-on-gpu.sh gpu-tests --test-threads 1
# A first word naming a binary of the bundle's bin/ runs that binary; anything else
# runs as given, with the same environment (python3 scripts, say).
#
# The host's torch is found by importing it (no version path is written here): the
# python is $VRTSPIKE_TORCH_PYTHON, else /opt/torch/.venv/bin/python3 when it exists,
# else python3 on PATH. Its torch/lib folder and the wheels' nvidia/*/lib folders go
# on LD_LIBRARY_PATH after the bundle's own lib/ (the libraries the host lacks:
# HDF5 and what it needs). VRTSPIKE_ROOT (configs, scripts) and VRTSPIKE_BIN point at
# the bundle, which is also put first on PATH so the launcher finds `vrtspike`.
set -euo pipefail

bundle=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

find_python() {
  if [[ -n "${VRTSPIKE_TORCH_PYTHON:-}" ]]; then
    echo "$VRTSPIKE_TORCH_PYTHON"
  elif [[ -x /opt/torch/.venv/bin/python3 ]]; then
    echo /opt/torch/.venv/bin/python3
  else
    command -v python3 || { echo "run-on-gpu.sh: no python3 to find torch with" >&2; return 1; }
  fi
}

python=$(find_python)
torch_dir=$("$python" -c 'import os, torch; print(os.path.dirname(torch.__file__))' 2>/dev/null) || {
  echo "run-on-gpu.sh: $python cannot import torch (set VRTSPIKE_TORCH_PYTHON to a python that can)" >&2
  exit 127
}
[[ -f "$torch_dir/lib/libtorch_cpu.so" ]] || {
  echo "run-on-gpu.sh: $torch_dir/lib has no libtorch_cpu.so" >&2
  exit 127
}

lib_path="$bundle/lib:$torch_dir/lib"
for dir in "$(dirname "$torch_dir")"/nvidia/*/lib; do
  [[ -d "$dir" ]] && lib_path="$lib_path:$dir"
done
export LD_LIBRARY_PATH="$lib_path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PATH="$bundle/bin:$PATH"
export VRTSPIKE_ROOT="$bundle"
export VRTSPIKE_BIN="$bundle/bin/vrtspike"
export VRTSPIKE_TORCH_PYTHON="$python"

[[ $# -gt 0 ]] || { echo "usage: run-on-gpu.sh COMMAND [ARGS...]" >&2; exit 2; }
if [[ -x "$bundle/bin/$1" ]]; then
  cmd="$bundle/bin/$1"
  shift
  exec "$cmd" "$@"
fi
exec "$@"
