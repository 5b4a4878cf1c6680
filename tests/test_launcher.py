"""kfrun: the worker environment contract, output, exit codes, shutdown, bad input, hosts and ssh.

kfrun runs as `python -m kungfu.launcher` (what the kfrun console script calls); workers are pure
Python, so no test here loads TensorFlow (`import kungfu` does not). Every process a test starts is
killed when the test ends, whatever happened (the `reaper` fixture, launcher_util.py). Signals to kfrun
and workers that stall at the end are tested in test_launcher_signals.py.
"""

import os
import re
import select
import signal
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest

from kungfu import _env as env_mod
from kungfu import _lib
from kungfu import errors
from kungfu.launcher import cli
from kungfu.launcher import hosts
from kungfu.launcher import orphans
from kungfu.launcher import plan
from kungfu.launcher import ssh
from launcher_util import ENV_WORKER, FILL_WORKER, PID_WORKER, PYTHONPATH, alive, fake_ssh_path, records, run_kfrun
from launcher_util import start_kfrun
from launcher_util import state, wait_for_files, wait_until
from launcher_util import reaper  # noqa: F401  (a fixture)


REJOIN_WORKER = """
import kungfu, kungfu.errors
kungfu.init()
kungfu.finalize()
try:
    kungfu.init()
except kungfu.errors.EngineError as e:
    print("REFUSED", e)
"""


def test_a_worker_that_left_its_cluster_cannot_init_again(reaper, tmp_path):
    # Its peers have said goodbye: a second init() half-joined (its collectives failed with Unavailable,
    # a peer's init timed out). It is a clear error instead.
    script = tmp_path / "rejoin.py"
    script.write_text(REJOIN_WORKER)
    rc, out, err = run_kfrun(["-np", "2", "--timeout", "10", "--", sys.executable, str(script)], reaper)
    assert rc == 0, err
    for rank in (0, 1):
        assert f"[{rank}] REFUSED kungfu.init: this process was rank {rank} of 2 and left that cluster" in out, out


@pytest.mark.parametrize("np", [1, 2, 3, 4])
def test_env_contract(np, reaper, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(ENV_WORKER)
    rc, out, err = run_kfrun(["-np", str(np), "--timeout", "7", "--", sys.executable, str(script)], reaper)
    assert rc == 0, err
    recs = records(out)
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
                        "token": token, "timeout": 7.0, "version": 0, "launcher": "kfrun"}
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


@pytest.mark.parametrize("closed", [1, 2], ids=["stdout", "stderr"])
def test_a_closed_output_stream_is_dropped_as_mpirun_does(closed, reaper):
    """`kfrun ... >&-` (or 2>&-): the job runs, what would go to the closed stream is dropped, the rest is
    shown, and the exit code is the job's."""
    code = "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"
    rc, out, err = run_kfrun(["-np", "2", "--", sys.executable, "-c", code], reaper, closed=[closed])
    assert rc == 3 and "Traceback" not in out + err, err
    if closed == 1:
        assert (out, sorted(err.splitlines())[:2]) == ("", ["[0] err", "[1] err"]), err
        assert "failed with exit code 3" in err
    else:
        assert (sorted(out.splitlines()), err) == (["[0] out", "[1] out"], ""), err
    rc, out, err = run_kfrun(["-np", "0", "--", "true"], reaper, closed=[closed])
    assert rc == 2 and "Traceback" not in out + err, err


def test_a_later_failure_with_a_code_of_its_own_is_reported_too(reaper, tmp_path):
    """Ranks 1 to 3 fail after rank 0 failed with 1 (as a worker that called sys.exit(3) exits last, after its
    peers failed for want of it), with 3, 1 and 3: kfrun names codes 1 and 3 once each and exits with 1."""
    marker = tmp_path / "rank0-failing"
    code = ("import os, sys, time; r = int(os.environ['KUNGFU_RANK']); m = %r\n"
            "if r == 0: open(m, 'w').close(); sys.exit(1)\n"
            "while not os.path.exists(m): time.sleep(0.01)\n"
            "time.sleep(0.3 * r); sys.exit({1: 3, 2: 1, 3: 3}[r])" % str(marker))
    rc, out, err = run_kfrun(["-np", "4", "--", sys.executable, "-c", code], reaper)
    notes = [line for line in err.splitlines() if line.startswith("[kfrun] ")]
    assert rc == 1, err
    assert len(notes) == 2, notes  # the second 1 and the second 3 repeat codes already named
    assert "worker 0 (" in notes[0] and "failed with exit code 1" in notes[0], notes
    assert "also failed, with exit code 3" in notes[1], notes


def _fill_lines(rank, n=500):
    return [f"[{rank}] {rank} {i:05d} " + "x" * 92 for i in range(n)]


