"""Runs the planned workers to completion and leaves no process behind.

Threads: the main thread starts workers, handles signals and decides; one waiter thread per worker
blocks in wait() and reports (rank, returncode) on a queue, so exits are seen in the order they happen;
two pump threads per worker copy output (output.py).

Policy:
  - The job's exit code is that of the first worker to fail (a signal N counts as 128+N), else 0.
  - After a failure the others get --grace seconds to finish or fail on their own (the engine tells
    them a peer is gone), then SIGTERM, then SIGKILL --kill-after seconds later.
  - SIGINT/SIGTERM/SIGHUP to kfrun are forwarded to every worker's process group; SIGKILL follows
    --kill-after seconds later, or at once on a second signal.
  - Whatever happens, including an exception in kfrun, shutdown() runs: it terminates and then kills
    every process group still populated, and reaps every worker.
"""

import queue
import signal
import threading
import time

from . import worker as worker_lib

_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_POLL = 0.2  # seconds between looks at the deadlines while nothing happens


def exit_code(returncode):
    return 128 - returncode if returncode < 0 else returncode


class Supervisor:
    def __init__(self, specs, command, envs, opts, printer):
        self._specs = specs  # plan.WorkerSpec per rank
        self._command = command
        self._envs = envs  # KUNGFU_* env per rank
        self._opts = opts  # cli.Options
        self._printer = printer
        self._workers = []  # started so far, in rank order
        self._exits = queue.Queue()  # (rank, returncode) from waiter threads
        self._signal = None  # first signal received
        self._term_at = None  # monotonic time to SIGTERM the remaining workers
        self._kill_at = None  # monotonic time to SIGKILL them

    def run(self):
        """Starts every worker and waits for the job; returns kfrun's exit code."""
        previous = self._install_signal_handlers()
        try:
            self._start_all()
            return self._wait()
        finally:
            try:
                self.shutdown()
            finally:
                for signum, handler in previous.items():
                    signal.signal(signum, handler)

    def _install_signal_handlers(self):
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {s: signal.signal(s, self._on_signal) for s in _FORWARDED}

    def _on_signal(self, signum, frame):
        now = time.monotonic()
        name = signal.Signals(signum).name
        if self._signal is not None:
            self._printer.message(f"got {name} again; sending SIGKILL to every worker now")
            self._kill_at = now
            return
        self._signal = signum
        self._kill_at = now + self._opts.kill_after
        for w in self._workers:
            w.signal(signum)
        self._printer.message(
            f"got {name}; forwarded it to every worker (SIGKILL in {self._opts.kill_after:g}s; "
            "signal again to kill now)"
        )

    def _start_all(self):
        for spec, env in zip(self._specs, self._envs):
            if self._signal is not None:
                return  # interrupted while starting: start no more
            w = worker_lib.start(spec, self._command, env, self._opts, self._printer)
            self._workers.append(w)
            threading.Thread(target=self._reap, args=(w,), name=f"kfrun-wait-{spec.rank}", daemon=True).start()
            if self._signal is not None and not w.signalled:
                w.signal(self._signal)  # the signal came while this one was starting

    def _reap(self, w):
        self._exits.put((w.spec.rank, w.proc.wait()))

    def _on_exit(self, w, returncode, pending, first_failure):
        w.returncode = returncode
        if returncode == 0 or first_failure is not None or self._signal is not None:
            return first_failure  # exits after a signal are its doing, not failures
        code = exit_code(returncode)
        hint = " (255 is ssh's own failure: can this machine `ssh -o BatchMode=yes` to it?)" if (
            code == 255 and not w.spec.is_local) else ""
        if pending and self._signal is None:
            self._term_at = time.monotonic() + self._opts.grace
            hint += f"; the others have {self._opts.grace:g}s (--grace) to finish before SIGTERM"
        self._printer.message(f"{w.describe()} failed with exit code {code}{hint}")
        return code

    def _check_deadlines(self, pending):
        now = time.monotonic()
        if self._term_at is not None and now >= self._term_at:
            self._term_at = None
            names = ", ".join(str(r) for r in sorted(pending))
            self._printer.message(f"grace period over; sending SIGTERM to worker(s) {names}")
            for w in self._workers:
                if w.spec.rank in pending:
                    w.terminate()
            self._kill_at = now + self._opts.kill_after
        return self._kill_at is not None and now >= self._kill_at

    def _wait(self):
        by_rank = {w.spec.rank: w for w in self._workers}
        pending = set(by_rank)
        first_failure = None
        while pending:
            if self._check_deadlines(pending):
                break  # shutdown() kills what is left
            try:
                rank, returncode = self._exits.get(timeout=_POLL)
            except queue.Empty:
                continue
            pending.discard(rank)
            first_failure = self._on_exit(by_rank[rank], returncode, pending, first_failure)
        if first_failure is not None:
            return first_failure
        if self._signal is not None:
            return 128 + self._signal
        return 0

    def _collect_exits(self, deadline, until_kill=False):
        """Records exits until every worker is gone (True) or the deadline passes (False); with until_kill,
        also stops when the SIGKILL time comes (a second signal to kfrun moves it to now)."""
        by_rank = {w.spec.rank: w for w in self._workers}
        while True:
            try:
                while True:
                    rank, returncode = self._exits.get_nowait()
                    by_rank[rank].returncode = returncode
            except queue.Empty:
                pass
            if not self._alive():
                return True
            now = time.monotonic()
            if now >= deadline or (until_kill and self._kill_at is not None and now >= self._kill_at):
                return False
            time.sleep(0.05)

    def _alive(self):
        live_groups = worker_lib.live_process_groups()
        return [w for w in self._workers if w.alive(live_groups)]

    def shutdown(self):
        """SIGTERM, then SIGKILL, every process group still populated; reap; flush output."""
        if not self._collect_exits(time.monotonic()):
            self._kill_alive(self._alive())
        deadline = time.monotonic() + 2.0
        for w in self._workers:
            for t in w.pumps:
                t.join(timeout=max(0.0, deadline - time.monotonic()))

    def _kill_alive(self, alive):
        if self._kill_at is None or time.monotonic() < self._kill_at:
            for w in alive:
                w.terminate()
            if self._collect_exits(time.monotonic() + self._opts.kill_after, until_kill=True):
                return
        left = self._alive()
        self._printer.message(
            "sending SIGKILL to worker(s) " + ", ".join(str(w.spec.rank) for w in left) + " (still running)"
        )
        for w in left:
            w.kill()
        if not self._collect_exits(time.monotonic() + 5.0):
            left = ", ".join(w.describe() for w in self._alive())
            self._printer.message(f"could not reap {left} after SIGKILL")
