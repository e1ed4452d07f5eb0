#!/usr/bin/env bash
# The loader on a slow backing store (issue 28 §3): the dataset on an ext4 file
# system in a loop device whose reads the kernel throttles for the loader's
# processes (cgroup v2 io.max "rbps", or cgroup v1 blkio.throttle.read_bps_device
# where the io controller sits on a v1 hierarchy, as on this project's machine),
# then `vrtspike bench loader` with the demo's sampling and step time, the cache
# at a share of the data, under LRU, the planned policy, and the planned policy
# with the loader's prefetch; one table of the loader's stall share (data_time over
# the step time), hit rate and bytes read.
#
#   scripts/throttled_store.sh [OUT_DIR]        (root; default OUT_DIR bench-out/throttled)
#
# Settings (environment): BIN (target/release/vrtspike), DATA (a dataset root to
# copy; default: a synthetic 720x1280 set, made once in data/throttled-gopro),
# READ_MBPS (200), STEP_MS (340: the demo's step on this project's machine, see the
# README), CAP_PERCENT (25), EPOCHS (4), RANKS (2), WORKERS (1), PREFETCH (2),
# BATCH (4), CLIP (2), CROP (64), BINS (8): the demo's loader.
#
# The file system's page cache is dropped every 0.1 s for the dataset's files
# (posix_fadvise DONTNEED), so every read reaches the throttled device, as on a
# shared file system whose data does not stay in the node's page cache. Everything
# is undone at exit (unmount, loop device, cgroup, the dropper).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:-$root/bench-out/throttled}
bin=${BIN:-$root/target/release/vrtspike}
read_mbps=${READ_MBPS:-200}
step_ms=${STEP_MS:-340}
cap_percent=${CAP_PERCENT:-25}
epochs=${EPOCHS:-4}
ranks=${RANKS:-2}
workers=${WORKERS:-1}
prefetch=${PREFETCH:-2}
batch=${BATCH:-4}
clip=${CLIP:-2}
crop=${CROP:-64}
bins=${BINS:-8}
python=${PYTHON:-python3}

[[ $(id -u) == 0 ]] || { echo "throttled_store.sh: needs root (loop device, mount, cgroup)" >&2; exit 1; }
[[ -x $bin ]] || { echo "throttled_store.sh: no $bin (make build)" >&2; exit 1; }
mkdir -p "$out"

data=${DATA:-}
if [[ -z $data ]]; then
  data=$root/data/throttled-gopro
  if [[ ! -f $data/dataset.yaml ]]; then
    echo "writing a synthetic 720x1280 set (8 sequences of 12 frames) to $data"
    "$bin" synth --gopro --seqs 8 --test-seqs 0 --frames 12 --blur-frames 7 --out "$data"
  fi
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/vrtspike-throttled.XXXXXX")
mnt=$work/mnt
loop=""
cgroup=""
dropper=""
cleanup() {
  set +e
  [[ -n $dropper ]] && kill "$dropper" 2>/dev/null && wait "$dropper" 2>/dev/null
  mountpoint -q "$mnt" && umount "$mnt"
  [[ -n $loop ]] && losetup -d "$loop"
  if [[ -n $cgroup && -d $cgroup ]]; then
    # Anything left in it goes back to the parent first.
    while read -r pid; do echo "$pid" > "$(dirname "$cgroup")/cgroup.procs"; done < "$cgroup/cgroup.procs"
    rmdir "$cgroup"
  fi
  rm -rf "$work"
}
trap cleanup EXIT

# The file system: ext4 on a loop device, 30% larger than the data.
data_kb=$(du -sk "$data" | cut -f1)
truncate -s $(( (data_kb * 13 / 10 + 65536) * 1024 )) "$work/store.img"
mkfs.ext4 -q -F "$work/store.img"
loop=$(losetup -f --show "$work/store.img")
mkdir -p "$mnt"
mount "$loop" "$mnt"
cp -a "$data/." "$mnt/"
sync
majmin=$(lsblk -dno MAJ:MIN "$loop" | tr -d ' ')
rate=$(( read_mbps * 1000 * 1000 ))

# The throttle: cgroup v2's io controller if there is one, else v1's blkio.
v2=""
for base in /sys/fs/cgroup /sys/fs/cgroup/unified; do
  if [[ -f $base/cgroup.controllers ]] && grep -qw io "$base/cgroup.controllers"; then v2=$base; break; fi