@pytest.mark.parametrize("streams", ["oo", "ee"], ids=["stdout", "stderr"])
def test_all_output_reaches_a_reader_that_pauses(streams, reaper):
    """The workers finish while nobody reads kfrun's output (a pager, a reader that pauses; 2 x 500 lines are
    more than a pipe holds): kfrun writes all of it, and its own notes, however long the reader pauses (not
    just 2 s), as mpirun does, and then exits."""
    pid_dir, _ = reaper
    proc = start_kfrun(["-np", "2", "--", sys.executable, "-c", FILL_WORKER, "500", "3", streams], reaper)
    wait_for_files(pid_dir, ["f0", "f1"])
    time.sleep(3)
    assert proc.poll() is None, "kfrun exited before its output was read"
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 3, err[-2000:]
    notes = [line for line in err.splitlines() if line.startswith("[kfrun] ")]
    lines = (out if streams == "oo" else err).splitlines()
    for rank in (0, 1):
        assert [line for line in lines if line.startswith(f"[{rank}] ")] == _fill_lines(rank)
    assert len(lines) == 1000 + (len(notes) if streams == "ee" else 0)
    assert len(notes) == 1 and notes[0].startswith("[kfrun] worker 1 (127.0.0.1:"), notes
    assert "failed with exit code 3" in notes[0], notes


def test_output_to_a_non_blocking_pipe_is_complete(reaper):
    """Another process sharing kfrun's stdout made it non-blocking (O_NONBLOCK): a full pipe is then EAGAIN,
    which is not a reader that went away; kfrun waits until it can write, and writes every line whole."""
    r, w = os.pipe()
    try:
        os.set_blocking(w, False)
        proc = start_kfrun(["-np", "2", "--", sys.executable, "-c", FILL_WORKER, "500", "0", "oo"], reaper, stdout=w)
        os.close(w)
        w = None
        time.sleep(1.5)  # the pipe fills: kfrun's writes fail with EAGAIN
        data = b""
        while True:
            assert select.select([r], [], [], 20)[0], "kfrun's output stopped"
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            data += chunk
        assert proc.wait(timeout=20) == 0, proc.stderr.read()
    finally:
        os.close(r)
        if w is not None:
            os.close(w)
    lines = data.decode().splitlines()
    assert [x for x in lines if x.startswith("[0]")] == _fill_lines(0) and len(lines) == 1000
    assert [x for x in lines if x.startswith("[1]")] == _fill_lines(1)


CHATTY_WORKER = """
import os, sys, time
rank = os.environ["KUNGFU_RANK"]
path = os.path.join(os.environ["PID_DIR"], "w" + rank)
with open(path + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(path + ".tmp", path)
for i in range(6000):  # a minute of output, unless the job is ended
    print(f"{rank} line {i}", flush=True)
    time.sleep(0.01)
"""


def test_a_reader_that_goes_away_ends_the_job(reaper):
    """`kfrun ... | head -2`: once the reader of kfrun's stdout has gone, kfrun's next write fails with EPIPE
    and the job ends, as a pipeline ends a command whose reader exited (and as mpirun does): every worker
    gets SIGTERM and kfrun exits with 141 (128 + SIGPIPE) at once, not when the workers would have finished
    (a minute here). It used to drop the output and let the job run on."""
    pid_dir, _ = reaper
    r, w = os.pipe()
    try:
        proc = start_kfrun(["-np", "2", "--kill-after", "2", "--", sys.executable, "-c", CHATTY_WORKER], reaper,
                           stdout=w)
        os.close(w)
        w = None
        pids = wait_for_files(pid_dir, ["w0", "w1"], timeout=30)
        with os.fdopen(r, "rb") as reader:  # as head -2 does: two lines, then gone
            r = None
            lines = [reader.readline() for _ in range(2)]
        gone = time.monotonic()
        code = proc.wait(timeout=30)
        took = time.monotonic() - gone
    finally:
        for fd in (r, w):
            if fd is not None:
                os.close(fd)
    err = proc.stderr.read()
    assert all(re.match(rb"\[[01]\] [01] line \d+\n$", line) for line in lines), lines
    assert code == 141, err[-2000:]
    assert took < 15, f"kfrun took {took:.1f} s to end the job"
    assert "[kfrun] the reader of kfrun's stdout went away (EPIPE); sent SIGTERM to every worker" in err, err[-2000:]
    assert not any(alive(pid) for pid in pids.values())


def test_a_signal_while_kfrun_still_writes_the_output_drops_the_rest(reaper):
    """The workers are gone and nobody reads kfrun's output: Ctrl-C ends the wait, and kfrun says what it
    dropped and exits with 128+2."""
    pid_dir, _ = reaper
    proc = start_kfrun(["-np", "2", "--", sys.executable, "-c", FILL_WORKER, "500", "0", "oo"], reaper)
    wait_for_files(pid_dir, ["f0", "f1"])
    deadline = time.monotonic() + 15
    while proc.poll() is None:  # again until it exits: the first one may come before the workers' exits are seen
        assert time.monotonic() < deadline, "kfrun did not stop writing on SIGINT"
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
    err = proc.stderr.read()
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "[kfrun] got SIGINT while still writing the workers' output; dropped the rest of worker " in err, err


def test_a_signal_ends_kfrun_when_its_stdout_and_stderr_share_one_blocked_pipe(reaper):
    """`kfrun ... 2>&1 | less` with less paused: the notes' writer is stuck behind the workers' output on the
    one pipe, and Ctrl-C must still end kfrun (a second wait for the notes once hung it for good)."""
    pid_dir, _ = reaper
    r, w = os.pipe()
    try:
        proc = start_kfrun(["-np", "2", "--", sys.executable, "-c", FILL_WORKER, "500", "0", "oo"], reaper,
                           stdout=w, stderr=w)
        os.close(w)
        w = None
        wait_for_files(pid_dir, ["f0", "f1"])
        deadline = time.monotonic() + 20
        while proc.poll() is None:
            assert time.monotonic() < deadline, "kfrun did not exit on SIGINT"
            proc.send_signal(signal.SIGINT)
            time.sleep(0.5)
        assert proc.returncode == 128 + signal.SIGINT
    finally:
        os.close(r)
        if w is not None:
            os.close(w)


