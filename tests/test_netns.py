"""kfrun across two "hosts": Linux network namespaces joined by a veth pair, with TensorFlow workers.

Each test builds its own cluster (netns_hosts): namespaces kf<pid>a and kf<pid>b, one veth pair between
them, addresses 10.77.X.1/24 and 10.77.X.2/24 (X from this process's pid), and `lo` up in both. Nothing
is sent to any other address: only the engines talk over the network, to each other. kfrun runs either in
the first namespace (a host of the job: its address is local, the other remote) or in this one, where
neither address exists (both remote). A remote host's workers start through a fake `ssh` (netns_ssh_path)
that runs the remote command inside the namespace owning the host's address, as sshd would: `sh -c "$cmd"`
with a bare login environment and stdin passed through.

At teardown, on every path, every process left in either namespace is SIGKILLed and the namespaces (and
with them the veths) are deleted. This needs root and iproute2 (`ip netns`); without them the tests fail
saying so (never skip, as conftest.py says of a missing library).
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from launcher_util import KFRUN, PYTHONPATH, wait_until

# Both modes ("once", "loop"): init, then the cluster's shape and exact collective values as one KFRESULT line
# per rank (and whether the worker inherited kfrun's environment: a local one). loop: then all-reduce until
# something fails; print "KFLOOP" once after a few rounds, and on the failure "KFERR <class> <message's first
# line>" and exit 3.
WORKER = r"""
import os, sys, time
import numpy as np
import tensorflow as tf
import kungfu
kungfu.init()
r, n = kungfu.rank(), kungfu.size()
lr, ls = kungfu.local_rank(), kungfu.local_size()
s = kungfu.all_reduce(np.arange(5, dtype=np.int64) * (r + 1), op="sum", name="sum").numpy().tolist()
b = kungfu.broadcast(np.full([3], 10 + r, np.int32), root=n - 1, name="bcast").numpy().tolist()
g = kungfu.all_gather(np.full([r + 1, 2], r, np.float32), name="gather").numpy()
kungfu.barrier()
print(f"KFRESULT rank={r} size={n} local={lr}/{ls} host={os.environ['KUNGFU_PEERS'].split(',')[r]} sum={s} "
      f"bcast={b} gather={g.shape[0]}x{g.shape[1]}:{g[:, 0].astype(int).tolist()} "
      f"inherited={os.environ.get('KF_NETNS_MARK', 0)}", flush=True)
if sys.argv[1] == "loop":
    x = tf.ones([1024])
    i = 0
    while True:
        try:
            kungfu.all_reduce(x, name="step")
        except Exception as e:
            print(f"KFERR {type(e).__name__} {str(e).splitlines()[0]}", flush=True)
            sys.exit(3)
        i += 1
        if i == 20:
            print("KFLOOP", flush=True)
        time.sleep(0.01)
