"""kfrun: the worker environment contract, output, exit codes, shutdown, bad input, hosts and ssh.

kfrun runs as `python -m kungfu.launcher` (what the kfrun console script calls); workers are pure
Python, so no test here loads TensorFlow (`import kungfu` does not). Every process a test starts is
killed when the test ends, whatever happened (the `reaper` fixture).
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

import kungfu
from kungfu import _env as env_mod
from kungfu.launcher import hosts
from kungfu.launcher import plan
from kungfu.launcher import ssh

# Subprocesses import the same kungfu as this test, installed or from PYTHONPATH=python.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(kungfu.__file__)))
PYTHONPATH = os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))
KFRUN = [sys.executable, "-m", "kungfu.launcher"]

# Prints the KUNGFU_* environment and what resolve_cluster() makes of it, then one stderr line.
ENV_WORKER = """
import json, os, dataclasses, sys
from kungfu._env import resolve_cluster
env = {k: v for k, v in os.environ.items() if k.startswith("KUNGFU_")}
print("ENV " + json.dumps({"env": env, "spec": dataclasses.asdict(resolve_cluster())}))
print("to stderr", file=sys.stderr)
"""

# Writes its pid (and a grandchild's) to $PID_DIR, then behaves as argv[1] says for its rank.
PID_WORKER = """
import os, signal, subprocess, sys, time
rank = os.environ["KUNGFU_RANK"]
mode = dict(a.split("=") for a in sys.argv[1:]).get(rank, "hang")
if mode == "stubborn":  # its child inherits the ignored signals too
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
for name, pid in (("w", os.getpid()), ("c", child.pid)):
    with open(os.path.join(os.environ["PID_DIR"], f"{name}{rank}.tmp"), "w") as f:
        f.write(str(pid))
    os.rename(f.name, f.name[:-4])
if mode.startswith("exit"):
    time.sleep(0.3)
    sys.exit(int(mode[4:]))
print("ready", flush=True)
time.sleep(120)
"""


def _alive(pid):
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:  # a zombie is dead, just not yet reaped by its parent
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


@pytest.fixture
def reaper(tmp_path):
    """Yields (pid_dir, started): kills every kfrun in `started` and every pid in pid_dir at teardown."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    started = []
    yield pid_dir, started
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    for f in pid_dir.glob("[wc]*[0-9]"):
        pid = int(f.read_text())
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _env(extra=None):
    env = dict(os.environ, PYTHONPATH=PYTHONPATH)
    env.update(extra or {})
    return env


def start_kfrun(args, reaper, extra_env=None):
    proc = subprocess.Popen(KFRUN + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(dict(extra_env or {}, PID_DIR=str(reaper[0]))), start_new_session=True)
    reaper[1].append(proc)
    return proc


def run_kfrun(args, reaper, extra_env=None, timeout=30):
    proc = start_kfrun(args, reaper, extra_env)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def _wait_for_files(pid_dir, names, timeout=15):
    deadline = time.monotonic() + timeout
    while not all((pid_dir / n).exists() for n in names):
        assert time.monotonic() < deadline, f"workers never wrote {names}; found {os.listdir(pid_dir)}"
        time.sleep(0.05)
    return {n: int((pid_dir / n).read_text()) for n in names}


def _records(out):
    recs = {}
    for line in out.splitlines():
        m = re.match(r"\[(\d+)\] ENV (.*)$", line)
        if m:
            recs[int(m.group(1))] = json.loads(m.group(2))
    return recs


