"""Cluster resolution without kfrun: OpenMPI's variables plus the rank-0 rendezvous (kungfu._rendezvous).

mpirun runs real ranks (pure Python, no TensorFlow: the kungfu.init() they call fails before it loads
the library); the rendezvous's error paths run as threads in this process. mpirun is a test dependency: if
it is missing the tests fail, naming the fix.
"""

import dataclasses
import gc
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
from types import SimpleNamespace

import pytest

import kungfu
from kungfu import _env as env_mod
from kungfu import _lib
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
# Each rank writes what kungfu.init() raised ("ok" if nothing) to a file. The rank named by argv[2], if any,
# stalls instead: it never calls init, and exits once the others have written theirs.
INIT_SCRIPT = """
import os, sys, time
out, rank = sys.argv[1], os.environ["OMPI_COMM_WORLD_RANK"]
if sys.argv[2:] == [rank]:
    size = int(os.environ["OMPI_COMM_WORLD_SIZE"])
    deadline = time.monotonic() + 60
    while len([n for n in os.listdir(out) if n.isdigit()]) < size - 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    sys.exit(0)
import kungfu
try:
    kungfu.init()
    result = "ok"
except Exception as e:
    result = f"{type(e).__module__}.{type(e).__name__}: {e}"
with open(os.path.join(out, rank + ".tmp"), "w") as f:
    f.write(result)
os.rename(f.name, os.path.join(out, rank))
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mpirun(tmp_path, np, extra_args=(), timeout=60, script=RANK_SCRIPT, script_args=()):
    """Runs script on np ranks (argv[1]: tmp_path, where each rank writes a file named by its rank);
    returns what each rank wrote, read as JSON for RANK_SCRIPT, else as text."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.fail("mpirun not found: these tests need OpenMPI; run `make deps` (Debian: apt-get install openmpi-bin)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUNGFU_")}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONPATH=PYTHONPATH)
    argv = [mpirun, "--oversubscribe", "-np", str(np), *extra_args, sys.executable, "-c", script, str(tmp_path),
            *script_args]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.terminate()  # mpirun stops its ranks (each in a process group of its own) on SIGTERM
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert proc.returncode == 0, f"mpirun failed ({proc.returncode}):\n{out}\n{err}"
    ranks = sorted(int(name) for name in os.listdir(tmp_path))
    if script is not RANK_SCRIPT:
        return {r: (tmp_path / str(r)).read_text() for r in ranks}
    assert ranks == list(range(np)), out + err
    return [json.loads((tmp_path / str(r)).read_text()) for r in range(np)]


def _check_agree(specs, np):
    peers, token = specs[0]["peers"], specs[0]["token"]
    assert [s["rank"] for s in specs] == list(range(np))
    assert len(peers) == np and len(set(peers)) == np
    assert all(p.startswith("127.0.0.1:") for p in peers)
    for s in specs:
        assert (s["peers"], s["token"], s["size"], s["version"], s["launcher"]) == (peers, token, np, 0, "mpirun")
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
    """Rank 0's timeout reaches the ranks that did register as a timeout too (not a refusal), so that
    kungfu.init() raises CollectiveTimeout on every rank."""
    port = _free_port()
    start = time.monotonic()
    server, client = _in_threads([lambda: _serve(port, 3, timeout=1.0), lambda: _register(port, 1, 3)])
    assert isinstance(server, TimeoutError) and "rank(s) [2] of 3 never registered within 1s" in str(server)
    assert isinstance(client, TimeoutError), repr(client)
    assert "gave up on rank 1: rank(s) [2] of 3 never registered" in str(client)
    assert time.monotonic() - start < 5


