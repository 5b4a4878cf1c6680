"""Binding a worker to its share of its machine's cores (kfrun --bind-to core, KUNGFU_BIND_TO=core).

Workers that share a machine and float over all of its cores fight for them: TensorFlow sizes its
thread pools to every core it sees, so two workers on two cores run four busy pools, and a step waits
whenever the other worker's threads hold the core it needs. Bound, each worker keeps its own cores
(like `mpirun --bind-to core`), and its step time is steadier and usually shorter.

The cores a process may use (os.sched_getaffinity) are cut into local_size equal, contiguous shares,
and local rank r gets share r. With fewer cores than workers, worker r gets core r mod cores (shared,
as evenly as it can be). Every thread the process has when init() binds it is bound, so threads that
TensorFlow started before init() move too; threads started later inherit their creator's cores.
"""

import logging
import os

MODES = ("none", "core")
ENV = "KUNGFU_BIND_TO"

_log = logging.getLogger("kungfu")


def check_mode(mode, what=ENV):
    if mode not in MODES:
        raise ValueError(f"{what}={mode!r}: must be one of {', '.join(MODES)}")
    return mode


def cpus_for(local_rank, local_size, available):
    """The cores of local rank local_rank among local_size workers, from the sorted list available."""
    if not 0 <= local_rank < local_size:
        raise ValueError(f"local rank {local_rank} is not in [0, {local_size})")
    available = sorted(available)
    if not available:
        raise ValueError("no cores to bind to")
    if len(available) < local_size:
        return [available[local_rank % len(available)]]
    share = len(available) // local_size
    return available[local_rank * share:(local_rank + 1) * share]


def _threads():
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]  # no procfs: the calling thread only


def bind(mode, local_rank, local_size):
    """Binds every thread of this process as mode says; returns the cores, or None for mode "none"."""
    if check_mode(mode) == "none":
        return None
    if not hasattr(os, "sched_setaffinity"):
        _log.warning("kungfu: %s=%s is not supported on this platform; the worker is not bound", ENV, mode)
        return None
    cpus = cpus_for(local_rank, local_size, os.sched_getaffinity(0))
    for tid in _threads():
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:
            pass  # the thread ended meanwhile
    return cpus
