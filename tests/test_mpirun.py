"""Cluster resolution without kfrun: OpenMPI's variables plus the rank-0 rendezvous (kungfu._rendezvous).

mpirun runs real ranks (pure Python, no TensorFlow); the rendezvous's error paths run as threads in this
process. mpirun is a test dependency: if it is missing the tests fail, naming the fix.
"""

import dataclasses
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest

import kungfu
from kungfu import _env as env_mod
from kungfu import _rendezvous as rdv

# Subprocesses import the same kungfu as this test, installed or from PYTHONPATH=python.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(kungfu.__file__)))
PYTHONPATH = os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))
# Each rank writes its spec to a file: mpirun's output forwarding may split lines of different ranks.
RANK_SCRIPT = (
    "import dataclasses, json, os, sys\n"
    "from kungfu._env import resolve_cluster\n"
    "spec = dataclasses.asdict(resolve_cluster())\n"
    "with open(os.path.join(sys.argv[1], str(spec['rank'])), 'w') as f: json.dump(spec, f)\n"
)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mpirun(tmp_path, np, extra_args=(), timeout=60):
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.fail("mpirun not found: these tests need OpenMPI; run `make deps` (Debian: apt-get install openmpi-bin)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUNGFU_")}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONPATH=PYTHONPATH)
    argv = [mpirun, "--oversubscribe", "-np", str(np), *extra_args, sys.executable, "-c", RANK_SCRIPT, str(tmp_path)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # mpirun and, in its group, the ranks it started
            proc.wait()
    assert proc.returncode == 0, f"mpirun failed ({proc.returncode}):\n{out}\n{err}"
    assert sorted(os.listdir(tmp_path)) == [str(r) for r in range(np)], out + err
    return [json.loads((tmp_path / str(r)).read_text()) for r in range(np)]


def _check_agree(specs, np):
    peers, token = specs[0]["peers"], specs[0]["token"]
    assert [s["rank"] for s in specs] == list(range(np))
    assert len(peers) == np and len(set(peers)) == np
    assert all(p.startswith("127.0.0.1:") for p in peers)
    for s in specs:
        assert (s["peers"], s["token"], s["size"], s["version"]) == (peers, token, np, 0)
        assert (s["local_rank"], s["local_size"]) == (s["rank"], np)
    return token


def test_mpirun_default_rendezvous(tmp_path):
    start = time.monotonic()
    specs = _mpirun(tmp_path, 3)
    token = _check_agree(specs, 3)
    assert len(token) == 64 and time.monotonic() - start < 30


def test_mpirun_explicit_rendezvous_and_token(tmp_path):
    port = _free_port()
    specs = _mpirun(tmp_path, 3, ["-x", f"KUNGFU_RENDEZVOUS=127.0.0.1:{port}", "-x", "KUNGFU_TOKEN=s3cret",
                        "-x", "KUNGFU_TIMEOUT=20"])
    assert _check_agree(specs, 3) == "s3cret" and specs[0]["timeout"] == 20.0


def _ompi_env(rank, size, port=None, **extra):
    env = {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(size),
           "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": str(size),
           "OMPI_MCA_ess_base_jobid": "12345", "KUNGFU_TIMEOUT": "10"}
    if port:
        env["KUNGFU_RENDEZVOUS"] = f"127.0.0.1:{port}"
    env.update(extra)
    return env


def _in_threads(fns, timeout=20):
    """Runs fns concurrently; returns each one's result or exception."""
    results = [None] * len(fns)

    def call(i):
        try:
            results[i] = fns[i]()
        except Exception as e:  # noqa: BLE001 - handed back to the test
            results[i] = e

    threads = [threading.Thread(target=call, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a rendezvous thread missed its deadline"
    return results


def test_resolve_cluster_from_openmpi_variables_in_threads():
    port = _free_port()
    specs = _in_threads([lambda r=r: env_mod.resolve_cluster(_ompi_env(r, 4, port)) for r in range(4)])
    _check_agree([dataclasses.asdict(s) for s in specs], 4)


def test_default_rendezvous_port_is_derived_from_the_job_id():
    port = env_mod.default_rendezvous_port({"OMPI_MCA_ess_base_jobid": "2080374785"})
    assert port == env_mod.default_rendezvous_port({"OMPI_MCA_ess_base_jobid": "2080374785"})
    assert 20000 <= port < 32000
    assert port != env_mod.default_rendezvous_port({"OMPI_MCA_ess_base_jobid": "2111700993"})
    with pytest.raises(ValueError, match="KUNGFU_RENDEZVOUS="):
        env_mod.default_rendezvous_port({})


@pytest.mark.parametrize("env, message", [
    (dict(_ompi_env(1, 4), OMPI_COMM_WORLD_LOCAL_SIZE="2", OMPI_COMM_WORLD_LOCAL_RANK="1"),
     "mpirun -x KUNGFU_RENDEZVOUS="),
    (_ompi_env(4, 4), "OMPI_COMM_WORLD_RANK=4 is out of range"),
    (dict(_ompi_env(0, 2), KUNGFU_RENDEZVOUS="nonsense"), "KUNGFU_RENDEZVOUS: 'nonsense'"),
    ({"OMPI_COMM_WORLD_RANK": "0"}, "OMPI_COMM_WORLD_SIZE is not set"),
])
def test_resolve_cluster_rejects_bad_openmpi_setups(env, message):
    with pytest.raises(ValueError, match=message):
        env_mod.resolve_cluster(env)


def test_single_rank_needs_no_rendezvous():
    spec = env_mod.resolve_cluster(_ompi_env(0, 1))
    assert (spec.peers, spec.size, spec.token) == ([], 1, "")


def _serve(port, size, token="", job="j", timeout=10.0):
    with rdv.listen(("127.0.0.1", port), size) as listener:
        return rdv.serve(listener, size, "127.0.0.1:1000", job, token, timeout)


def _register(port, rank, size, token="", job="j", timeout=10.0):
    return rdv.register(("127.0.0.1", port), rank, size, f"127.0.0.1:{1000 + rank}", job, token, timeout)


def test_worker_retries_until_rank0_listens():
    port = _free_port()

    def late_server():
        time.sleep(0.5)
        return _serve(port, 2)

    (peers, token), reply = _in_threads([late_server, lambda: _register(port, 1, 2)])
    assert reply == (peers, token) and peers == ["127.0.0.1:1000", "127.0.0.1:1001"]


def test_missing_rank_is_named_on_timeout():
    port = _free_port()
    start = time.monotonic()
    server, client = _in_threads([lambda: _serve(port, 3, timeout=1.0), lambda: _register(port, 1, 3)])
    assert isinstance(server, TimeoutError) and "rank(s) [2] of 3 never registered" in str(server)
    assert isinstance(client, ConnectionError) and "never registered" in str(client)
    assert time.monotonic() - start < 5


def test_nobody_listening_times_out():
    with pytest.raises(TimeoutError, match="could not reach rank 0's rendezvous"):
        _register(_free_port(), 1, 2, timeout=0.5)


@pytest.mark.parametrize("client_kwargs, message", [
    ({"token": "other"}, "different KUNGFU_TOKEN"),
    ({"token": ""}, "lacks KUNGFU_TOKEN but rank 0 has it"),
    ({"token": "right", "job": "another"}, "belongs to job 'j'"),
])
def test_refused_registrations(client_kwargs, message):
    port = _free_port()
    server, client = _in_threads([lambda: _serve(port, 2, token="right", timeout=1.5),
                                  lambda: _register(port, 1, 2, **client_kwargs)])
    assert isinstance(client, ConnectionError) and message in str(client)
    assert isinstance(server, TimeoutError) and message in str(server)


def test_shared_token_is_proven_not_sent():
    port = _free_port()
    (peers, token), (_, client_token) = _in_threads([lambda: _serve(port, 2, token="t"),
                                                     lambda: _register(port, 1, 2, token="t")])
    assert token == client_token == "t"


def test_oversized_message_is_refused_and_serving_goes_on():
    port = _free_port()

    def rogue():
        time.sleep(0.2)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(struct.pack("!I", rdv.MAX_MESSAGE + 1))
            return rdv.recv_message(s, time.monotonic() + 5)

    def honest():
        time.sleep(0.6)
        return _register(port, 1, 2)

    server, reply, client = _in_threads([lambda: _serve(port, 2), rogue, honest])
    assert "exceeds" in reply["error"] and client == server