def test_a_rank_that_started_first_still_hears_which_rank_is_missing():
    """Each rank's deadline runs from its own start: rank 1 registered, its deadline passed, and it waits
    on for rank 0's (later) answer, which names the rank that never came."""
    port = _free_port()

    def late_server():
        time.sleep(0.6)
        return _serve(port, 3, timeout=1.0)

    start = time.monotonic()
    server, client = _in_threads([late_server, lambda: _register(port, 1, 3, timeout=1.0)])
    assert isinstance(server, TimeoutError) and "rank(s) [2] of 3 never registered" in str(server), repr(server)
    assert isinstance(client, TimeoutError) and "gave up on rank 1: rank(s) [2] of 3 never registered" in \
        str(client), repr(client)
    assert time.monotonic() - start < 5


def test_every_rank_raises_collective_timeout_when_one_never_comes(tmp_path):
    results = _mpirun(tmp_path, 3, ["-x", "KUNGFU_TIMEOUT=2"], script=INIT_SCRIPT, script_args=["1"])
    assert sorted(results) == [0, 2], results
    for rank, result in results.items():
        assert result.startswith("kungfu.errors.CollectiveTimeout: kungfu.init: rendezvous timed out: "), result
        assert result.count("timed out") == 1, result  # said once, not "timed out: rendezvous timed out"
    assert "rank(s) [1] of 3 never registered within 2s (KUNGFU_TIMEOUT, set by `mpirun -x KUNGFU_TIMEOUT=S`)" in \
        results[0], results[0]
    for result in results.values():
        assert result.count("(KUNGFU_TIMEOUT") == 1, result  # named once, not again at the end


def test_a_rendezvous_timeout_names_its_deadline_once(monkeypatch):
    """Rank 0's timeout (which the others get too), and a rank that cannot reach rank 0: the deadline's
    variable and what sets it are named once, where the message names the deadline."""
    monkeypatch.delenv("KUNGFU_PEERS", raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")  # what mpirun sets
    port = _free_port()
    knob = "(KUNGFU_TIMEOUT, set by `mpirun -x KUNGFU_TIMEOUT=S`)"
    for fake, said in [(lambda: _serve(port, 2, timeout=0.3), f"never registered within 0.3s {knob}; check"),
                       (lambda: _register(port, 1, 2, timeout=0.3), "before the deadline (KUNGFU_TIMEOUT, set by")]:
        monkeypatch.setattr(env_mod, "resolve_cluster", fake)
        with pytest.raises(kungfu.errors.CollectiveTimeout) as e:
            _lib._resolve_cluster()
        assert said in str(e.value) and str(e.value).count("(KUNGFU_TIMEOUT") == 1, str(e.value)


@pytest.mark.parametrize("value", ["inf", "1e12", "1e8", "10000000.5", "0.0001", "0", "-1", "nan", " 5", "soon", ""])
def test_kungfu_timeout_outside_the_engines_range_is_refused_at_once(value):
    """Before any rendezvous: no OverflowError from a socket timeout (inf, 1e12), no rendezvous that times
    out (0.0001) or waits for ages (1e8) before the engine refuses the value."""
    port = _free_port()
    start = time.monotonic()
    results = _in_threads([lambda r=r: env_mod.resolve_cluster(_ompi_env(r, 2, port, KUNGFU_TIMEOUT=value))
                           for r in range(2)], timeout=5)
    for e in results:
        assert isinstance(e, ValueError), repr(e)
        assert f"KUNGFU_TIMEOUT={value!r} is not a number of seconds from 0.001 to 1e+07" in str(e)
    assert time.monotonic() - start < 2


def test_kungfu_timeout_range_is_the_engines():
    assert env_mod.parse_timeout("0.001") == 0.001 and env_mod.parse_timeout("1e7") == 1e7
    assert (env_mod.TIMEOUT_MIN, env_mod.TIMEOUT_MAX) == (0.001, 1e7)  # ReadEnvNumber in cc/engine_api.cc
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cc", "engine_api.cc")) as f:
        assert 'ReadEnvNumber("KUNGFU_TIMEOUT", 0.001, 1e7, &timeout)' in f.read()


def test_init_under_mpirun_refuses_a_bad_kungfu_timeout(tmp_path):
    results = _mpirun(tmp_path, 2, ["-x", "KUNGFU_TIMEOUT=inf"], script=INIT_SCRIPT, timeout=30)
    assert sorted(results) == [0, 1], results
    for result in results.values():
        assert result.startswith("builtins.ValueError: KUNGFU_TIMEOUT='inf' is not a number of seconds from 0.001 "
                                 "to 1e+07"), result


def test_init_holds_the_engine_port_until_the_engine_binds_it(monkeypatch):
    """The port a rank reserves for its engine before the rendezvous stays bound while init() loads the
    library (and TensorFlow: seconds), so that no outgoing connection can take it; the engine binds it
    right after. Rank 0 runs init() with the loading and the engine faked; rank 1 only resolves."""
    port = _free_port()
    for name in [n for n in os.environ if n.startswith("KUNGFU_")]:
        monkeypatch.delenv(name)
    for name, value in _ompi_env(0, 2, port).items():
        monkeypatch.setenv(name, value)
    seen = {}

    def fake_load():  # the ports of this process's open sockets once "TensorFlow" has loaded
        seen["bound"] = {s.getsockname()[1] for s in gc.get_objects()
                         if isinstance(s, socket.socket) and s.fileno() >= 0}
        return SimpleNamespace(c=SimpleNamespace(kungfu_init=fake_engine_start))

    def fake_engine_start(peers, rank, token, timeout, version, err, err_len):
        own = int(peers.decode().split(",")[rank].rpartition(":")[2])
        seen["held during load"] = own in seen["bound"]
        with socket.socket() as s:  # as the engine binds it (cc/transport/socket.cc): released by now
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("0.0.0.0", own))
        return 0

    monkeypatch.setattr(_lib, "load", fake_load)
    monkeypatch.setattr(_lib, "_cluster", None)  # restored (to not initialized) at the end
    monkeypatch.setattr(_lib, "_atexit_registered", True)
    rank0, rank1 = _in_threads([_lib.init, lambda: env_mod.resolve_cluster(_ompi_env(1, 2, port))])
    assert rank0 is None and isinstance(rank1, env_mod.ClusterSpec), (rank0, rank1)
    assert seen["held during load"] and _lib.size() == 2


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


