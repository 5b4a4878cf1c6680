"""kfrun: the worker environment contract and the workers' output.

kfrun runs as `python -m kungfu.launcher` (what the kfrun console script calls); workers are pure
Python, so no test here loads TensorFlow (`import kungfu` does not). Every process a test starts is
killed when the test ends, whatever happened (the `reaper` fixture, launcher_util.py). The rest of
kfrun is tested beside this file: exit codes and the processes a job leaves in test_launcher_processes.py,
signals to kfrun and workers that stall at the end in test_launcher_signals.py, bad input, hosts, plans
and the worker environment's parsing in test_launcher_args.py, and remote workers in test_launcher_ssh.py.
"""

import os
import re
import select
import signal
import sys
import time

import pytest

from launcher_util import ENV_WORKER, FILL_WORKER, alive, fake_ssh_path, records, run_kfrun, start_kfrun, wait_for_files
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
