"""kfrun and signals, and workers that stall after another has finished.

Every signal kfrun is sent either ends the job (forwarded, then SIGKILL after --kill-after; exit 128+N) or is
passed on with the job going on (SIGUSR1/2), and Ctrl-Z stops the workers with kfrun. In every case no
process may be left behind. Helpers and the `reaper` fixture are in launcher_util.py (see test_launcher.py).
"""

import signal
import sys
import time

import pytest

from launcher_util import PID_WORKER, alive, fake_ssh_path, start_kfrun, state, wait_for_files, wait_until
from launcher_util import reaper  # noqa: F401  (a fixture)

_ALL = [f"{k}{r}" for k in "wc" for r in range(3)]  # pid files: 3 workers (w) and their children (c)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGALRM],
                         ids=lambda s: signal.Signals(s).name)
def test_signal_to_kfrun_stops_every_process(signum, reaper):
    pid_dir, _ = reaper
    proc = start_kfrun(["-np", "3", "--kill-after", "1", "--", sys.executable, "-c", PID_WORKER, "2=stubborn"], reaper)
    pids = wait_for_files(pid_dir, _ALL)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 128 + signum, err
    assert f"got {signal.Signals(signum).name}" in err
    assert not [n for n, pid in pids.items() if alive(pid)], "processes left behind"


def test_a_signal_to_kfrun_also_stops_what_the_workers_detached(reaper):
    """Daemons the workers started (sessions of their own, so the signal forwarded to a worker's process
    group misses them) go too: SIGTERM, and SIGKILL --kill-after later for one that ignores it."""
    pid_dir, _ = reaper
    proc = start_kfrun(["-np", "2", "--kill-after", "1", "--", sys.executable, "-c", PID_WORKER, "0=detach",
                        "1=stubborndetach"], reaper)
    pids = wait_for_files(pid_dir, ["w0", "w1", "c0", "c1", "d0", "d1"])
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 128 + signal.SIGTERM, err
    said = f"sending SIGKILL to 1 process the workers started outside their process groups (pid {pids['d1']} "
    assert said in err, err  # d0 went at SIGTERM
    assert not [n for n, pid in pids.items() if alive(pid)], "processes left behind"


def test_signals_are_forwarded_while_output_is_blocked(reaper):
    """Nobody reads kfrun's output here, so its output threads block; SIGINT must still stop the job."""
    pid_dir, _ = reaper
    code = ("import os, signal, sys, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
            "path = os.path.join(os.environ['PID_DIR'], 'w0')\nopen(path + '.tmp', 'w').write(str(os.getpid()))\n"
            "os.rename(path + '.tmp', path)\nfor _ in range(2000): print('x' * 1000, flush=True)\ntime.sleep(120)")
    proc = start_kfrun(["-np", "1", "--kill-after", "1", "--", sys.executable, "-c", code], reaper)
    pid = wait_for_files(pid_dir, ["w0"])["w0"]
    time.sleep(1)  # the pipes fill: kfrun's pump now blocks writing to its stdout
    proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pid), "the worker outlived --kill-after while kfrun's output was blocked"
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 128 + signal.SIGINT and "got SIGINT" in err, err[-2000:]


def test_sighup_stays_ignored_under_nohup(reaper):
    pid_dir, _ = reaper
    proc = start_kfrun(["-np", "1", "--kill-after", "1", "--", sys.executable, "-c", PID_WORKER], reaper,
                       ignored=[signal.SIGHUP])
    pid = wait_for_files(pid_dir, ["w0"])["w0"]
    proc.send_signal(signal.SIGHUP)
    time.sleep(1)
    assert proc.poll() is None and alive(pid), "nohup kfrun died of SIGHUP"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 128 + signal.SIGTERM and "SIGHUP" not in err, err


def _remote(tmp_path, pid_dir):
    """kfrun flags and environment for 2 workers on 2 remote hosts, through a fake ssh."""
    args = ["-H", "nohost-a.invalid:1,nohost-b.invalid:1", "-x", "PYTHONPATH", "-x", f"PID_DIR={pid_dir}"]
    return args, {"PATH": fake_ssh_path(tmp_path)}


@pytest.mark.parametrize("where", ["local", "remote"])
def test_usr1_reaches_every_worker_and_the_job_goes_on(where, reaper, tmp_path):
    """As with mpirun: a batch scheduler's warning before a time limit reaches the workers' handlers."""
    pid_dir, _ = reaper
    args, env = _remote(tmp_path, pid_dir) if where == "remote" else ([], None)
    proc = start_kfrun(["-np", "2", "--kill-after", "1", *args, "--", sys.executable, "-c", PID_WORKER, "0=usr1",
                        "1=usr1"], reaper, env)
    pids = wait_for_files(pid_dir, ["w0", "w1"])
    proc.send_signal(signal.SIGUSR1)
    wait_until(lambda: all((pid_dir / f"u{r}").exists() for r in range(2)), "both workers handled SIGUSR1")
    time.sleep(0.3)
    assert proc.poll() is None and all(alive(p) for p in pids.values()), "SIGUSR1 ended the job"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "got SIGUSR1; passed it on to every worker" in err and "got SIGTERM" in err, err
    assert [(pid_dir / f"u{r}").read_text() for r in range(2)] == ["usr1\n"] * 2