def test_init_errors_under_mpirun_name_mpiruns_knobs(monkeypatch):
    """Not kfrun's flags, which an mpirun user has no use for: in init's errors and in a collective's."""
    monkeypatch.delenv("KUNGFU_PEERS", raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")  # what mpirun sets
    cluster = env_mod.ClusterSpec(["127.0.0.1:25001", "127.0.0.1:25002"], 1, 2, 1, 2, "t", 5.0, 0, "mpirun")
    knob = "set by `mpirun -x KUNGFU_TIMEOUT=S`"
    for code, text, hint in [
        (4, "peer 127.0.0.1:25001 (rank 0): not up", f"(the deadline is KUNGFU_TIMEOUT, {knob})"),
        (4, "connecting to rank 0: timed out after 5 s (KUNGFU_TIMEOUT)", f"(KUNGFU_TIMEOUT, {knob})"),
        (14, "listening as 127.0.0.1:25002 (rank 1): bind port 25002: Address already in use", "start the job again"),
    ]:
        message = str(kungfu.errors.from_code(code, _lib._init_error_message(code, cluster, text)))
        assert hint in message and "kfrun" not in message, message
    collective = str(kungfu.errors.from_code(4, "allreduce 'g': timed out after 5 s (KUNGFU_TIMEOUT); waiting for "
                                                "rank 1"))
    assert f"(KUNGFU_TIMEOUT, {knob}); waiting for rank 1" in collective, collective

    def rendezvous_timeout():
        raise TimeoutError("still waiting for rank 0's rendezvous at 127.0.0.1:20001 to hear from all 2 ranks at the "
                           "deadline")

    monkeypatch.setattr(env_mod, "resolve_cluster", rendezvous_timeout)
    with pytest.raises(kungfu.errors.CollectiveTimeout) as e:
        _lib._resolve_cluster()
    assert str(e.value).endswith(f"2 ranks at the deadline (KUNGFU_TIMEOUT, {knob})"), str(e.value)
