"""kfrun --bind-to core: each worker bound to its share of the machine's cores (kungfu._bind)."""
import json
import os
import re
import subprocess
import sys

import pytest

from kungfu import _bind
from kungfu.launcher import hosts
from kungfu.launcher import plan

from test_launcher import reaper  # noqa: F401  (the fixture: kills every process a test starts)
from test_launcher import run_kfrun

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="binding needs sched_setaffinity")

# A thread started before init() (as TF starts its pools), then init(); prints every thread's cores.
BOUND_WORKER = """
import json, os, threading
import kungfu
stop = threading.Event()
early = threading.Thread(target=stop.wait, daemon=True)
early.start()
kungfu.init()
late = threading.Thread(target=stop.wait, daemon=True)
late.start()
cores = {t: sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
print("CORES " + json.dumps({"rank": kungfu.rank(), "threads": cores}), flush=True)
kungfu.barrier()
stop.set()
"""


@pytest.mark.parametrize("local_size, available, expected", [
    (1, [0, 1], [[0, 1]]),
    (2, [0, 1], [[0], [1]]),
    (2, [0, 1, 2, 3, 4], [[0, 1], [2, 3]]),  # equal shares; the fifth core is left over
    (4, [0, 1], [[0], [1], [0], [1]]),  # fewer cores than workers: shared round-robin
    (2, [3, 1, 5, 7], [[1, 3], [5, 7]]),  # only the cores the process may use, sorted
])
def test_cpus_for_cuts_equal_contiguous_shares(local_size, available, expected):
    assert [_bind.cpus_for(r, local_size, available) for r in range(local_size)] == expected


def test_bad_modes_and_ranks_are_errors():
    with pytest.raises(ValueError, match="KUNGFU_BIND_TO='socket': must be one of none, core"):
        _bind.check_mode("socket")
    with pytest.raises(ValueError, match=r"local rank 2 is not in \[0, 2\)"):
        _bind.cpus_for(2, 2, [0, 1])
    assert _bind.bind("none", 0, 1) is None  # nothing is bound


def test_worker_env_carries_the_mode_only_when_binding():
    workers = plan.plan_workers([hosts.HostSpec("127.0.0.1", 2)], 2, (10000, 10100), port_free=lambda p: True)
    assert "KUNGFU_BIND_TO" not in plan.worker_env(workers[0], workers, "tok", 1, environ={})
    assert plan.worker_env(workers[0], workers, "tok", 1, environ={}, bind_to="core")["KUNGFU_BIND_TO"] == "core"


def test_init_rejects_a_bad_mode_before_anything_starts():
    code = "import kungfu\ntry:\n    kungfu.init()\nexcept ValueError as e:\n    print('ERR', e)\n"
    env = dict(os.environ, KUNGFU_BIND_TO="sockets")
    env.pop("KUNGFU_PEERS", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60).stdout
    assert "ERR KUNGFU_BIND_TO='sockets': must be one of none, core" in out


@pytest.mark.parametrize("np", [2, 3])
def test_kfrun_bind_to_core_binds_every_thread_of_each_worker(np, reaper, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(BOUND_WORKER)
    rc, out, err = run_kfrun(["-np", str(np), "--bind-to", "core", "--timeout", "20", "--", sys.executable,
                              str(script)], reaper, timeout=60)
    assert rc == 0, err
    records = [json.loads(m.group(1)) for m in re.finditer(r"^\[\d+\] CORES (.*)$", out, re.M)]
    assert sorted(r["rank"] for r in records) == list(range(np)), out
    available = sorted(os.sched_getaffinity(0))
    for r in records:
        want = _bind.cpus_for(r["rank"], np, available)
        assert len(r["threads"]) >= 3, r  # main, the two test threads (and the engine's)
        assert all(cores == want for cores in r["threads"].values()), (want, r)
    if len(available) >= np:  # then the workers' cores are disjoint
        seen = [set(_bind.cpus_for(r, np, available)) for r in range(np)]
        assert all(not (a & b) for i, a in enumerate(seen) for b in seen[i + 1:])


def test_kfrun_without_bind_to_leaves_workers_floating(reaper, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(BOUND_WORKER)
    rc, out, err = run_kfrun(["-np", "2", "--timeout", "20", "--", sys.executable, str(script)], reaper, timeout=60)
    assert rc == 0, err
    available = sorted(os.sched_getaffinity(0))
    for m in re.finditer(r"^\[\d+\] CORES (.*)$", out, re.M):
        assert all(cores == available for cores in json.loads(m.group(1))["threads"].values())