@pytest.mark.parametrize("where", ["local", "remote"])
def test_ctrl_z_stops_the_workers_and_sigcont_continues_them(where, reaper, tmp_path):
    pid_dir, _ = reaper
    args, env = _remote(tmp_path, pid_dir) if where == "remote" else ([], None)
    proc = start_kfrun(["-np", "2", "--kill-after", "1", *args, "--", sys.executable, "-c", PID_WORKER], reaper, env)
    pids = wait_for_files(pid_dir, ["w0", "w1", "c0", "c1"])  # c: a worker's child, in its process group
    proc.send_signal(signal.SIGTSTP)
    wait_until(lambda: state(proc.pid) == "T" and all(state(p) == "T" for p in pids.values()),
               "kfrun and every worker process stopped")
    proc.send_signal(signal.SIGCONT)
    wait_until(lambda: state(proc.pid) not in ("T", None) and all(state(p) not in ("T", None) for p in pids.values()),
               "kfrun and every worker process run again")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "got SIGTSTP" in err and "continued; sent SIGCONT" in err, err
    time.sleep(0.2)
    assert not [n for n, pid in pids.items() if alive(pid)], "processes left behind"


_COLLECTIVE_LOOP = (
    "import os, time\nimport numpy as np\nimport kungfu\n"
    "kungfu.init()\nr = kungfu.rank()\n"
    "open(os.path.join(os.environ['PID_DIR'], f'ready{r}'), 'w').write(str(os.getpid()))\n"
    "t0 = time.time()\n"
    "while True:\n"
    "    if r == 0:\n"
    "        time.sleep(0.2)  # rank 1 waits in the collective meanwhile\n"
    "    x = np.array([float(time.time() - t0 > 6)], np.float32)\n"
    "    if kungfu.all_reduce(x, op='max', name='loop').numpy()[0]:\n"
    "        break\n"
    "print('done', flush=True)\n")


def test_a_job_stopped_longer_than_its_timeout_goes_on(reaper):
    """Ctrl-Z for 5 s with --timeout 3, then fg: the collective a worker was waiting in when the job stopped
    does not time out (the engine discounts time it was not run), and the job ends well."""
    pid_dir, _ = reaper
    proc = start_kfrun(["-np", "2", "--timeout", "3", "--", sys.executable, "-c", _COLLECTIVE_LOOP], reaper,
                       {"TF_CPP_MIN_LOG_LEVEL": "3"})
    pids = wait_for_files(pid_dir, ["ready0", "ready1"], timeout=90)
    time.sleep(1)
    proc.send_signal(signal.SIGTSTP)
    wait_until(lambda: all(state(p) == "T" for p in pids.values()), "every worker stopped")
    time.sleep(5)
    proc.send_signal(signal.SIGCONT)
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err[-3000:]
    assert out.count("done") == 2, out[-2000:]


def test_stopped_workers_are_still_stopped_and_reaped_on_sigterm(reaper):
    """SIGTERM to kfrun while Ctrl-Z holds the job (what `kill %1` does: TERM, then CONT)."""
    pid_dir, _ = reaper
    proc = start_kfrun(["-np", "2", "--kill-after", "1", "--", sys.executable, "-c", PID_WORKER, "1=stubborn"], reaper)
    pids = wait_for_files(pid_dir, ["w0", "w1", "c0", "c1"])
    proc.send_signal(signal.SIGTSTP)
    wait_until(lambda: state(proc.pid) == "T", "kfrun stopped")
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGCONT)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 128 + signal.SIGTERM, err
    time.sleep(0.2)
    assert not [n for n, pid in pids.items() if alive(pid)], "processes left behind"


def test_a_worker_that_stalls_after_another_finished_is_stopped(reaper):
    """Rank 0 finishes; rank 1 hangs. Past --timeout + --grace after rank 0's exit, kfrun ends it: exit 124."""
    pid_dir, _ = reaper
    start = time.monotonic()
    proc = start_kfrun(["-np", "2", "--timeout", "1", "--grace", "1", "--kill-after", "1", "--", sys.executable, "-c",
                        PID_WORKER, "0=exit0", "1=stubborn"], reaper)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 124, err
    assert time.monotonic() - start < 15, err
    assert "worker(s) 1 still running 2s after worker 0 finished" in err and "raise --timeout" in err, err
    assert "SIGKILL" in err, err  # rank 1 ignores SIGTERM
    pids = wait_for_files(pid_dir, ["w0", "w1", "c0", "c1"])
    assert not [n for n, pid in pids.items() if alive(pid)], "processes left behind"


def test_workers_that_finish_within_the_window_succeed(reaper):
    """Rank 1 ends 1.5 s after rank 0, inside --timeout 2 + --grace 1: a success, not a stall."""
    proc = start_kfrun(["-np", "2", "--timeout", "2", "--grace", "1", "--", sys.executable, "-c", PID_WORKER,
                        "0=exit0", "1=exit0@1.8"], reaper)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "still running" not in err, err
