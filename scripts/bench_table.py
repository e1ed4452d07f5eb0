#!/usr/bin/env python3
"""Side-by-side table of `make bench`: vrtspike's loader against the PyTorch peer.

Reads, from the folder given (default bench-out/), each side's stdout capture
(<side>.out: the command's JSON line, then pss-tree's) and pss-tree's --json
file (<side>-pss.json), and prints samples/s, peak summed Pss and leftover
shared memory for both, with the two ratios and the targets (issue 3: >= 5x the
peer's samples/s; issue 28: <= 0.05x its Pss), then the cache server's own Pss
(vrtspike's JSON `server_memory`, read before the server stops): the data it maps
and its own overhead.
With a second argument (`make bench-python`: `vrtspike.data.Dataset`) the vrtspike
side is the Python package's Dataset in the peer's own loader shape, labelled so,
with issue 38's targets (>= 10x samples/s, <= 0.1x Pss).
Standard library only.
"""
import json
import os
import sys

SIDES = (("vrtspike", "vrtspike bench loader"), ("peer", "torch_loader.py"))


def report(folder, side):
    """The command's own JSON object (the line with samples_per_s)."""
    path = os.path.join(folder, side + ".out")
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                try:
                    obj = json.loads(line)
                except ValueError:
                    continue
                if "samples_per_s" in obj:
                    return obj
    sys.exit(f"{path}: no JSON line with samples_per_s (did the run fail?)")


def memory(folder, side):
    path = os.path.join(folder, side + "-pss.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as err:
        sys.exit(f"{path}: {err}")


def main():
    folder = sys.argv[1] if len(sys.argv) > 1 else "bench-out"
    sides = SIDES
    speed_goal, mem_goal = 5, 0.05
    if len(sys.argv) > 2:
        sides = ((SIDES[0][0], sys.argv[2]), SIDES[1])
        speed_goal, mem_goal = 10, 0.1
    rows = {}
    for side, _ in sides:
        r, m = report(folder, side), memory(folder, side)
        if m.get("exit_code") not in (0, None):
            sys.exit(f"{side}: the command exited with {m.get('exit_code')}")
        rows[side] = (float(r["samples_per_s"] or 0.0), float(m["peak_pss_mb"]),
                      float(m["leftover_shmem_mb"]))
    print(f"{'loader':<24}{'samples/s':>12}{'peak Pss MB':>14}{'leftover shm MB':>17}")
    for side, label in sides:
        sps, pss, shm = rows[side]
        print(f"{label:<24}{sps:>12.2f}{pss:>14.0f}{shm:>17.1f}")
    (ours_sps, ours_pss, _), (peer_sps, peer_pss, _) = rows["vrtspike"], rows["peer"]
    speed = ours_sps / peer_sps if peer_sps > 0 else float("inf")
    mem = ours_pss / peer_pss if peer_pss > 0 else float("inf")
    print(f"{'ratio vrtspike/peer':<24}{speed:>11.2f}x{mem:>13.3f}x"
          f"   (targets: >= {speed_goal}x samples/s, <= {mem_goal}x Pss: "
          f"{'met' if speed >= speed_goal else 'MISSED'}, {'met' if mem <= mem_goal else 'MISSED'})")
    server = report(folder, "vrtspike").get("server_memory")
    if server:
        print(f"{'  of which cache server':<24}{'':>12}{server['pss_mb']:>14.0f}"
              f"   ({server['pss_shmem_mb']:.0f} MB its share of the data it maps, "
              f"{server['overhead_mb']:.0f} MB its own: binary, heap, metadata)")


if __name__ == "__main__":
    main()
