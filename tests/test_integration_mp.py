"""Whole-job integration: real worker processes with TensorFlow, outside kfrun's happy path.

- A worker holding another job's token is refused by its peer, and both fail with a clear error.
- `mpirun -np 3 python train.py` (OpenMPI, no kfrun) runs real collectives.

Every process a test starts runs in its own session and is SIGKILLed with its group in a finally block.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest

from conftest import REPO

WORKER = """
import json, os, sys
import numpy as np
import kungfu
kungfu.init()
r, n = kungfu.rank(), kungfu.size()
out = {
    "rank": r, "size": n,
    "sum": kungfu.all_reduce(np.arange(5, dtype=np.float32) + r, name="sum").numpy().tolist(),
    "bcast": kungfu.broadcast(np.full([3], r, np.int64), root=n - 1, name="bcast").numpy().tolist(),
    "gather": kungfu.all_gather(np.full([r + 1], r, np.int32), name="gather").numpy().tolist(),
}
kungfu.barrier()
with open(os.path.join(sys.argv[1], str(r)), "w") as f:
    json.dump(out, f)
"""


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KUNGFU_", "OMPI_", "PMIX_"))}
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


def _kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def test_worker_with_another_token_is_refused(tmp_path):
    ports = _free_ports(2)
    peers = ",".join(f"127.0.0.1:{p}" for p in ports)
    procs = []
    try:
        for rank, token in enumerate(["a" * 64, "b" * 64]):
            env = _clean_env(KUNGFU_PEERS=peers, KUNGFU_RANK=str(rank), KUNGFU_SIZE="2", KUNGFU_TOKEN=token,
                             KUNGFU_TIMEOUT="3", KUNGFU_LOCAL_RANK=str(rank), KUNGFU_LOCAL_SIZE="2")
            procs.append(subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path)], env=env, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True))
        outs = [p.communicate(timeout=90)[0] for p in procs]
    finally:
        for p in procs:
            _kill_group(p)
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode != 0, f"rank {rank} started with a foreign token:\n{out}"
        assert "job token" in out, f"rank {rank} did not say why it failed:\n{out}"
    assert any("refused a connection" in out and "the job token did not match" in out for out in outs), outs
    assert os.listdir(tmp_path) == []


def test_mpirun_runs_collectives(tmp_path):
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.fail("mpirun not found: run `make deps` (Debian: apt-get install openmpi-bin)")
    env = _clean_env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", KUNGFU_TIMEOUT="60")
    proc = subprocess.Popen([mpirun, "--oversubscribe", "-np", "3", sys.executable, "-c", WORKER, str(tmp_path)],
                            env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, cwd=REPO)
    try:
        out = proc.communicate(timeout=180)[0]
    finally:
        _kill_group(proc)
    assert proc.returncode == 0, out
    results = [json.loads((tmp_path / str(r)).read_text()) for r in range(3)]
    for r, res in enumerate(results):
        assert (res["rank"], res["size"]) == (r, 3)
        assert res["sum"] == [3.0 * i + 3.0 for i in range(5)]
        assert res["bcast"] == [2, 2, 2]
        assert res["gather"] == [0, 1, 1, 2, 2, 2]


TAKEN_PORT_WORKER = """
import kungfu, kungfu.errors
try:
    kungfu.init()
except kungfu.errors.KungFuError as e:
    print(type(e).__name__, e.recoverable, e)
"""


def test_a_taken_port_is_an_engine_error_not_a_peers():
    """A port this host cannot give the engine is a local start-up failure (EngineError, fatal), not a
    peer that failed (PeerError, 'recoverable': the cluster would not be what it was)."""
    ports = _free_ports(2)
    with socket.create_server(("0.0.0.0", ports[0])):  # someone else holds rank 0's port
        env = _clean_env(KUNGFU_PEERS=",".join(f"127.0.0.1:{p}" for p in ports), KUNGFU_RANK="0", KUNGFU_SIZE="2",
                         KUNGFU_TOKEN="a" * 64, KUNGFU_TIMEOUT="30")
        proc = subprocess.Popen([sys.executable, "-c", TAKEN_PORT_WORKER], env=env, text=True, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            out = proc.communicate(timeout=90)[0]
        finally:
            _kill_group(proc)
    assert f"EngineError False kungfu.init (rank 0 of 2): listening as 127.0.0.1:{ports[0]} (rank 0): bind port " \
           f"{ports[0]}: Address already in use; another job" in out, out
