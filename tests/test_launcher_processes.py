"""kfrun and the processes of a job: the exit code of the first failure, workers killed by a signal or
hanging at the end, and every process a worker leaves (children, daemons, orphans) ended with the job.
Helpers and the `reaper` fixture are in launcher_util.py (see test_launcher.py)."""

import signal
import subprocess
import sys
import textwrap
import time

import pytest

from kungfu.launcher import orphans
from launcher_util import PID_WORKER, alive, run_kfrun, start_kfrun, state, wait_for_files, wait_until
from launcher_util import reaper  # noqa: F401  (a fixture)


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
