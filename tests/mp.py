"""Running a worker script under kfrun from a test, and reading what it reports.

A worker script prints one line per check, "KFCHECK <name> OK <seconds>" or "KFCHECK <name> FAIL
<reason>" (kfrun prefixes each line with "[rank] "); run_checks() in a worker and checks_problems()
in the test read them. Every process launch() starts is killed when it returns, on every path: kfrun
runs in its own process group, and each worker writes its pid into KF_TEST_PID_DIR first thing
(worker_started()), so leftovers are SIGKILLed with their process groups.
"""

import os
import re
import signal
import subprocess
import sys
import time
import traceback

CHECK_LINE = re.compile(r"^\[(\d+)\] KFCHECK (\S+) (OK|FAIL) ?(.*)$")


def worker_started():
    """Call first thing in a worker script, before importing TensorFlow."""
    if os.environ.get("KF_TEST_PID_DIR"):
        open(os.path.join(os.environ["KF_TEST_PID_DIR"], str(os.getpid())), "w").close()
    defer_keras_extras()


# Optional packages that `import keras` (which `import tensorflow` runs) imports whenever they are installed,
# only to offer features no test worker uses: scikit-learn (with SciPy) for Keras's estimator wrappers,
# matplotlib for its image galleries, IPython for notebook display. They took 2.5-3 s of the 9-10 s of CPU
# that importing TensorFlow took a worker on the 2-core VM (python -X importtime, 2026-11-29), and a full run
# starts about 160 workers. Keras imports each of them inside try/except ImportError.
_KERAS_EXTRAS = ("sklearn", "matplotlib", "IPython")


class _KerasExtras:
    """A sys.meta_path finder that refuses the packages of _KERAS_EXTRAS to Keras's own modules, which then
    leave those features out; anything else (the worker, an example, scikit-learn itself) imports them as
    usual: an example's load_digits and its plot still work."""

    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] not in _KERAS_EXTRAS:
            return None
        frame = sys._getframe(1)
        while frame is not None and frame.f_globals.get("__name__", "").startswith("importlib"):
            frame = frame.f_back  # the import machinery's own frames, up to the module that imports
        if frame is not None and frame.f_globals.get("__name__", "").startswith("keras."):
            raise ImportError(f"{name}: not imported for Keras in a test worker (tests/mp.py)", name=name)
        return None


def defer_keras_extras():
    """Makes Keras skip its scikit-learn, matplotlib and IPython extras in this process (_KerasExtras);
    call before importing TensorFlow or Keras."""
    if not any(isinstance(finder, _KerasExtras) for finder in sys.meta_path):
        sys.meta_path.insert(0, _KerasExtras())


def check_list():
    """(checks, check): a list of check functions and the decorator that appends one to it."""
    checks = []

    def check(fn):
        checks.append(fn)
        return fn

    return checks, check


def run_checks(checks, rank):
    """Runs each function of checks, printing a KFCHECK line for it; returns how many failed."""
    failed = 0
    for fn in checks:
        start = time.perf_counter()
        try:
            fn()
            print(f"KFCHECK {fn.__name__} OK {time.perf_counter() - start:.2f}", flush=True)
        except Exception as e:  # report and go on: the other ranks run the same checks
            failed += 1
            reason = f"{type(e).__name__}: {e}".replace("\n", " | ")[:2000]
            print(f"KFCHECK {fn.__name__} FAIL {reason}", flush=True)
            traceback.print_exc()
    print(f"KFDONE rank={rank} failed={failed}", flush=True)
    return failed


def _kill(pid):
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def port_range():
    """Engine ports of this test process: 20 ports in 12000-19999, away from kfrun's default range, so that
    jobs running at the same time on this machine (other test runs, benchmarks) rarely pick the same port."""
    first = 12000 + (os.getpid() % 400) * 20
    return f"{first}-{first + 19}"


def launch(np_, argv, pid_dir, timeout, budget, env=None):
    """Runs `python argv...` on np_ workers under kfrun; returns (exit code, output).

    timeout is the workers' KUNGFU_TIMEOUT (kfrun --timeout); budget bounds the whole launch, after
    which the test fails with the output so far. Kills everything it started.
    """
    import pytest

    env = dict(os.environ, **(env or {}), KF_TEST_PID_DIR=str(pid_dir), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "kungfu.launcher", "-np", str(np_), "--timeout", str(timeout), "--grace", "5",
           "--port-range", port_range(), "--", sys.executable, *argv]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=budget)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"kfrun -np {np_} {' '.join(argv)} did not finish within {budget} s:\n{out[-6000:]}")
    finally:
        _kill(proc.pid)
        for name in os.listdir(pid_dir):
            _kill(int(name))


# Runs a script as a kfrun worker: registers its pid for launch() to kill, then runs the script as
# `python script args...` would (absl reads sys.argv; the script's directory comes first in sys.path).
SCRIPT_RUNNER = (f"import os, runpy, sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
                 "import mp; mp.worker_started(); sys.argv = sys.argv[1:]; "
                 "sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0]))); "
                 "runpy.run_path(sys.argv[0], run_name='__main__')")


def launch_script(np_, script, args, pid_dir, timeout, budget):
    """launch() of an unmodified script (an example) with args: (exit code, output)."""
    return launch(np_, ["-c", SCRIPT_RUNNER, script, *args], pid_dir, timeout, budget)


def checks_problems(out, checks, np_):
    """The checks some rank did not report OK, one line each, with the reason; empty when all passed."""
    results = {}  # (rank, check) -> "OK" or the failure reason
    for line in out.splitlines():
        m = CHECK_LINE.match(line)
        if m:
            results[(int(m.group(1)), m.group(2))] = "OK" if m.group(3) == "OK" else m.group(4)
    return [f"rank {rank} {check}: {results.get((rank, check), 'no report')}"
            for check in checks for rank in range(np_) if results.get((rank, check)) != "OK"]


def assert_checks_passed(code, out, checks, np_):
    """Fails the test, with the reasons and the output's tail, unless every rank reported every check OK
    and the launch exited 0."""
    problems = checks_problems(out, checks, np_)
    assert not problems, "\n".join(problems) + "\n--- output tail ---\n" + out[-4000:]
    assert code == 0, out[-4000:]