@pytest.mark.parametrize("writes", [False, True], ids=["idle", "writing"])
def test_a_pipe_that_a_process_left_running_holds_open_is_given_up(writes, tmp_path, reaper):
    """ssh's ControlPersist master, which kfrun leaves running, here keeps the worker's stdout open: kfrun
    writes all the worker wrote, gives the pipe 2 s, then exits; if that process still writes, it says so."""
    pid_dir, _ = reaper
    body = "while :; do echo tick; sleep 0.05; done" if writes else "exec sleep 60"
    master = (f'( exec setsid sh -c \'echo $$ > "$PID_DIR/t$$"; mv "$PID_DIR/t$$" "$PID_DIR/s$$"; {body}\' ) '
              '</dev/null &\n')  # its stdout: ssh's, the worker's pipe to kfrun
    path = fake_ssh_path(tmp_path, before=master)
    start = time.monotonic()
    rc, out, err = run_kfrun(["-np", "1", "-H", "nohost-a.invalid:1", "-x", "PYTHONPATH", "-x", f"PID_DIR={pid_dir}",
                              "--", sys.executable, "-c", "print('last words')"], reaper, {"PATH": path})
    assert rc == 0 and time.monotonic() - start < 12, err
    assert "[0] last words" in out.splitlines(), out
    assert ("still writes to it" in err) == writes, err


def test_first_failure_exit_code_propagates(reaper):
    # No `--`: parsing stops at the first non-flag, so the command keeps "0=exit0" and the like.
    rc, out, err = run_kfrun(["-np", "3", sys.executable, "-c", PID_WORKER, "0=exit0", "1=exit7", "2=exit0"], reaper)
    assert rc == 7
    assert "worker 1 (127.0.0.1:" in err and "exit code 7" in err


def test_a_worker_killed_by_a_signal_is_named_so(reaper):
    rc, out, err = run_kfrun(["-np", "2", "--grace", "1", "--", sys.executable, "-c", PID_WORKER, "0=sig9", "1=exit0"],
                             reaper)
    assert rc == 128 + 9, err
    assert "worker 0 (127.0.0.1:" in err and "exit code 137: killed by signal 9 (SIGKILL)" in err, err


def test_hanging_workers_are_stopped_after_grace(reaper):
    pid_dir, _ = reaper
    args = ["-np", "3", "--grace", "1", "--kill-after", "1", "--", sys.executable, "-c", PID_WORKER,
            "0=exit3", "1=hang", "2=stubborn"]
    start = time.monotonic()
    rc, out, err = run_kfrun(args, reaper)
    assert rc == 3 and time.monotonic() - start < 15, err
    assert "--grace" in err and "SIGKILL" in err
    pids = wait_for_files(pid_dir, [f"{k}{r}" for k in "wc" for r in range(3)])
    assert not [n for n, pid in pids.items() if alive(pid)], "processes left behind"


def test_success_leaves_no_grandchild(reaper):
    pid_dir, _ = reaper
    rc, out, err = run_kfrun(["-np", "2", "--kill-after", "1", "--", sys.executable, "-c", PID_WORKER,
                              "0=exit0", "1=exit0"], reaper)
    assert rc == 0, err
    pids = wait_for_files(pid_dir, ["c0", "c1"])
    assert not [n for n, pid in pids.items() if alive(pid)], "grandchildren left behind"


def test_a_child_left_by_a_worker_that_exited_is_killed_and_named_so(reaper):
    pid_dir, _ = reaper
    rc, out, err = run_kfrun(["-np", "1", "--kill-after", "1", "--", sys.executable, "-c", PID_WORKER,
                              "0=stubbornexit0"], reaper)
    assert rc == 0, err
    assert "sending SIGKILL to worker(s) 0 (exited; processes it started) (still running)" in err, err
    pids = wait_for_files(pid_dir, ["c0"])
    assert not alive(pids["c0"]), "the child that ignores SIGTERM was left behind"


@pytest.mark.parametrize("modes, code", [(["0=detachexit0", "1=exit0"], 0), (["0=detachexit3", "1=detach"], 3)],
                         ids=["success", "failure"])
def test_a_daemon_that_a_worker_started_ends_with_the_job(modes, code, reaper):
    """A worker's child in a session of its own (setsid; a daemon's double fork) is outside the worker's
    process group and, once its parent exits, an orphan; kfrun, its subreaper, still stops it."""
    pid_dir, _ = reaper
    rc, out, err = run_kfrun(["-np", "2", "--grace", "1", "--kill-after", "1", "--", sys.executable, "-c", PID_WORKER,
                              *modes], reaper)
    assert rc == code, err
    pids = wait_for_files(pid_dir, [f"d{r}" for r in range(2) if f"{r}=detach" in " ".join(modes)])
    assert not [n for n, pid in pids.items() if alive(pid)], "daemons left behind"
    assert "SIGKILL" not in err, err  # they went at SIGTERM