@pytest.mark.parametrize("np", [1, 2, 3, 4])
def test_env_contract(np, reaper, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(ENV_WORKER)
    rc, out, err = run_kfrun(["-np", str(np), "--timeout", "7", "--", sys.executable, str(script)], reaper)
    assert rc == 0, err
    recs = _records(out)
    assert sorted(recs) == list(range(np)), out
    peers = recs[0]["env"]["KUNGFU_PEERS"].split(",")
    assert len(peers) == np and len({p.split(":")[1] for p in peers}) == np
    token = recs[0]["env"]["KUNGFU_TOKEN"]
    assert re.fullmatch(r"[0-9a-f]{64}", token)
    for rank, rec in recs.items():
        env, spec = rec["env"], rec["spec"]
        assert env["KUNGFU_PEERS"].split(",") == peers and env["KUNGFU_TOKEN"] == token
        assert (env["KUNGFU_RANK"], env["KUNGFU_SIZE"]) == (str(rank), str(np))
        assert (env["KUNGFU_LOCAL_RANK"], env["KUNGFU_LOCAL_SIZE"]) == (str(rank), str(np))
        assert (env["KUNGFU_TIMEOUT"], env["KUNGFU_CLUSTER_VERSION"]) == ("7", "0")
        assert spec == {"peers": peers, "rank": rank, "size": np, "local_rank": rank, "local_size": np,
                        "token": token, "timeout": 7.0, "version": 0}
    assert sorted(err.splitlines()) == [f"[{r}] to stderr" for r in range(np)]


def test_output_lines_never_interleave(reaper):
    code = "import os\nr = os.environ['KUNGFU_RANK']\nfor i in range(300): print(r * 3000, flush=True)"
    rc, out, err = run_kfrun(["-np", "3", "--", sys.executable, "-c", code], reaper)
    assert rc == 0, err
    lines = out.splitlines()
    assert len(lines) == 900
    for line in lines:
        assert re.fullmatch(r"\[(\d)\] (\1){3000}", line), line[:80]


def test_output_filename_copies_each_workers_output(reaper, tmp_path):
    code = ("import os, sys\nr = os.environ['KUNGFU_RANK']\nprint('out', r, flush=True)\n"
            "print('err', r, file=sys.stderr, flush=True)\nsys.exit(3 if r == '1' else 0)")
    logs = tmp_path / "logs"
    rc, out, err = run_kfrun(["-np", "2", "--output-filename", str(logs), "--", sys.executable, "-c", code], reaper)
    assert rc == 3, err
    assert sorted(out.splitlines()) == ["[0] out 0", "[1] out 1"]  # the console still gets every line
    for r in range(2):
        assert (logs / f"rank.{r}" / "stdout").read_text() == f"out {r}\n"
        assert (logs / f"rank.{r}" / "stderr").read_text() == f"err {r}\n"
    blocker = tmp_path / "file"
    blocker.write_text("")
    rc, out, err = run_kfrun(["-np", "1", "--output-filename", str(blocker / "logs"), "--", "true"], reaper)
    assert rc == 2 and "--output-filename" in err and "cannot make" in err, err


def test_first_failure_exit_code_propagates(reaper):
    # No `--`: parsing stops at the first non-flag, so the command keeps "0=exit0" and the like.
    rc, out, err = run_kfrun(["-np", "3", sys.executable, "-c", PID_WORKER, "0=exit0", "1=exit7", "2=exit0"], reaper)
    assert rc == 7
    assert "worker 1 (127.0.0.1:" in err and "exit code 7" in err


def test_hanging_workers_are_stopped_after_grace(reaper):
    pid_dir, _ = reaper
    args = ["-np", "3", "--grace", "1", "--kill-after", "1", "--", sys.executable, "-c", PID_WORKER,
            "0=exit3", "1=hang", "2=stubborn"]
    start = time.monotonic()
    rc, out, err = run_kfrun(args, reaper)
    assert rc == 3 and time.monotonic() - start < 15, err
    assert "--grace" in err and "SIGKILL" in err
    pids = _wait_for_files(pid_dir, [f"{k}{r}" for k in "wc" for r in range(3)])
    assert not [n for n, pid in pids.items() if _alive(pid)], "processes left behind"


def test_success_leaves_no_grandchild(reaper):
    pid_dir, _ = reaper
    rc, out, err = run_kfrun(["-np", "2", "--kill-after", "1", "--", sys.executable, "-c", PID_WORKER,
                              "0=exit0", "1=exit0"], reaper)
    assert rc == 0, err
    pids = _wait_for_files(pid_dir, ["c0", "c1"])
    assert not [n for n, pid in pids.items() if _alive(pid)], "grandchildren left behind"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_kfrun_stops_every_process(signum, reaper):
    pid_dir, _ = reaper
    proc = start_kfrun(["-np", "3", "--kill-after", "1", "--", sys.executable, "-c", PID_WORKER, "2=stubborn"], reaper)
    pids = _wait_for_files(pid_dir, [f"{k}{r}" for k in "wc" for r in range(3)])
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 128 + signum, err
    assert f"got {signal.Signals(signum).name}" in err
    assert not [n for n, pid in pids.items() if _alive(pid)], "processes left behind"


@pytest.mark.parametrize("args, message", [
    (["-np", "0", "--", "x"], "-np must be at least 1"),
    (["--", "x"], "-np is required"),
    (["-np", "2"], "no worker command"),
    (["-np", "5", "-H", "127.0.0.1:4", "--", "x"], "-np 5 needs 5 slots but the hosts give 4"),
    (["-np", "1", "-H", "a:b", "--", "x"], "slots must be a positive integer"),
    (["-np", "1", "-H", "a:1,,b:1", "--", "x"], "expected host:slots"),
    (["-np", "1", "--hostfile", "/nonexistent/hosts", "--", "x"], "cannot read it"),
    (["-np", "1", "-H", "a:1", "--hostfile", "f", "--", "x"], "either -H or --hostfile"),
    (["-np", "1", "--port-range", "20-10", "--", "x"], "--port-range '20-10'"),
    (["-np", "1", "--timeout", "0", "--", "x"], "--timeout must be between 0.001 and 1e+07 seconds"),
    (["-np", "two", "--", "x"], "--np=two"),
    (["-np", "1", "--bogus", "--", "x"], "bogus"),
    (["-np", "2", "-H", "127.0.0.1:1,nohost.invalid:1", "--", "x"], "loopback name"),
    (["-np", "1", "-H", "[::1]:1", "--", "x"], "IPv6"),
    (["-np", "1", "--timeout", "1e10", "--", "x"], "--timeout must be between"),
    (["-np", "1", "--timeout", "0.0001", "--", "x"], "--timeout must be"),
    (["-np", "1", "--grace", "nan", "--", "x"], "--grace must not be negative"),
    (["-np", "1", "--kill-after", "inf", "--", "x"], "--kill-after must be positive"),
    (["-np", "1", "-x", "KUNGFU_RANK=0", "--", "x"], "kfrun sets KUNGFU_RANK for each worker itself"),
    (["-np", "1", "-x", "KUNGFU_TIMEOUT=5", "--", "x"], "use --timeout"),
])
def test_bad_arguments(args, message, reaper):
    rc, out, err = run_kfrun(args, reaper)
    assert rc == 2 and message in err and "kfrun --help" in err, err


def test_kungfu_timeout_in_the_environment_is_the_default(reaper):
    code = "import os; print(os.environ['KUNGFU_TIMEOUT'])"
    rc, out, err = run_kfrun(["-np", "1", "--", sys.executable, "-c", code], reaper, {"KUNGFU_TIMEOUT": "300"})
    assert (rc, out) == (0, "[0] 300\n"), err
    rc, out, err = run_kfrun(["-np", "1", "--timeout", "7", "--", sys.executable, "-c", code], reaper,
                             {"KUNGFU_TIMEOUT": "300"})
    assert (rc, out) == (0, "[0] 7\n"), err
    rc, out, err = run_kfrun(["-np", "1", "--", "true"], reaper, {"KUNGFU_TIMEOUT": "soon"})
    assert rc == 2 and "KUNGFU_TIMEOUT='soon'" in err, err


def test_x_sets_the_variable_for_every_worker(reaper):
    code = "import os; print(os.environ['FOO'], os.environ['KUNGFU_RING_THRESHOLD'])"
    rc, out, err = run_kfrun(["-np", "2", "-x", "FOO=bar", "-x", "KUNGFU_RING_THRESHOLD=0", "--", sys.executable,
                              "-c", code], reaper, {"FOO": "inherited"})
    assert rc == 0, err
    assert sorted(out.splitlines()) == ["[0] bar 0", "[1] bar 0"]


def test_signals_are_forwarded_while_output_is_blocked(reaper):
    """Nobody reads kfrun's output here, so its output threads block; SIGINT must still stop the job."""
    pid_dir, _ = reaper
    code = ("import os, signal, sys, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
            "path = os.path.join(os.environ['PID_DIR'], 'w0')\nopen(path + '.tmp', 'w').write(str(os.getpid()))\n"
            "os.rename(path + '.tmp', path)\nfor _ in range(2000): print('x' * 1000, flush=True)\ntime.sleep(120)")
    proc = start_kfrun(["-np", "1", "--kill-after", "1", "--", sys.executable, "-c", code], reaper)
    pid = _wait_for_files(pid_dir, ["w0"])["w0"]
    time.sleep(1)  # the pipes fill: kfrun's pump now blocks writing to its stdout
    proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), "the worker outlived --kill-after while kfrun's output was blocked"
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 128 + signal.SIGINT and "got SIGINT" in err, err[-2000:]


