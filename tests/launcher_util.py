"""What the kfrun tests share (test_launcher*.py): running kfrun, worker scripts that write their pids,
and the `reaper` fixture that kills every process a test started, whatever happened.
"""

import json
import os
import re
import resource
import signal
import subprocess
import sys
import time

import pytest

import kungfu

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

# A daemon, as a worker may start one: in a session of its own (so outside the worker's process group), it
# forks and its parent exits (so it is an orphan, re-parented), with its stdio on /dev/null. It writes its
# pid to $PID_DIR/d<rank> and sleeps.
DAEMON = """
import os, time
if os.fork():
    os._exit(0)
path = os.path.join(os.environ["PID_DIR"], "d" + os.environ["KUNGFU_RANK"])
with open(path + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(path + ".tmp", path)
time.sleep(120)
"""

# Writes its pid (and a grandchild's) to $PID_DIR, then behaves as argv[1] says for its rank.
PID_WORKER = """
import os, signal, subprocess, sys, time
rank = os.environ["KUNGFU_RANK"]
mode = dict(a.split("=") for a in sys.argv[1:]).get(rank, "hang")
if mode.startswith("stubborn"):  # its child inherits the ignored signals too; stubbornexit0: then exits 0
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    mode = mode[len("stubborn"):] or "hang"
if mode.startswith("detach"):  # detachexit0: starts a DAEMON first (stubborndetach...: one that ignores SIGTERM)
    subprocess.Popen([sys.executable, "-c", DAEMON_CODE], start_new_session=True, stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).wait()
    while not os.path.exists(os.path.join(os.environ["PID_DIR"], "d" + rank)):
        time.sleep(0.01)
    mode = mode[len("detach"):] or "hang"
if mode == "usr1":  # appends a line to $PID_DIR/u<rank> for every SIGUSR1, and runs on
    def on_usr1(signum, frame):
        with open(os.path.join(os.environ["PID_DIR"], "u" + rank), "a") as f:
            f.write("usr1\\n")
    signal.signal(signal.SIGUSR1, on_usr1)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
for name, pid in (("w", os.getpid()), ("c", child.pid)):
    with open(os.path.join(os.environ["PID_DIR"], f"{name}{rank}.tmp"), "w") as f:
        f.write(str(pid))
    os.rename(f.name, f.name[:-4])
if mode.startswith("exit"):  # exit7: exits with 7 (after 0.3 s); exit0@2: exits with 0 after 2 s
    code, _, after = mode[4:].partition("@")
    time.sleep(float(after or 0.3))
    sys.exit(int(code))
if mode.startswith("sig"):  # sig9: killed by signal 9
    time.sleep(0.3)
    os.kill(os.getpid(), int(mode[3:]))
print("ready", flush=True)
time.sleep(120)
""".replace("DAEMON_CODE", repr(DAEMON))


# Writes argv[1] lines of 101 bytes to stdout, or for a rank whose letter in argv[3] is "e" to stderr (rank 0
# the first letter), then its pid to $PID_DIR/f<rank>, and exits (rank 1 with argv[2], the others with 0).
# 500 lines fit in the pipe from a worker to kfrun: the workers finish even while nobody reads kfrun's output.
FILL_WORKER = """
import os, sys
rank = int(os.environ["KUNGFU_RANK"])
stream = sys.stderr if sys.argv[3][rank] == "e" else sys.stdout
for i in range(int(sys.argv[1])):
    stream.write(f"{rank} {i:05d} " + "x" * 92 + "\\n")
stream.flush()
path = os.path.join(os.environ["PID_DIR"], f"f{rank}")
with open(path + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(path + ".tmp", path)
sys.exit(int(sys.argv[2]) if rank == 1 else 0)
"""


def state(pid):
    """The process's state letter from /proc (R, S, T for stopped, Z, ...); None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def wait_until(predicate, what, timeout=10):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


def alive(pid):
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:  # a zombie is dead, just not yet reaped by its parent
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


@pytest.fixture
def reaper(tmp_path):
    """Yields (pid_dir, started): kills every kfrun in `started` and every pid in pid_dir at teardown (files
    w<rank>: a worker, c<rank>: its child, d<rank>: a daemon it started, s<n>: one that a fake ssh started)."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    started = []
    yield pid_dir, started
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    for f in pid_dir.glob("[wcds]*[0-9]"):
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


def _preexec(ignored, closed):
    def setup():
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGQUIT and friends: no core files in the tree
        for signum in ignored:
            signal.signal(signum, signal.SIG_IGN)
        for fd in closed:
            os.close(fd)
    return setup


def start_kfrun(args, reaper, extra_env=None, ignored=(), closed=(), stdout=subprocess.PIPE, stderr=subprocess.PIPE):
    """Starts kfrun in a session of its own; ignored: signals it starts with ignored (as nohup does);
    closed: its file descriptors to close (1: `kfrun ... >&-`), whose pipes here then read nothing;
    stdout, stderr: where they go (pipes read through proc.stdout and proc.stderr unless given)."""
    proc = subprocess.Popen(KFRUN + args, stdout=stdout, stderr=stderr, text=True,
                            env=_env(dict(extra_env or {}, PID_DIR=str(reaper[0]))), start_new_session=True,
                            preexec_fn=_preexec(ignored, closed))
    reaper[1].append(proc)
    return proc


def run_kfrun(args, reaper, extra_env=None, timeout=30, closed=()):
    proc = start_kfrun(args, reaper, extra_env, closed=closed)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def wait_for_files(pid_dir, names, timeout=15):
    deadline = time.monotonic() + timeout
    while not all((pid_dir / n).exists() for n in names):
        assert time.monotonic() < deadline, f"workers never wrote {names}; found {os.listdir(pid_dir)}"
        time.sleep(0.05)
    return {n: int((pid_dir / n).read_text()) for n in names}


def records(out):
    recs = {}
    for line in out.splitlines():
        m = re.match(r"\[(\d+)\] ENV (.*)$", line)
        if m:
            recs[int(m.group(1))] = json.loads(m.group(2))
    return recs


def fake_ssh_path(tmp_path, before=""):
    """A PATH whose `ssh` runs the remote command here, as sshd would (sh text `before` first). `ssh -G HOST`,
    which kfrun runs to read the user's configuration for HOST, prints none."""
    fake = tmp_path / "bin" / "ssh"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\n[ "$1" = -G ] && exit 0\n' + before +
                    'while [ $# -gt 0 ]; do case "$1" in -o) shift 2;; -*) shift;; *) break;; esac; done\n'
                    'shift\nexec sh -c "$*"\n')
    fake.chmod(0o755)
    return f"{fake.parent}:{os.environ['PATH']}"