def test_a_daemon_that_ignores_sigterm_is_killed_and_named_so(reaper):
    pid_dir, _ = reaper
    rc, out, err = run_kfrun(["-np", "1", "--kill-after", "1", "--", sys.executable, "-c", PID_WORKER,
                              "0=stubborndetachexit0"], reaper)
    assert rc == 0, err
    pid = wait_for_files(pid_dir, ["d0"])["d0"]
    assert (f"sending SIGKILL to 1 process the workers started outside their process groups (pid {pid} python"
            in err), err
    assert "sending SIGKILL to worker(s) 0 (exited; processes it started)" in err, err  # its child c0
    assert not alive(pid), "the daemon that ignores SIGTERM was left behind"


def test_orphans_that_exit_while_the_job_runs_are_reaped(reaper):
    """Orphans are re-parented to kfrun: one that exits on its own must not stay a zombie while the job runs."""
    pid_dir, _ = reaper
    code = ("import os, subprocess, time\n"
            "pid = subprocess.run(['sh', '-c', 'sleep 0.3 >/dev/null & echo $!'], stdout=subprocess.PIPE).stdout\n"
            "path = os.path.join(os.environ['PID_DIR'], 'z0')\nopen(path + '.tmp', 'wb').write(pid)\n"
            "os.rename(path + '.tmp', path)\ntime.sleep(120)")
    proc = start_kfrun(["-np", "1", "--kill-after", "1", "--", sys.executable, "-c", code], reaper)
    pid = wait_for_files(pid_dir, ["z0"])["z0"]
    wait_until(lambda: state(pid) is None, "the orphan was reaped (not a zombie of kfrun)", timeout=5)
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 128 + signal.SIGTERM, err