def test_command_not_found(reaper):
    rc, out, err = run_kfrun(["-np", "2", "--", "/nonexistent/program"], reaper)
    assert rc == 127 and "cannot start worker 0: /nonexistent/program" in err


def test_help(reaper):
    rc, out, err = run_kfrun(["--help"], reaper)
    assert rc == 0 and "usage: kfrun" in out and "--port-range" in out


def test_parse_hostfile():
    text = "# cluster\n10.1.0.1 slots=4  # first\n\n10.1.0.2:2\nnode3\n"
    assert hosts.parse_hostfile_text(text) == [
        hosts.HostSpec("10.1.0.1", 4), hosts.HostSpec("10.1.0.2", 2), hosts.HostSpec("node3", 1)]
    for bad, message in [("h slots=0", "hostfile:1: slots must be"), ("a:1\nh cores=2", "hostfile:2: expected"),
                         ("a:1\na slots=2", "listed twice"), ("# none\n", "no hosts listed"), ("a b c", "expected")]:
        with pytest.raises(hosts.UsageError, match=message):
            hosts.parse_hostfile_text(bad)


def test_parse_hostfile_drops_a_byte_order_mark(tmp_path):
    path = tmp_path / "hosts"
    path.write_bytes("\ufeffnode1 slots=2\n".encode("utf-8"))
    assert hosts.parse_hostfile(str(path)) == [hosts.HostSpec("node1", 2)]


