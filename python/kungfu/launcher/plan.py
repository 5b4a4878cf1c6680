"""The job plan: which rank runs where, on which port, with which environment.

Ranks fill hosts in the order given (host 1 gets its slots first). Ports come from --port-range,
one pool per machine; on this machine a port is taken only if binding it succeeds now (the engine binds
it a moment later, so a port grabbed in between makes the engine fail with a clear bind error).
Remote ports cannot be checked from here and are handed out in order. Each job starts its search at a
random place in the range (wrapping around at its end): two jobs started a moment apart with the same
range would otherwise both pick its first ports, since neither engine has bound them yet.
"""

import dataclasses
import os
import random
import socket

from . import hosts as hosts_lib
from .hosts import UsageError

DEFAULT_PORT_RANGE = "10000-11000"


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    rank: int
    host: str  # as the user named it; other peers connect to it
    port: int  # the engine's listening port
    local_rank: int  # index among the workers on the same machine
    local_size: int  # number of workers on that machine
    is_local: bool  # started by kfrun directly; else through ssh

    @property
    def addr(self):
        return f"{self.host}:{self.port}"


def parse_port_range(text):
    """'A-B' -> (A, B), inclusive."""
    lo, sep, hi = text.partition("-")
    try:
        a, b = int(lo), int(hi)
    except ValueError:
        a = b = 0
    if not sep or not (1 <= a <= b <= 65535):
        raise UsageError(f"--port-range '{text}': expected A-B with 1 <= A <= B <= 65535, e.g. {DEFAULT_PORT_RANGE}")
    return a, b


def port_is_free(port):
    """Whether a worker's engine could listen on port now: binds it as the engine does, with SO_REUSEADDR,
    so a port some socket listens on counts as taken, and one that only has closed connections in
    TIME_WAIT (a job that just ended) counts as free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
            return True
        except OSError:
            return False


def _assign_hosts(hosts, np):
    """The host of each rank 0..np-1, filling hosts in the order given."""
    total = sum(h.slots for h in hosts)
    if np > total:
        listed = ",".join(f"{h.host}:{h.slots}" for h in hosts)
        raise UsageError(f"-np {np} needs {np} slots but the hosts give {total} ({listed}); add slots or lower -np")
    placed = []
    for h in hosts:
        placed.extend([h.host] * min(h.slots, np - len(placed)))
    return placed


class _PortPool:
    def __init__(self, port_range, port_free, start):
        self._range = port_range
        self._free = port_free
        self._start = start  # offset in the range where every machine's search begins
        self._tried = {}  # machine key -> how many ports from the start were handed out or found taken

    def take(self, key, local):
        lo, hi = self._range
        count = hi - lo + 1
        for i in range(self._tried.get(key, 0), count):
            port = lo + (self._start + i) % count
            if not local or self._free(port):
                self._tried[key] = i + 1
                return port
        raise UsageError(
            f"--port-range {lo}-{hi} has no free port left for another worker on "
            f"{'this machine' if local else key}; widen --port-range"
        )


def plan_workers(hosts, np, port_range, local_check=hosts_lib.is_local, port_free=port_is_free, start=None):
    """Returns one WorkerSpec per rank, in rank order. start: the offset in port_range where the search for
    ports begins (default: random, so that jobs started together rarely pick the same ports)."""
    placed = _assign_hosts(hosts, np)
    local = {h: local_check(h) for h in set(placed)}
    keys = [hosts_lib.LOCAL_MACHINE if local[h] else h.lower() for h in placed]
    sizes = {k: keys.count(k) for k in keys}
    seen = {}
    if start is None:
        start = random.randrange(port_range[1] - port_range[0] + 1)
    pool = _PortPool(port_range, port_free, start)
    workers = []
    for rank, (host, key) in enumerate(zip(placed, keys)):
        local_rank = seen.get(key, 0)
        seen[key] = local_rank + 1
        port = pool.take(key, local[host])
        workers.append(WorkerSpec(rank, host, port, local_rank, sizes[key], local[host]))
    return workers


# Defaults kfrun gives every worker unless the caller's environment sets them already.
# TF's default CPU allocator returns large buffers to the OS, so every eager op on a large tensor
# page-faults its output afresh (64 MiB: about 30 ms here against 7 ms with BFC); the BFC allocator
# keeps and reuses them, at the price of holding peak memory. Set it to false to opt out.
WORKER_DEFAULTS = {"TF_CPU_ALLOCATOR_USE_BFC": "true"}


def _seconds(value):
    """value exactly, as the workers parse it: "7" for 7.0, "100.123456789" (not %g's "100.123")."""
    value = float(value)
    return str(int(value)) if value.is_integer() else repr(value)


# The variables worker_env sets per worker: the contract kungfu._env.resolve_cluster reads.
WORKER_CONTRACT = ("KUNGFU_PEERS", "KUNGFU_RANK", "KUNGFU_SIZE", "KUNGFU_LOCAL_RANK", "KUNGFU_LOCAL_SIZE",
                   "KUNGFU_TOKEN", "KUNGFU_TIMEOUT", "KUNGFU_CLUSTER_VERSION")


def worker_env(spec, workers, token, timeout, environ=None, bind_to="none"):
    """The variables of one worker: the KUNGFU_* contract read by kungfu._env.resolve_cluster, plus
    WORKER_DEFAULTS not already set in environ (default: os.environ), plus KUNGFU_BIND_TO unless bind_to
    is "none" (so that a worker started with "none" keeps whatever binding its environment asks for)."""
    environ = os.environ if environ is None else environ
    defaults = {k: v for k, v in WORKER_DEFAULTS.items() if k not in environ}
    if bind_to != "none":
        defaults["KUNGFU_BIND_TO"] = bind_to
    return {**defaults,
        "KUNGFU_PEERS": ",".join(w.addr for w in workers),
        "KUNGFU_RANK": str(spec.rank),
        "KUNGFU_SIZE": str(len(workers)),
        "KUNGFU_LOCAL_RANK": str(spec.local_rank),
        "KUNGFU_LOCAL_SIZE": str(spec.local_size),
        "KUNGFU_TOKEN": token,
        "KUNGFU_TIMEOUT": _seconds(timeout),
        "KUNGFU_CLUSTER_VERSION": "0",
    }