def test_run_inside_a_program_leaves_the_programs_own_processes_alone(tmp_path):
    """kungfu.launcher.run() in a program: what the program's other threads start while the job runs, and
    a second job's workers, are not the job's strays (killed) nor its orphans (reaped: their exit codes
    would be lost); only the kfrun command adopts orphans."""
    script = tmp_path / "inproc.py"
    script.write_text(textwrap.dedent("""
        import subprocess, sys, threading, time
        from kungfu import launcher
        res = {}
        def helper():
            time.sleep(0.5)
            p = subprocess.Popen(["sh", "-c", "sleep 1; exit 7"])
            time.sleep(2.5)  # checked on later, after the job's end and its reaping
            res["helper"] = p.wait()
        def job(name, argv, delay):
            time.sleep(delay)
            res[name] = launcher.run(argv)
        threads = [threading.Thread(target=helper),
                   threading.Thread(target=job, args=("a", ["kfrun", "-np", "1", "--kill-after", "1", "--",
                                                          "sleep", "1"], 0)),
                   threading.Thread(target=job, args=("b", ["kfrun", "-np", "1", "--kill-after", "1", "--",
                                                          "sh", "-c", "sleep 3; exit 5"], 0.3))]
        for t in threads: t.start()
        for t in threads: t.join()
        print(sorted(res.items()))
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip().splitlines()[-1] == "[('a', 0), ('b', 5), ('helper', 7)]", out.stdout + out.stderr


def test_restore_subreaper_puts_back_the_previous_setting():
    """kfrun adopts orphans only while its job runs (kungfu.launcher.run() may be called inside a program)."""
    previous = orphans.become_subreaper()
    if previous is None:
        pytest.skip("no PR_SET_CHILD_SUBREAPER here")
    orphans.restore_subreaper(previous)
    assert orphans.become_subreaper() == previous  # what it was before, as restored
    orphans.restore_subreaper(previous)


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
    (["-np", "1", "--", ""], "the worker command's program name is empty"),
    (["-np", "two", "--", "x"], "--np=two"),
    (["-np", "1", "--bogus", "--", "x"], "bogus"),
    (["-np", "2", "-H", "127.0.0.1:1,nohost.invalid:1", "--", "x"], "loopback name"),
    (["-np", "1", "-H", "[::1]:1", "--", "x"], "IPv6"),
    (["-np", "1", "-H", "fe80::1", "--", "x"], "IPv6"),
    (["-np", "1", "-H", "2001:4860:4860::8888", "--", "x"], "IPv6"),
    (["-np", "2", "-H", "10.1.0.1:1;10.1.0.2:1", "--", "x"], "hosts are separated by commas"),
    (["-np", "1", "-H", "10.1.0.1:2:3", "--", "x"], "is not host or host:N"),
    (["-np", "2", "-H", "10.1.0.1", "slots=2", "--", "x"], "-H takes host:N"),
    (["-np", "1", "--timeout", "1e10", "--", "x"], "--timeout must be between"),
    (["-np", "1", "--timeout", "0.0001", "--", "x"], "--timeout must be"),
    (["-np", "1", "--grace", "nan", "--", "x"], "--grace must not be negative"),
    (["-np", "1", "--kill-after", "inf", "--", "x"], "--kill-after must be positive"),
    (["-np", "1", "-x", "KUNGFU_RANK=0", "--", "x"], "kfrun sets KUNGFU_RANK for each worker itself"),
    (["-np", "1", "-x", "KUNGFU_TIMEOUT=5", "--", "x"], "use --timeout"),
    (["-np", "1", "-H=-Fevil:1", "--", "x"], "'-Fevil' is not a host name (a host name cannot start with '-')"),
    (["-np", "2", "-H", "-oProxyCommand=x", "--", "x"], "cannot start with '-'"),
    (["-np", "1", "-H", "127.0.0.1: 2", "--", "x"], "slots must be a positive integer, got ' 2'"),
    (["-np", "1", "-H", "127.0.0.1:1_0", "--", "x"], "slots must be a positive integer, got '1_0'"),
    (["-np", "1", "-H", "127.0.0.1:\uff12", "--", "x"], "slots must be a positive integer, got '\uff12'"),
    (["-np", "1", "--grace", "1e300", "--", "x"],
     "--grace must not be negative and at most 10000010 seconds, got 1e+300"),  # not 1e+07: 10^7 + 10
])
def test_bad_arguments(args, message, reaper):
    rc, out, err = run_kfrun(args, reaper)
    assert rc == 2 and message in err and "kfrun --help" in err, err


@pytest.mark.parametrize("content, message", [
    (b"-Fevil slots=1\n", "hosts:1: '-Fevil' is not a host name (a host name cannot start with '-')"),
    (b"node1 slots=2 # caf\xe9\n", "not UTF-8 text: byte 0xe9 at offset 19 (line 1)"),
    (b"\xef\xbb\xbfnode1:1\nnode2:1 # \xff\n", "not UTF-8 text: byte 0xff at offset 21 (line 2)"),
])
def test_bad_hostfile(content, message, reaper, tmp_path):
    path = tmp_path / "hosts"
    path.write_bytes(content)
    rc, out, err = run_kfrun(["-np", "1", "--hostfile", str(path), "--", "true"], reaper)
    assert rc == 2 and message in err and "kfrun --help" in err and "Traceback" not in err, err


def test_repeated_h_adds_hosts_as_mpirun_does():
    opts = cli.parse_args(["kfrun", "-np", "3", "-H", "10.1.0.1:2", "-H", "10.1.0.2", "--", "x"])
    assert opts.hosts == [hosts.HostSpec("10.1.0.1", 2), hosts.HostSpec("10.1.0.2", 1)]


def test_kungfu_timeout_in_the_environment_is_the_default(reaper):
    code = "import os; print(os.environ['KUNGFU_TIMEOUT'])"
    rc, out, err = run_kfrun(["-np", "1", "--", sys.executable, "-c", code], reaper, {"KUNGFU_TIMEOUT": "300"})
    assert (rc, out) == (0, "[0] 300\n"), err
    rc, out, err = run_kfrun(["-np", "1", "--timeout", "7", "--", sys.executable, "-c", code], reaper,
                             {"KUNGFU_TIMEOUT": "300"})
    assert (rc, out) == (0, "[0] 7\n"), err
    for value in ("soon", "0", "1e8", "inf"):  # the error names the variable the user set, not --timeout
        rc, out, err = run_kfrun(["-np", "1", "--", "true"], reaper, {"KUNGFU_TIMEOUT": value})
        assert rc == 2 and f"KUNGFU_TIMEOUT={value!r} is not a number of seconds from 0.001 to 1e+07" in err, err
        assert "--timeout must" not in err, err


def test_timeout_range_is_the_workers():
    """kfrun accepts exactly the --timeout values its workers (kungfu._env) accept as KUNGFU_TIMEOUT."""
    for value in (0.0009, 0.001, 1.5, 1e7, 1.0000001e7):
        try:
            took = cli.parse_args(["kfrun", "-np", "1", "--timeout", repr(value), "--", "x"]).timeout
        except hosts.UsageError:
            took = None
        try:
            wanted = env_mod.parse_timeout(repr(value))
        except ValueError:
            wanted = None
        assert took == wanted, value


def test_x_sets_the_variable_for_every_worker(reaper):
    code = "import os; print(os.environ['FOO'], os.environ['KUNGFU_RING_THRESHOLD'])"
    rc, out, err = run_kfrun(["-np", "2", "-x", "FOO=bar", "-x", "KUNGFU_RING_THRESHOLD=0", "--", sys.executable,
                              "-c", code], reaper, {"FOO": "inherited"})
    assert rc == 0, err
    assert sorted(out.splitlines()) == ["[0] bar 0", "[1] bar 0"]


def test_command_not_found(reaper):
    rc, out, err = run_kfrun(["-np", "2", "--", "/nonexistent/program"], reaper)
    assert rc == 127 and "cannot start worker 0: /nonexistent/program" in err


@pytest.mark.parametrize("kind, code, why", [
    ("no execute permission", 126, "Permission denied"),
    ("directory", 126, "it is a directory"),
    ("missing #! interpreter", 127, "its interpreter '/nonexistent/interp', named in its #! line, was not found"),
])
def test_a_program_that_cannot_be_executed(kind, code, why, reaper, tmp_path):
    """126 when the program is there but cannot be executed, 127 when it (or its interpreter) is not: as sh."""
    program = tmp_path / "prog"
    if kind == "directory":
        program.mkdir()
    else:
        program.write_text("#!/nonexistent/interp\necho hi\n" if kind.startswith("missing") else "#!/bin/sh\necho hi\n")
        program.chmod(0o644 if kind.startswith("no execute") else 0o755)
    rc, out, err = run_kfrun(["-np", "2", "--", str(program)], reaper)
    assert rc == code and f"cannot start worker 0: {program}: {why}" in err, err


def test_help(reaper):
    rc, out, err = run_kfrun(["--help"], reaper)
    assert rc == 0 and "usage: kfrun" in out and "--port-range" in out


def test_parse_hostfile():
    text = "# cluster\n10.1.0.1 slots=4  # first\n\n10.1.0.2:2\nnode3\n"
    assert hosts.parse_hostfile_text(text) == [
        hosts.HostSpec("10.1.0.1", 4), hosts.HostSpec("10.1.0.2", 2), hosts.HostSpec("node3", 1)]
    for bad, message in [("h slots=0", "hostfile:1: slots must be"), ("a:1\nh cores=2", "hostfile:2: expected"),
                         ("a:1\na slots=2", "hostfile:2: host 'a' is already listed on line 1"),
                         ("# none\n", "no hosts listed"), ("a b c", "expected")]:
        with pytest.raises(hosts.UsageError, match=message):
            hosts.parse_hostfile_text(bad)


def test_slot_counts_are_ascii_digits():
    """int() takes ' 2', '1_0' and other scripts' digits; a slot count is ASCII digits only."""
    for bad in [" 2", "1_0", "\uff12", "\u0663", "+2", "0x2", "2.0", "0"]:
        with pytest.raises(hosts.UsageError, match="slots must be a positive integer"):
            hosts.parse_host_list(f"a:{bad}")
        with pytest.raises(hosts.UsageError, match="slots must be a positive integer"):
            hosts.parse_hostfile_text(f"a slots={bad}")
    assert hosts.parse_host_list("a:012") == [hosts.HostSpec("a", 12)]


def test_hosts_are_read_as_openmpi_reads_them():
    """mpirun (4.1): max_slots=M is allowed (alone it gives the slots; slots above it are an error); a host on
    another hostfile line gets one more slot, but slots= on that line is an error; -H a:2,a adds up to 3."""
    parse, host = hosts.parse_hostfile_text, hosts.HostSpec
    assert parse("a slots=2 max_slots=4") == [host("a", 2)]
    assert parse("a max_slots=3\nb max-slots=2 slots=1\nc:2 slots_max=2") == [host("a", 3), host("b", 1), host("c", 2)]
    assert parse("a\nb slots=2\na\na  # one line per slot\nb") == [host("a", 3), host("b", 3)]
    for bad, message in [("a slots=3 max_slots=2", "hostfile:1: 'a' has 3 slots, more than its 2 max_slots"),
                         ("a slots=2\na slots=2", "hostfile:2: host 'a' is already listed on line 1"),
                         ("a:2\nb\na:1", "hostfile:3: host 'a' is already listed on line 1"),
                         ("a slots=2 max_slots=2\na", "hostfile:2: 'a' has 3 slots, more than its 2 max_slots"),
                         ("a slots=2 slots=3", "gives the slots of 'a' twice"),
                         ("a max_slots=x", "max_slots must be a positive integer"),
                         ("a slots=2 foo", "expected 'host slots=N"), ("a cpus=2", "expected 'host slots=N")]:
        with pytest.raises(hosts.UsageError, match=re.escape(message)):
            parse(bad)
    assert hosts.parse_host_list(["a:2,b", "a"]) == [host("a", 3), host("b", 1)]
    opts = cli.parse_args(["kfrun", "-np", "2", "-H", "127.0.0.1:1", "-H", "127.0.0.1:1", "--", "x"])
    assert opts.hosts == [host("127.0.0.1", 2)]


def test_parse_hostfile_drops_a_byte_order_mark(tmp_path):
    path = tmp_path / "hosts"
    path.write_bytes("\ufeffnode1 slots=2\n".encode("utf-8"))
    assert hosts.parse_hostfile(str(path)) == [hosts.HostSpec("node1", 2)]


def test_parse_host_list():
    assert hosts.parse_host_list("127.0.0.1:4,10.1.0.2:4") == [
        hosts.HostSpec("127.0.0.1", 4), hosts.HostSpec("10.1.0.2", 4)]
    assert hosts.parse_host_list("node") == [hosts.HostSpec("node", 1)]
    assert hosts.parse_host_list(["a:1", "b:2,c"]) == [
        hosts.HostSpec("a", 1), hosts.HostSpec("b", 2), hosts.HostSpec("c", 1)]
    for bad in ["", "a:", "a:-1", "a:1,", "a b:1", "a:1:2", "-F:1", "-oProxyCommand=x", ["a:1", ""]]:
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
    workers = plan.plan_workers(spec, 6, (10000, 10010), local_check=local, port_free=lambda p: p not in busy,
                                start=0)
    got = [(w.rank, w.addr, w.local_rank, w.local_size, w.is_local) for w in workers]
    assert got == [
        (0, "127.0.0.1:10000", 0, 3, True), (1, "127.0.0.1:10002", 1, 3, True),  # 10001 is taken
        (2, "10.1.0.2:10000", 0, 2, False), (3, "10.1.0.2:10001", 1, 2, False),
        (4, "localhost:10003", 2, 3, True),  # same machine as 127.0.0.1: shares its ports
        (5, "10.1.0.3:10000", 0, 1, False)]
    with pytest.raises(hosts.UsageError, match="widen --port-range"):
        plan.plan_workers(spec[:1], 2, (10000, 10001), local_check=local, port_free=lambda p: p != 10001, start=0)


def test_plan_starts_at_a_random_port_and_wraps_around():
    """Two jobs started together with the same --port-range must not both take its first ports."""
    local = {"127.0.0.1": True, "10.1.0.2": False}.__getitem__
    spec = [hosts.HostSpec("127.0.0.1", 3), hosts.HostSpec("10.1.0.2", 2)]
    workers = plan.plan_workers(spec, 5, (10000, 10003), local_check=local, port_free=lambda p: p != 10000, start=2)
    assert [w.port for w in workers] == [10002, 10003, 10001, 10002, 10003]  # 10000 is taken here, not there
    with pytest.raises(hosts.UsageError, match="widen --port-range"):
        plan.plan_workers(spec[:1], 3, (10000, 10002), local_check=local, port_free=lambda p: p != 10001, start=2)
    firsts = {plan.plan_workers(spec, 5, (10000, 10999), local_check=local, port_free=lambda p: True)[0].port
              for _ in range(20)}
    assert len(firsts) > 1, firsts  # 20 equal draws from 1000 places: about 1e-57
    for _ in range(20):
        workers = plan.plan_workers(spec, 5, (10000, 10003), local_check=local, port_free=lambda p: True)
        ports = [w.port for w in workers]
        assert len(set(ports[:3])) == 3 and len(set(ports[3:])) == 2  # distinct on each host


def test_a_port_is_free_again_once_its_job_ended():
    """A port that a job's engine listened on stays in TIME_WAIT for a minute after the job; the engine
    binds with SO_REUSEADDR, so the next job may take it (tests run one job after another in one range)."""
    import socket
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        assert not plan.port_is_free(port)  # listening: taken
        with socket.create_connection(("127.0.0.1", port)) as client:
            served, _ = listener.accept()
            served.close()  # the listening side closes first: its end of the connection goes to TIME_WAIT
            client.recv(1)
    with open("/proc/net/tcp") as table:  # local address "0100007F:PORT", state 06 is TIME_WAIT
        states = [line.split()[3] for line in table.readlines()[1:] if line.split()[1].endswith(f":{port:04X}")]
    assert "06" in states, states
    assert plan.port_is_free(port)


def test_init_errors_name_the_kfrun_flag_that_fixes_them():
    cluster = SimpleNamespace(rank=1, size=2, launcher="kfrun")
    text = "listening as 127.0.0.1:25002 (rank 1): bind port 25002: Address already in use"
    message = _lib._init_error_message(14, cluster, text)
    assert message.startswith("kungfu.init (rank 1 of 2): listening as") and "`kfrun --port-range A-B`" in message
    assert "`kfrun --timeout`" in _lib._init_error_message(4, cluster, "peer 127.0.0.1:25001 (rank 0): not up")
    timeout = "allreduce 'g': timed out after 5 s (KUNGFU_TIMEOUT); waiting for rank 1"
    e = errors.from_code(4, timeout)
    assert "(KUNGFU_TIMEOUT, set by `kfrun --timeout`); waiting for rank 1" in str(e), str(e)
    assert str(errors.from_code(14, timeout)) == timeout  # not a timeout: left alone


_SAME = "WARNING:kungfu:kungfu.finalize: not every worker reached finalize (why); leaving anyway\n"


@pytest.mark.parametrize("setup, expected", [
    ("", _SAME),  # nothing configured: logging's last resort would print the bare message
    ("logging.basicConfig()", _SAME),
    ("from absl import logging as absl_logging\nabsl_logging.info('x')", _SAME),  # absl calls basicConfig()
    ("logging.basicConfig(format='%(levelname)s|%(message)s')", "WARNING|" + _SAME.split(":", 2)[2]),
    ("logging.getLogger('kungfu').setLevel(logging.ERROR)", ""),
], ids=["nothing", "basicConfig", "absl", "own format", "silenced"])
def test_finalize_warnings_read_the_same_on_every_rank(setup, expected):
    """A rank where TF or Keras logged through absl (which configures the root logger)
    and one where nothing did print kungfu's finalize warning alike; a program's own configuration wins."""
    code = (f"import logging\n{setup}\nfrom kungfu import _lib\n"
            "_lib._warn('kungfu.finalize: not every worker reached finalize (%s); leaving anyway', 'why')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=PYTHONPATH))
    assert (done.returncode, done.stderr) == (0, expected)


def test_plan_skips_a_port_in_use():
    import socket
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        workers = plan.plan_workers([hosts.HostSpec("127.0.0.1", 2)], 2, (port, min(port + 50, 65535)))
    assert port not in [w.port for w in workers]


def test_worker_env_contract():
    workers = plan.plan_workers([hosts.HostSpec("127.0.0.1", 2)], 2, (10000, 10100), port_free=lambda p: True,
                                start=0)
    env = plan.worker_env(workers[1], workers, "tok", 12.5, environ={})
    assert env == {"KUNGFU_PEERS": "127.0.0.1:10000,127.0.0.1:10001", "KUNGFU_RANK": "1", "KUNGFU_SIZE": "2",
                   "KUNGFU_LOCAL_RANK": "1", "KUNGFU_LOCAL_SIZE": "2", "KUNGFU_TOKEN": "tok",
                   "KUNGFU_TIMEOUT": "12.5", "KUNGFU_CLUSTER_VERSION": "0", "TF_CPU_ALLOCATOR_USE_BFC": "true"}
    for timeout, said in ((1234567, "1234567"), (100.123456789, "100.123456789"), (7.0, "7")):
        assert plan.worker_env(workers[1], workers, "tok", timeout, environ={})["KUNGFU_TIMEOUT"] == said


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
    ({"KUNGFU_PEERS": "a:1,b:2", "KUNGFU_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"},
     "one launcher was started inside the other"),  # kfrun ... mpirun -np 2 python3 ..., or the reverse
])
def test_resolve_cluster_rejects_bad_kfrun_variables(env, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        env_mod.resolve_cluster(env)


def test_kfrun_refuses_to_run_as_one_of_several_mpirun_ranks(reaper):
    code, out, err = run_kfrun(["-np", "1", "--", sys.executable, "-c", "print('ran')"], reaper,
                               extra_env={"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"})
    assert code == 2 and "ran" not in out and "one of 2 OpenMPI ranks" in err, (code, out, err)
    code, out, _ = run_kfrun(["-np", "1", "--", sys.executable, "-c", "print('ran')"], reaper,
                             extra_env={"OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0"})
    assert code == 0 and "ran" in out  # mpirun -np 1 kfrun ...: one job


def test_resolve_cluster_defaults():
    spec = env_mod.resolve_cluster({"KUNGFU_PEERS": "h:1,g:2,h:3", "KUNGFU_RANK": "2"})
    assert (spec.size, spec.local_rank, spec.local_size, spec.token, spec.timeout) == (3, 1, 2, "", 60.0)
    lone = env_mod.resolve_cluster({})
    assert (lone.peers, lone.rank, lone.size, lone.token) == ([], 0, 1, "")


def test_ssh_command_construction():
    argv = ssh.ssh_command("10.1.0.2", "/data/my job", {"KUNGFU_RANK": "1"}, ["python", "t.py", "--x=a b"], 30)
    assert argv[:11] == ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=30", "-o", "ServerAliveInterval=7", "-o",
                         "ServerAliveCountMax=3", "--", "10.1.0.2"]  # -- : not an option
    assert argv[11].startswith("sh -c ") and len(argv) == 12
    assert "KUNGFU_TOKEN=" not in argv[11]  # the token travels on stdin
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
    pids = wait_for_files(pid_dir, ["w0", "c0"])
    proc.stdin.close()  # what kfrun does to stop it, and what sshd does when kfrun or ssh dies
    assert proc.wait(timeout=10) == 128 + signal.SIGTERM
    time.sleep(0.2)
    assert not [n for n, pid in pids.items() if alive(pid)]


def test_remote_workers_through_fake_ssh(tmp_path, reaper):
    """kfrun's ssh path end to end, with an `ssh` that runs the command here as sshd would."""
    pid_dir, _ = reaper
    proc = start_kfrun(["-np", "3", "-H", "nohost-a.invalid:2,nohost-b.invalid:1", "-x", "PYTHONPATH", "-x",
                        f"PID_DIR={pid_dir}", "--kill-after", "1", "--", sys.executable, "-c", PID_WORKER],
                       reaper, {"PATH": fake_ssh_path(tmp_path)})
    pids = wait_for_files(pid_dir, [f"{k}{r}" for k in "wc" for r in range(3)])
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert sorted(out.splitlines()) == ["[0] ready", "[1] ready", "[2] ready"]
    time.sleep(0.2)
    assert not [n for n, pid in pids.items() if alive(pid)], "remote processes left behind"


def test_remote_worker_leaves_no_grandchild(tmp_path, reaper):
    """A remote worker that exits leaves a child running in its (setsid) group: the remote script stops it."""
    pid_dir, _ = reaper
    rc, out, err = run_kfrun(["-np", "2", "-H", "nohost-a.invalid:1,nohost-b.invalid:1", "-x", "PYTHONPATH", "-x",
                              f"PID_DIR={pid_dir}", "--kill-after", "1", "--", sys.executable, "-c", PID_WORKER,
                              "0=exit0", "1=exit0"], reaper, {"PATH": fake_ssh_path(tmp_path)})
    assert rc == 0, err
    pids = wait_for_files(pid_dir, ["c0", "c1"])
    time.sleep(0.2)
    assert not [n for n, pid in pids.items() if alive(pid)], "remote grandchildren left behind"


def test_what_ssh_itself_leaves_running_is_left_alone(tmp_path, reaper):
    """ssh's ControlPersist master outlives the client on purpose, and may serve the user's other sessions:
    kfrun does not take it for a stray of the job, although it is re-parented to kfrun."""
    pid_dir, _ = reaper
    master = ('( exec setsid sh -c \'echo $$ > "$PID_DIR/t$$"; mv "$PID_DIR/t$$" "$PID_DIR/s$$"; exec sleep 60\' ) '
              '</dev/null >/dev/null 2>&1 &\n')
    path = fake_ssh_path(tmp_path, before=master)
    rc, out, err = run_kfrun(["-np", "1", "-H", "nohost-a.invalid:1", "-x", "PYTHONPATH", "-x", f"PID_DIR={pid_dir}",
                              "--kill-after", "1", "--", sys.executable, "-c", PID_WORKER, "0=exit0"], reaper,
                             {"PATH": path})
    assert rc == 0, err
    wait_until(lambda: list(pid_dir.glob("s*")), "the fake ssh's master wrote its pid")
    masters = list(pid_dir.glob("s*"))
    assert len(masters) == 1 and alive(int(masters[0].read_text())), "kfrun killed what ssh left running"