def test_parse_host_list():
    assert hosts.parse_host_list("127.0.0.1:4,10.1.0.2:4") == [
        hosts.HostSpec("127.0.0.1", 4), hosts.HostSpec("10.1.0.2", 4)]
    assert hosts.parse_host_list("node") == [hosts.HostSpec("node", 1)]
    for bad in ["", "a:", "a:-1", "a:1,", "a b:1", "a:1:2"]:
        with pytest.raises(hosts.UsageError):
            hosts.parse_host_list(bad)


def test_is_local():
    assert hosts.is_local("127.0.0.1") and hosts.is_local("localhost")
    assert not hosts.is_local("nohost.invalid") and not hosts.is_local("192.0.2.254")


def test_plan_fills_hosts_in_order():
    local = {"127.0.0.1": True, "localhost": True, "10.1.0.2": False, "10.1.0.3": False}.__getitem__
    spec = [hosts.HostSpec("127.0.0.1", 2), hosts.HostSpec("10.1.0.2", 2), hosts.HostSpec("localhost", 1),
            hosts.HostSpec("10.1.0.3", 9)]
    busy = {10001}
    workers = plan.plan_workers(spec, 6, (10000, 10010), local_check=local, port_free=lambda p: p not in busy)
    got = [(w.rank, w.addr, w.local_rank, w.local_size, w.is_local) for w in workers]
    assert got == [
        (0, "127.0.0.1:10000", 0, 3, True), (1, "127.0.0.1:10002", 1, 3, True),  # 10001 is taken
        (2, "10.1.0.2:10000", 0, 2, False), (3, "10.1.0.2:10001", 1, 2, False),
        (4, "localhost:10003", 2, 3, True),  # same machine as 127.0.0.1: shares its ports
        (5, "10.1.0.3:10000", 0, 1, False)]
    with pytest.raises(hosts.UsageError, match="widen --port-range"):
        plan.plan_workers(spec[:1], 2, (10000, 10001), local_check=local, port_free=lambda p: p != 10001)


