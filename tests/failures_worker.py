"""The worker of the failure tests in test_collectives_mp.py, started by kfrun. Not a test module itself.

    python -m kungfu.launcher -np 3 -- python tests/failures_worker.py kill|leave|exit
    python -m kungfu.launcher -np 2 -- python tests/failures_worker.py stall

Each mode makes one worker die, leave, exit or stall while the others run a collective, and the others
print how they saw it as one line: "KFKILL <json>", "KFLEAVE <json>", "KFEXIT <json>" or "KFSTALL <json>".
"""

import mp

mp.worker_started()  # first thing, so the test can kill this process on every path

import json  # noqa: E402 (after the pid file on purpose)
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import tensorflow as tf  # noqa: E402

import kungfu  # noqa: E402
from kungfu import _lib  # noqa: E402


def run_kill():
    """The last rank dies with SIGKILL while every rank is inside one all-reduce."""
    rank, size = kungfu.rank(), kungfu.size()
    victim = size - 1
    x = tf.ones([16 << 20])  # 64 MB: far too much to finish before the victim dies
    kungfu.barrier(name="before-kill")
    if rank == victim:
        threading.Thread(target=lambda: kungfu.all_reduce(x, name="victim"), daemon=True).start()
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
    in_function = tf.function(lambda x: kungfu.all_reduce(x, name="in-function"))
    steps = {"victim": lambda: kungfu.all_reduce(x, name="victim"), "after": lambda: kungfu.all_reduce(x, name="after"),
             "in-function": lambda: in_function(x)}
    report = {"rank": rank}
    for step, fn in steps.items():
        start = time.perf_counter()
        try:
            fn()
            report[step] = {"error": None}
        except tf.errors.OpError as e:
            report[step] = {"error": type(e).__name__, "message": e.message.splitlines()[0]}
        report[step]["seconds"] = round(time.perf_counter() - start, 3)
    print("KFKILL " + json.dumps(report), flush=True)


def report_all_reduce(tag, x, name):
    """Prints `tag {"error", "message", "seconds"}` for one all-reduce expected to fail."""
    start = time.perf_counter()
    try:
        kungfu.all_reduce(x, name=name)
        report = {"error": None}
    except tf.errors.OpError as e:
        report = {"error": type(e).__name__, "message": e.message.splitlines()[0]}
    report["seconds"] = round(time.perf_counter() - start, 3)
    print(f"{tag} " + json.dumps(report), flush=True)


def run_leave():
    """Rank 0 calls kungfu.finalize(); the others take part in its barrier (the same call finalize makes)
    without leaving, then try one more collective: it must fail at once, naming rank 0 as having left
    the cluster (its goodbye), not as a closed connection (a crash)."""
    x = tf.ones([4])
    kungfu.barrier(name="before-leave")
    if kungfu.rank() == 0:
        kungfu.finalize()
        return
    assert _lib._finalize_barrier(), "the finalize barrier failed"
    report_all_reduce("KFLEAVE", x, "after-leave")
    time.sleep(1)  # let the other stayer report before this one's exit closes its connections
    os._exit(0)  # its own finalize would only find rank 0 gone


def run_exit():
    """Rank 1 leaves its loop with sys.exit(3) while the others start one more all-reduce: its finalize
    tells them it will not join, so theirs fail at once naming it (not at the timeout, while it waited
    in the finalize barrier). They then finalize too and meet it in that barrier."""
    x = tf.ones([4])
    kungfu.barrier(name="before-exit")
    if kungfu.rank() == 1:
        sys.exit(3)
    report_all_reduce("KFEXIT", x, "after-exit")


def run_stall():
    """Rank 1 stalls (it sleeps until kfrun stops it); rank 0's all-reduce times out naming it, and rank 0's
    finalize then leaves at once instead of waiting another timeout for it in the barrier."""
    kungfu.barrier(name="before-stall")
    if kungfu.rank() == 1:
        time.sleep(120)
    report_all_reduce("KFSTALL", tf.ones([4]), "stalled")


MODES = {"kill": run_kill, "leave": run_leave, "exit": run_exit, "stall": run_stall}


def main():
    kungfu.init()
    MODES[sys.argv[1]]()


if __name__ == "__main__":
    main()