done
if [[ -n $v2 ]]; then
  grep -qw io "$v2/cgroup.subtree_control" || echo "+io" > "$v2/cgroup.subtree_control"
  cgroup=$v2/vrtspike-throttled-$$
  mkdir "$cgroup"
  echo "$majmin rbps=$rate" > "$cgroup/io.max"
  throttle="cgroup v2 io.max \"$majmin rbps=$rate\""
  device_read_bytes() { awk -v d="$majmin" '$1 == d { for (i = 2; i <= NF; i++) if ($i ~ /^rbytes=/) { sub("rbytes=", "", $i); print $i } }' "$cgroup/io.stat"; }
elif [[ -f /sys/fs/cgroup/blkio/blkio.throttle.read_bps_device ]]; then
  cgroup=/sys/fs/cgroup/blkio/vrtspike-throttled-$$
  mkdir "$cgroup"
  echo "$majmin $rate" > "$cgroup/blkio.throttle.read_bps_device"
  throttle="cgroup v1 blkio.throttle.read_bps_device \"$majmin $rate\""
  device_read_bytes() { awk -v d="$majmin" '$1 == d && $2 == "Read" { print $3 }' "$cgroup/blkio.throttle.io_service_bytes"; }
else
  echo "throttled_store.sh: no cgroup io controller (v2 io.max or v1 blkio) to throttle reads" >&2
  exit 1
fi
echo "throttle: $throttle on $loop ($mnt)"

# Runs a command inside the throttled cgroup.
in_cgroup() { sh -c 'echo $$ > "$0/cgroup.procs" && exec "$@"' "$cgroup" "$@"; }

# What the device gives a reader in the cgroup: 400 MB (or all of it) read directly
# (no page cache), past the throttle's first slice.
probe=$(in_cgroup dd if="$loop" of=/dev/null bs=4M count=100 iflag=direct 2>&1 | tail -1)
echo "direct read of the loop device in the cgroup: $probe" | tee "$out/probe.txt"

# Drops the dataset's pages from the page cache, 10 times a second.
"$python" - "$mnt" <<'EOF' &
import os, sys, time
root = sys.argv[1]
files = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]
while True:
    for path in files:
        try:
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        except OSError:
            pass
    time.sleep(0.1)
EOF
dropper=$!

common=(bench loader --json --root "$mnt" --ranks "$ranks" --workers "$workers"
        --prefetch "$prefetch" --batch "$batch" --clip "$clip" --crop "$crop" --bins "$bins"
        --epochs "$epochs" --cache-percent "$cap_percent" --lockstep --step-ms "$step_ms")
for config in lru planned planned-prefetch; do
  case $config in
    lru) extra=(--policy lru) ;;
    planned) extra=(--policy planned --no-prefetch) ;;
    planned-prefetch) extra=(--policy planned) ;;
  esac
  before=$(device_read_bytes || echo 0)
  echo "running $config"
  in_cgroup "$bin" "${common[@]}" "${extra[@]}" > "$out/$config.json" 2> "$out/$config.log"
  after=$(device_read_bytes || echo 0)
  echo "$(( ${after:-0} - ${before:-0} ))" > "$out/$config.device-bytes"
done

"$python" - "$out" "$throttle" "$step_ms" "$cap_percent" <<'EOF'
import json, os, sys
out, throttle, step_ms, cap = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
print(f"throttle: {throttle}; step {step_ms:.0f} ms; cache {cap}% of the data; warm epochs (after the first)")
print("| loader | stall share (data_time / step time) | hit rate | MB decoded from disk | MB read from the device | samples/s |")
print("| --- | --- | --- | --- | --- | --- |")
names = {"lru": "LRU", "planned": "planned", "planned-prefetch": "planned + prefetch"}
for config in ("lru", "planned", "planned-prefetch"):
    with open(os.path.join(out, config + ".json")) as f:
        r = json.loads(f.read().strip().splitlines()[-1])
    with open(os.path.join(out, config + ".device-bytes")) as f:
        device = int(f.read().strip() or 0)
    w = r["warm"]
    print(f"| {names[config]} | {100 * r['warm_stall_share']:.1f}% | {r['warm_hit_rate']:.3f} | "
          f"{w['disk_bytes'] / 1e6:.0f} | {device / 1e6:.0f} (all epochs) | {r['samples_per_s']:.1f} |")
EOF