def test_plan_skips_a_port_in_use():
    import socket
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        workers = plan.plan_workers([hosts.HostSpec("127.0.0.1", 2)], 2, (port, min(port + 50, 65535)))
    assert port not in [w.port for w in workers]


def test_worker_env_contract():
    workers = plan.plan_workers([hosts.HostSpec("127.0.0.1", 2)], 2, (10000, 10100), port_free=lambda p: True)
    env = plan.worker_env(workers[1], workers, "tok", 12.5, environ={})
    assert env == {"KUNGFU_PEERS": "127.0.0.1:10000,127.0.0.1:10001", "KUNGFU_RANK": "1", "KUNGFU_SIZE": "2",
                   "KUNGFU_LOCAL_RANK": "1", "KUNGFU_LOCAL_SIZE": "2", "KUNGFU_TOKEN": "tok",
                   "KUNGFU_TIMEOUT": "12.5", "KUNGFU_CLUSTER_VERSION": "0", "TF_CPU_ALLOCATOR_USE_BFC": "true"}


def test_worker_defaults_yield_to_the_callers_environment():
    workers = plan.plan_workers([hosts.HostSpec("127.0.0.1", 1)], 1, (10000, 10100), port_free=lambda p: True)
    env = plan.worker_env(workers[0], workers, "tok", 1, environ={"TF_CPU_ALLOCATOR_USE_BFC": "false"})
    assert "TF_CPU_ALLOCATOR_USE_BFC" not in env  # the worker inherits the caller's "false"


