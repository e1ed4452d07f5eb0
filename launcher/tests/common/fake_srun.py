#!/usr/bin/env python3
"""A stand-in for SLURM's srun on one node, for the launcher's tests.

    srun [--ntasks-per-node=G] [--other-options...] PROGRAM ARGS...

Starts G tasks of PROGRAM with the variables srun gives each task (SLURM_PROCID,
SLURM_LOCALID, SLURM_STEP_NUM_TASKS, SLURM_STEP_NODELIST, ...; SLURM_JOB_ID from
the caller, else 1) and waits for them. Like slurmstepd's process tracking, a
signal srun receives (SIGUSR2, SIGTERM, SIGINT) goes to every process of the step:
the tasks and everything they started. Exits with the first non-zero task status.
With FAKE_SLURM_DIR set, its options (what comes before PROGRAM) are written to
$FAKE_SLURM_DIR/srun.options, one a line.
"""

import os
import signal
import subprocess
import sys
import time


def parse(argv):
    tasks = 1
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        arg = argv[i]
        if arg.startswith("--ntasks-per-node="):
            tasks = int(arg.split("=", 1)[1])
        elif arg in ("--ntasks-per-node", "-n"):
            i += 1
            tasks = int(argv[i])
        i += 1
    return tasks, argv[i:]


def descendants(root):
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rfind(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def main():
    tasks, command = parse(sys.argv[1:])
    if not command:
        sys.exit("fake srun: no program")
    record = os.environ.get("FAKE_SLURM_DIR")
    if record:
        options = sys.argv[1 : len(sys.argv) - len(command)]
        with open(os.path.join(record, "srun.options"), "w") as f:
            f.write("".join(option + "\n" for option in options))
    job = os.environ.get("SLURM_JOB_ID", "1")
    procs = []
    for task in range(tasks):
        env = dict(os.environ)
        env.update(
            SLURM_JOB_ID=job,
            SLURM_STEP_ID="0",
            SLURM_PROCID=str(task),
            SLURM_LOCALID=str(task),
            SLURM_NODEID="0",
            SLURM_NNODES="1",
            SLURM_NTASKS=str(tasks),
            SLURM_STEP_NUM_TASKS=str(tasks),
            SLURM_STEP_NUM_NODES="1",
            SLURM_STEP_TASKS_PER_NODE=str(tasks),
            SLURM_STEP_NODELIST="localhost",
            SLURM_NODELIST="localhost",
            SLURM_JOB_NODELIST="localhost",
        )
        procs.append(subprocess.Popen(command, env=env))

    def fan_out(signum, _frame):
        # Every process of the step, as proctrack delivers it.
        for pid in descendants(os.getpid()):
            try:
                os.kill(pid, signum)
            except OSError:
                pass

    for signum in (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, fan_out)
    status = 0
    while procs:
        for proc in list(procs):
            code = proc.poll()
            if code is not None:
                procs.remove(proc)
                if code != 0 and status == 0:
                    status = code if code > 0 else 128 - code
        time.sleep(0.05)
    sys.exit(status)


if __name__ == "__main__":
    main()