"""


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=10,
                          check=check)


def _netns_pids(ns):
    res = _ip("netns", "pids", ns, check=False)
    return [int(p) for p in res.stdout.split()] if res.returncode == 0 else []


def _kill_all_in(ns):
    for _ in range(20):
        pids = _netns_pids(ns)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def _require_netns():
    if shutil.which("ip") is None:
        pytest.fail("test_netns needs iproute2's `ip` (Debian: apt-get install iproute2)")
    if os.geteuid() != 0:
        pytest.fail("test_netns needs root: it creates network namespaces with `ip netns add` (CI runs as root)")


def _check_reachable(ns_from, ns_to, addr):
    """A TCP connection from ns_from to a listener on addr in ns_to, and one byte back."""
    listener = subprocess.Popen(
        ["ip", "netns", "exec", ns_to, sys.executable, "-c",
         "import socket, sys\n"
         f"s = socket.create_server(({addr!r}, 0)); s.settimeout(10)\n"
         "print(s.getsockname()[1], flush=True)\n"
         "c, _ = s.accept(); c.sendall(b'k')\n"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        port = int(listener.stdout.readline() or 0)
        assert port, f"listener in {ns_to} failed: {listener.communicate(timeout=10)[1]}"
        res = subprocess.run(
            ["ip", "netns", "exec", ns_from, sys.executable, "-c",
             f"import socket; c = socket.create_connection(({addr!r}, {port}), timeout=5); assert c.recv(1) == b'k'"],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=15)
        assert res.returncode == 0, f"{ns_from} cannot reach {addr}:{port} in {ns_to}: {res.stderr}"
    finally:
        try:
            os.killpg(listener.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        listener.communicate()


class Hosts:
    def __init__(self, tag):
        x = os.getpid() % 250 + 1
        self.ns = [f"kf{tag}a", f"kf{tag}b"]
        self.addr = [f"10.77.{x}.1", f"10.77.{x}.2"]
        self.veth = ["kfveth0", "kfveth1"]  # inside ns[0] and ns[1]


@pytest.fixture
def netns_hosts():
    """Two namespaces joined by a veth pair; yields a Hosts. Torn down on every path."""
    _require_netns()
    h = Hosts(os.getpid())
    try:
        for ns in h.ns:
            _ip("netns", "del", ns, check=False)  # left over by an earlier run with this pid
        for ns in h.ns:
            _ip("netns", "add", ns)
        # Made inside the first namespace with its peer in the second: this namespace never holds either end.
        _ip("-n", h.ns[0], "link", "add", h.veth[0], "type", "veth", "peer", "name", h.veth[1], "netns", h.ns[1])
        for ns, veth, addr in zip(h.ns, h.veth, h.addr):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", veth, "up")
        _check_reachable(h.ns[0], h.ns[1], h.addr[1])
        _check_reachable(h.ns[1], h.ns[0], h.addr[0])
    except subprocess.CalledProcessError as e:
        _teardown(h)
        pytest.fail(f"cannot set up network namespaces ({' '.join(e.cmd)}: {e.stderr.strip()}); test_netns needs "
                    "root and a kernel that allows `ip netns add` and veth pairs")
    except BaseException:
        _teardown(h)
        raise
    try:
        yield h
    finally:
        _teardown(h)


def _teardown(h):
    for ns in h.ns:
        _kill_all_in(ns)
    for ns in h.ns:
        _ip("netns", "del", ns, check=False)  # takes its end of the veth pair, and so the pair, with it


def netns_ssh_path(tmp_path, hosts):
    """A PATH whose `ssh` runs the remote command in the namespace that owns the host's address, as sshd would:
    `sh -c "$cmd"` (the words after the host joined by spaces) in a bare login environment, stdin passed
    through. `ssh -G HOST` (kfrun reading the user's configuration) prints none; an unknown host is ssh's 255."""
    fake = tmp_path / "bin" / "ssh"
    fake.parent.mkdir()
    cases = "".join(f"  {addr}) ns={ns};;\n" for addr, ns in zip(hosts.addr, hosts.ns))
    fake.write_text(
        '#!/bin/sh\n'
        '[ "$1" = -G ] && exit 0\n'
        'while [ $# -gt 0 ]; do case "$1" in -o) shift 2;; --) shift; break;; -*) shift;; *) break;; esac; done\n'
        'host=$1; shift\n'
        'case "$host" in\n' + cases +
        '  *) echo "ssh: Could not resolve hostname $host" >&2; exit 255;;\n'
        'esac\n'
        'exec env -i HOME=/root USER=root LOGNAME=root SHELL=/bin/sh '
        'PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin '
        'ip netns exec "$ns" sh -c "$*"\n')
    fake.chmod(0o755)
    return f"{fake.parent}:{os.environ['PATH']}"


class Job:
    """kfrun in a session of its own, its output (stdout and stderr together) collected by a thread."""

    def __init__(self, argv, env, cwd):
        self.lines = []
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd, start_new_session=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def out(self):
        return "\n".join(self.lines)

    def wait(self, timeout):
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"kfrun did not finish within {timeout} s:\n{self.out[-6000:]}")
        self.reader.join(10)
        return self.proc.returncode

    def kill(self):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()


def _start(tmp_path, hosts, mode, timeout, extra=(), inside=None):
    """kfrun -np 4 on both hosts, 2 workers each; inside: the namespace kfrun runs in (else this one)."""
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUNGFU_", "OMPI_", "PMIX_"))}
    env.update(PATH=netns_ssh_path(tmp_path, hosts), PYTHONPATH=PYTHONPATH, PYTHONUNBUFFERED="1",
               TF_CPP_MIN_LOG_LEVEL="2", KF_NETNS_MARK="1")  # local workers inherit it, remote ones do not
    args = ["-np", "4", "-H", f"{hosts.addr[0]}:2,{hosts.addr[1]}:2", "--timeout", str(timeout), *extra,
            # the remote workers get none of kfrun's environment but what -x names
            "-x", "PATH", "-x", "PYTHONPATH", "-x", "PYTHONUNBUFFERED", "-x", "TF_CPP_MIN_LOG_LEVEL",
            "--", sys.executable, str(worker), mode]
    netns = ["ip", "netns", "exec", inside] if inside else []
    return Job(netns + KFRUN + args, env, str(tmp_path))


def _check_results(out, hosts, local_hosts=()):
    """Every rank printed the right values; those on local_hosts (indices into hosts.addr) inherited kfrun's
    environment (local workers), the others did not (started through ssh)."""
    results = dict(re.findall(r"^\[(\d)\] KFRESULT (.*)$", out, re.M))
    assert sorted(results) == ["0", "1", "2", "3"], out[-6000:]
    for r in range(4):
        host = hosts.addr[r // 2]
        want = (f"rank={r} size=4 local={r % 2}/2 host={host}:\\d+ sum=\\[0, 10, 20, 30, 40\\] bcast=\\[13, 13, 13\\] "
                f"gather=10x2:\\[0, 1, 1, 2, 2, 2, 3, 3, 3, 3\\] inherited={int(r // 2 in local_hosts)}$")
        assert re.match(want, results[str(r)]), f"rank {r}: {results[str(r)]}\n{out[-6000:]}"


def test_collectives_across_two_namespaces(tmp_path, netns_hosts):
    """kfrun runs on the first host (in its namespace): that host's address is local (its workers are started
    directly and inherit kfrun's environment), the other's is remote (ssh); exact collective values."""
    job = _start(tmp_path, netns_hosts, "once", 20, inside=netns_hosts.ns[0])
    try:
        rc = job.wait(90)
    finally:
        job.kill()
    assert rc == 0, job.out[-6000:]
    _check_results(job.out, netns_hosts, local_hosts=(0,))
    wait_until(lambda: not any(_netns_pids(ns) for ns in netns_hosts.ns), "no process is left in the namespaces", 5)


def test_a_link_that_goes_down_fails_the_job_naming_a_peer(tmp_path, netns_hosts):
    """kfrun runs here, outside both namespaces, so both hosts are remote. The veth goes down under a loop of
    all-reduces: every worker fails within the engine's timeout naming a rank it lost on the other host, kfrun
    exits with the first failure's code within a bound, and nothing is left running in either namespace."""
    timeout, grace, kill_after = 5, 3, 2
    job = _start(tmp_path, netns_hosts, "loop", timeout, ["--grace", str(grace), "--kill-after", str(kill_after)])
    try:
        deadline = time.monotonic() + 90
        while len(re.findall(r"^\[\d\] KFLOOP$", job.out, re.M)) < 4:
            assert job.proc.poll() is None, f"kfrun exited with {job.proc.returncode} early:\n{job.out[-6000:]}"
            assert time.monotonic() < deadline, f"the workers never started their loop:\n{job.out[-6000:]}"
            time.sleep(0.1)
        _ip("-n", netns_hosts.ns[1], "link", "set", netns_hosts.veth[1], "down")
        broken = time.monotonic()
        # timeout: the engine gives up; grace + kill_after: kfrun stops a worker that did not; 10: the remote
        # script's clean-up and slow exits on a loaded machine.
        bound = timeout + grace + kill_after + 10
        rc = job.wait(bound + 30)
        took = time.monotonic() - broken
    finally:
        job.kill()
    out = job.out
    _check_results(out, netns_hosts)
    assert rc == 3, f"kfrun exited with {rc}, not the first failed worker's 3:\n{out[-6000:]}"
    assert took < bound, f"kfrun took {took:.1f} s after the link went down (bound {bound} s):\n{out[-6000:]}"
    errors = dict(re.findall(r"^\[(\d)\] KFERR (.*)$", out, re.M))
    assert sorted(errors) == ["0", "1", "2", "3"], f"not every worker reported its failure:\n{out[-6000:]}"
    for r, err in errors.items():
        far = {str(q) for q in range(4) if q // 2 != int(r) // 2}
        named = set(re.findall(r"\brank (\d)\b", err))
        assert named & far, f"rank {r}'s error names no rank on the other host: {err}\n{out[-6000:]}"
    wait_until(lambda: not any(_netns_pids(ns) for ns in netns_hosts.ns), "no process is left in the namespaces", 3)