@pytest.mark.parametrize("env, message", [
    ({"KUNGFU_PEERS": "a:1,b:2", "KUNGFU_RANK": "2"}, "KUNGFU_RANK=2 is out of range"),
    ({"KUNGFU_PEERS": "a:1,b:2"}, "KUNGFU_RANK is not set"),
    ({"KUNGFU_PEERS": "a:1,b:2", "KUNGFU_RANK": "x"}, "KUNGFU_RANK='x' is not an integer"),
    ({"KUNGFU_PEERS": "a:1,b:2", "KUNGFU_RANK": "0", "KUNGFU_SIZE": "3"}, "KUNGFU_SIZE=3 but"),
    ({"KUNGFU_PEERS": "a:1,a:1", "KUNGFU_RANK": "0"}, "lists a:1 twice"),
    ({"KUNGFU_PEERS": "a:99999", "KUNGFU_RANK": "0"}, "KUNGFU_PEERS: 'a:99999'"),
    ({"KUNGFU_PEERS": "a:1", "KUNGFU_RANK": "0", "KUNGFU_LOCAL_RANK": "1"}, "KUNGFU_LOCAL_RANK=1"),
    ({"KUNGFU_PEERS": "a:1", "KUNGFU_RANK": "0", "KUNGFU_TIMEOUT": "-1"}, "KUNGFU_TIMEOUT"),
    ({"KUNGFU_RANK": "0"}, "KUNGFU_RANK is set but KUNGFU_PEERS is not"),
])
def test_resolve_cluster_rejects_bad_kfrun_variables(env, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        env_mod.resolve_cluster(env)


def test_resolve_cluster_defaults():
    spec = env_mod.resolve_cluster({"KUNGFU_PEERS": "h:1,g:2,h:3", "KUNGFU_RANK": "2"})
    assert (spec.size, spec.local_rank, spec.local_size, spec.token, spec.timeout) == (3, 1, 2, "", 60.0)
    lone = env_mod.resolve_cluster({})
    assert (lone.peers, lone.rank, lone.size, lone.token) == ([], 0, 1, "")


def test_ssh_command_construction():
    argv = ssh.ssh_command("10.1.0.2", "/data/my job", {"KUNGFU_RANK": "1"}, ["python", "t.py", "--x=a b"], 30)
    assert argv[:6] == ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=30", "10.1.0.2"]
    assert argv[6].startswith("sh -c ") and len(argv) == 7
    assert "KUNGFU_TOKEN=" not in argv[6]  # the token travels on stdin
    with pytest.raises(ValueError):
        ssh.ssh_command("h", "/", {"KUNGFU_TOKEN": "t"}, ["x"])
    with pytest.raises(ValueError):
        ssh.ssh_command("h", "/", {"BAD NAME": "t"}, ["x"])


def test_ssh_remote_command_runs_under_a_login_shell(tmp_path, reaper):
    """Runs the remote string as sshd would ($SHELL -c "..."), with no ssh involved."""
    code = "import os,sys; print(os.getcwd(), os.environ['A'], os.environ['KUNGFU_TOKEN'], sys.argv[1]); sys.exit(5)"
    workdir = tmp_path / "dir with 'quotes'"
    workdir.mkdir()
    argv = ssh.ssh_command("h", str(workdir), {"A": "x'y \"z $HOME"}, [sys.executable, "-c", code, "a;b"])
    proc = subprocess.Popen(["sh", "-c", argv[-1]], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    reaper[1].append(proc)
    proc.stdin.write("secret\n")
    proc.stdin.flush()  # and keep stdin open, as kfrun does: closing it stops the worker
    out = proc.stdout.read()
    assert (proc.wait(timeout=20), out) == (5, f"{workdir} x'y \"z $HOME secret a;b\n")
    proc.stdin.close()


def test_ssh_remote_worker_dies_when_stdin_closes(reaper):
    pid_dir, _ = reaper
    argv = ssh.ssh_command("h", "/", {"KUNGFU_RANK": "0", "PID_DIR": str(pid_dir)}, [sys.executable, "-c", PID_WORKER],
                           kill_after=1)
    proc = subprocess.Popen(["sh", "-c", argv[-1]], stdin=subprocess.PIPE, start_new_session=True)
    reaper[1].append(proc)
    proc.stdin.write(b"secret\n")
    proc.stdin.flush()
    pids = _wait_for_files(pid_dir, ["w0", "c0"])
    proc.stdin.close()  # what kfrun does to stop it, and what sshd does when kfrun or ssh dies
    assert proc.wait(timeout=10) == 128 + signal.SIGTERM
    time.sleep(0.2)
    assert not [n for n, pid in pids.items() if _alive(pid)]


def _fake_ssh_path(tmp_path):
    """A PATH whose `ssh` runs the remote command here, as sshd would."""
    fake = tmp_path / "bin" / "ssh"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\nwhile [ $# -gt 0 ]; do case "$1" in -o) shift 2;; -*) shift;; *) break;; esac; done\n'
                    'shift\nexec sh -c "$*"\n')
    fake.chmod(0o755)
    return f"{fake.parent}:{os.environ['PATH']}"


def test_remote_workers_through_fake_ssh(tmp_path, reaper):
    """kfrun's ssh path end to end, with an `ssh` that runs the command here as sshd would."""
    pid_dir, _ = reaper
    proc = start_kfrun(["-np", "3", "-H", "nohost-a.invalid:2,nohost-b.invalid:1", "-x", "PYTHONPATH", "-x",
                        f"PID_DIR={pid_dir}", "--kill-after", "1", "--", sys.executable, "-c", PID_WORKER],
                       reaper, {"PATH": _fake_ssh_path(tmp_path)})
    pids = _wait_for_files(pid_dir, [f"{k}{r}" for k in "wc" for r in range(3)])
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert sorted(out.splitlines()) == ["[0] ready", "[1] ready", "[2] ready"]
    time.sleep(0.2)
    assert not [n for n, pid in pids.items() if _alive(pid)], "remote processes left behind"


def test_remote_worker_leaves_no_grandchild(tmp_path, reaper):
    """A remote worker that exits leaves a child running in its (setsid) group: the remote script stops it."""
    pid_dir, _ = reaper
    rc, out, err = run_kfrun(["-np", "2", "-H", "nohost-a.invalid:1,nohost-b.invalid:1", "-x", "PYTHONPATH", "-x",
                              f"PID_DIR={pid_dir}", "--kill-after", "1", "--", sys.executable, "-c", PID_WORKER,
                              "0=exit0", "1=exit0"], reaper, {"PATH": _fake_ssh_path(tmp_path)})
    assert rc == 0, err
    pids = _wait_for_files(pid_dir, ["c0", "c1"])
    time.sleep(0.2)
    assert not [n for n, pid in pids.items() if _alive(pid)], "remote grandchildren left behind"
