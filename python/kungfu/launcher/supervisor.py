"""Runs the planned workers to completion and leaves no process behind.

Threads: the main thread starts workers, handles signals and decides; one waiter thread per worker
blocks in wait() and reports (rank, returncode) on a queue, so exits are seen in the order they happen;
two pump threads per worker copy output (output.py).

Policy:
  - The job's exit code is that of the first worker to fail (a signal N counts as 128+N), else 0.
  - After a failure the others get --grace seconds to finish or fail on their own (the engine tells
    them a peer is gone), then SIGTERM, then SIGKILL --kill-after seconds later.
  - Once a worker has exited 0, the others get --timeout + --grace seconds to exit too: a worker that
    finished waits in kungfu.finalize()'s barrier for at most --timeout, so one still running after
    that has stalled. Then SIGTERM, SIGKILL, and the job exits with STALLED (124, as timeout(1) does).
  - SIGINT/SIGTERM/SIGHUP/SIGQUIT/SIGALRM to kfrun are forwarded to every worker's process group
    and end the job (128+N); SIGKILL follows --kill-after seconds later, or at once on a second one.
    A SIGHUP that kfrun's parent made it ignore (nohup) stays ignored.
  - SIGUSR1/SIGUSR2 are passed on to every worker's process group and the job goes on (as mpirun does:
    batch schedulers send them ahead of a time limit). SIGTSTP (Ctrl-Z) stops every worker (SIGSTOP
    to its group), then kfrun itself; SIGCONT (fg, bg) continues them, and the deadlines above are
    moved by the time spent stopped. Remote workers get these through their remote script (ssh.py).
  - Once every worker is gone, all of their output is written (output.drain), however long kfrun's reader
    takes; a signal that ends the job, sent meanwhile, drops the rest.
  - Whatever happens, including an exception in kfrun, shutdown() runs: it terminates and then kills
    every process group still populated and every other process the local workers started (kfrun is
    their child subreaper, so those that left their group, e.g. under setsid, stay its descendants:
    orphans.py), and reaps every worker and every such process re-parented to kfrun.
"""

import os
import queue
import signal
import threading
import time

from . import orphans
from .exits import SSH_FAILED, describe_exit, exit_code
from . import output
from . import worker as worker_lib

_ENDING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGALRM)  # forwarded; the job ends
_PASSED_ON = (signal.SIGUSR1, signal.SIGUSR2)  # forwarded; the job goes on
_POLL = 0.2  # seconds between looks at the deadlines while nothing happens
_REAP_EVERY = 1.0  # seconds between reaping orphans that were re-parented to kfrun and exited while the job runs
STALLED = 124  # the exit code when workers were stopped for outliving a finished one by --timeout + --grace


class Supervisor:
    def __init__(self, specs, command, envs, opts, printer, adopt_orphans=False):
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
        self._stall_at = None  # monotonic time after which workers still running have stalled
        self._finished = None  # the rank that exited 0 first while others ran on (the stall clock's start)
        self._stalled = False  # whether the remaining workers were stopped for stalling
        self._failed_codes = set()  # the exit codes of failures reported (one note per code)
        # Whether to be the workers' child subreaper and end what they detached (orphans.py): only as the
        # kfrun command. Inside a program (kungfu.launcher.run()), the program's own children, started by
        # other threads or by another job's run(), would be indistinguishable and killed or reaped too.
        self._adopt = bool(adopt_orphans)
        self._before = set()  # children this process had before the job
        self._next_reap = 0.0  # monotonic time of the next reap_children() while the job runs
        self._draining = False  # whether every worker is gone and kfrun is writing the rest of their output
        self._drain_signal = None  # a signal to kfrun meanwhile (see _finish_output)

    def run(self):
        """Starts every worker and waits for the job; then writes all of the workers' output (drain) and
        kfrun's notes; returns kfrun's exit code."""
        previous = self._install_signal_handlers()
        subreaper = None
        code = None
        if self._adopt:
            self._before = orphans.children() or set()
            subreaper = orphans.become_subreaper()
        try:
            try:
                self._start_all()
                code = self._wait()
            except worker_lib.LaunchError as e:
                code = e.exit_code
                self._printer.message(f"{e}; the workers already started were stopped")
            finally:
                self.shutdown()
        finally:
            try:
                orphans.restore_subreaper(subreaper)
                stopped = self._finish_output()
            finally:
                for signum, handler in previous.items():
                    signal.signal(signum, handler)
        if stopped and not code:
            code = 128 + stopped  # the output was cut short by a signal
        return code

    def _finish_output(self):
        """Waits until the workers' output and kfrun's notes are written, as long as kfrun's reader takes
        (output.drain); a signal to kfrun meanwhile stops that (the rest is dropped, and said so). Returns
        that signal, or None."""
        self._draining = True
        stopped = lambda: self._drain_signal  # noqa: E731
        try:
            return output.drain([p for w in self._workers for p in w.pumps], self._printer, stopped)
        finally:
            self._printer.close(stopped)

    def _install_signal_handlers(self):
        if threading.current_thread() is not threading.main_thread():
            return {}
        handlers = {s: self._on_signal for s in _ENDING}
        handlers.update({s: self._on_pass for s in _PASSED_ON})
        handlers.update({signal.SIGTSTP: self._on_tstp, signal.SIGCONT: self._on_cont})
        if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
            del handlers[signal.SIGHUP]  # nohup kfrun ...: the user asked for the job to outlive the terminal
        return {s: signal.signal(s, h) for s, h in handlers.items()}

    def _on_pass(self, signum, frame):
        if self._draining:
            return  # no worker is left to pass it on to
        for w in self._workers:
            w.send(signum)
        self._printer.message(f"got {signal.Signals(signum).name}; passed it on to every worker (the job goes on)")

    def _on_tstp(self, signum, frame):
        """Ctrl-Z: stops the workers, then kfrun (SIGSTOP: a SIGTSTP to itself would be dropped when kfrun's
        process group is orphaned, e.g. under setsid, leaving the workers stopped and kfrun running)."""
        if self._draining:  # no worker is left: only kfrun, writing their output, stops
            os.kill(os.getpid(), signal.SIGSTOP)
            return
        for w in self._workers:
            w.send(signal.SIGSTOP)
        self._printer.message("got SIGTSTP; stopped every worker and now kfrun (fg or SIGCONT continues them)")
        time.sleep(0.05)  # let the note out before kfrun stops
        paused = time.monotonic()
        os.kill(os.getpid(), signal.SIGSTOP)  # returns once kfrun is continued
        self._move_deadlines(time.monotonic() - paused)
        self._on_cont(signal.SIGCONT, frame)

    def _on_cont(self, signum, frame):
        stopped = [w for w in self._workers if w.stopped]
        for w in self._workers:
            w.send(signal.SIGCONT)  # also after a SIGSTOP kfrun could not see: harmless to running ones
        if stopped:
            self._printer.message("continued; sent SIGCONT to every worker")

    def _move_deadlines(self, seconds):
        """Time spent stopped does not count against the workers."""
        for name in ("_term_at", "_kill_at", "_stall_at"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name) + seconds)

    def _on_signal(self, signum, frame):
        if self._draining:
            self._drain_signal = self._drain_signal or signum  # stop writing what the workers left
            return
        now = time.monotonic()
        name = signal.Signals(signum).name
        if self._signal is not None:
            self._printer.message(f"got {name} again; sending SIGKILL to every worker now")
            self._kill_at = now
            return
        self._signal = signum
        self._terminate(self._workers, signum)
        self._printer.message(
            f"got {name}; forwarded it to every worker (SIGKILL in {self._opts.kill_after:g}s; "
            "signal again to kill now)"
        )

    def _terminate(self, workers, signum=signal.SIGTERM):
        """Sends signum to workers (forwarded to a local worker's group) and SIGTERM to the strays; whatever
        is left gets SIGKILL --kill-after seconds from now."""
        for w in workers:
            w.signal(signum)
        self._terminate_strays()
        self._kill_at = time.monotonic() + self._opts.kill_after

    def _end_if_reader_gone(self):
        """The reader of kfrun's stdout or stderr went away while the job runs (`kfrun ... | head`: EPIPE).
        As a shell pipeline ends a command whose reader exited (SIGPIPE), and as mpirun does, the job ends:
        SIGTERM to every worker, SIGKILL --kill-after seconds later; kfrun exits with 128 + SIGPIPE (141)
        unless a worker failed first. A stream closed from the start (`>&-`) is not this: the job runs on."""
        gone = self._printer.reader_gone
        if gone is None or self._signal is not None or self._stalled:
            return
        self._signal = signal.SIGPIPE  # what kfrun's exit status and _on_exit go by; the workers get SIGTERM
        self._terminate(self._workers)
        self._printer.message(f"the reader of kfrun's {gone} went away (EPIPE); sent SIGTERM to every worker "
                              f"(SIGKILL in {self._opts.kill_after:g}s)")

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
        if self._signal is not None or self._stalled:
            return first_failure  # exits after a signal or a stall are kfrun's doing, not failures
        if first_failure is not None:
            # A later failure with a code of its own may be the cause the first one reported (a worker that
            # called sys.exit(3) waits in finalize while the others fail for want of it, and exits last);
            # the peers' own failures, mostly one code, are left out, as are exits after kfrun's SIGTERM.
            code = exit_code(returncode)
            if returncode != 0 and not w.signalled and code not in self._failed_codes:
                self._failed_codes.add(code)
                self._printer.message(f"{w.describe()} also failed, with {describe_exit(returncode, w.spec.is_local)}")
            return first_failure
        if returncode == 0:
            if pending and self._stall_at is None:
                self._stall_at = time.monotonic() + self._opts.timeout + self._opts.grace
                self._finished = w.spec.rank
            return None
        self._stall_at = None  # a failure: --grace alone applies now
        code = exit_code(returncode)
        self._failed_codes.add(code)
        hint = SSH_FAILED.format(host=w.spec.host) if code == 255 and not w.spec.is_local else ""
        if pending:
            self._term_at = time.monotonic() + self._opts.grace
            hint += f"; the others have {self._opts.grace:g}s (--grace) to finish before SIGTERM"
        self._printer.message(f"{w.describe()} failed with {describe_exit(returncode, w.spec.is_local)}{hint}")
        return code

    def _check_stall(self, pending, now):
        if self._stall_at is None or now < self._stall_at or self._signal is not None:
            return
        self._stall_at = None
        self._stalled = True
        names = ", ".join(str(r) for r in sorted(pending))
        o = self._opts
        self._printer.message(
            f"worker(s) {names} still running {o.timeout + o.grace:g}s after worker {self._finished} finished "
            f"with exit code 0: stalled after worker {self._finished} finished (a finished worker waits at most "
            f"--timeout {o.timeout:g}s for the others in kungfu.finalize(), and --grace {o.grace:g}s is over "
            f"too); sending SIGTERM (SIGKILL in {o.kill_after:g}s); the job exits with {STALLED}. If work that "
            "only some ranks do at the end (e.g. rank 0 saving the model) legitimately takes that long, "
            "raise --timeout")
        self._terminate([w for w in self._workers if w.spec.rank in pending])

    def _check_deadlines(self, pending):
        now = time.monotonic()
        self._check_stall(pending, now)
        if self._term_at is not None and now >= self._term_at:
            self._term_at = None
            names = ", ".join(str(r) for r in sorted(pending))
            self._printer.message(f"grace period over; sending SIGTERM to worker(s) {names}")
            self._terminate([w for w in self._workers if w.spec.rank in pending])
        return self._kill_at is not None and now >= self._kill_at

    def _wait(self):
        by_rank = {w.spec.rank: w for w in self._workers}
        pending = set(by_rank)
        first_failure = None
        while pending:
            self._end_if_reader_gone()
            if self._check_deadlines(pending):
                break  # shutdown() kills what is left
            self._reap_orphans()
            try:
                rank, returncode = self._exits.get(timeout=_POLL)
            except queue.Empty:
                continue
            pending.discard(rank)
            first_failure = self._on_exit(by_rank[rank], returncode, pending, first_failure)
        if first_failure is not None:
            return first_failure
        if self._stalled:
            return STALLED
        if self._signal is not None:
            return 128 + self._signal
        return 0

    def _keep(self):
        """Children of kfrun that reap_children must leave alone: the workers (their waiter threads reap
        them) and what kfrun had before the job."""
        return self._before | {w.proc.pid for w in self._workers}

    def _reap_orphans(self):
        """Reaps, now and then while the job runs, the processes re-parented to kfrun that have exited."""
        now = time.monotonic()
        if self._adopt and now >= self._next_reap:
            self._next_reap = now + _REAP_EVERY
            orphans.reap_children(self._keep())

    def _collect_exits(self, deadline, until_kill=False, kill_strays=False):
        """Records exits until every worker is gone and no stray is left (True) or the deadline passes
        (False); with until_kill, also stops when the SIGKILL time comes (a second signal to kfrun moves it
        to now). kill_strays: SIGKILL each stray as it is seen (one may start another while it is killed)."""
        by_rank = {w.spec.rank: w for w in self._workers}
        while True:
            try:
                while True:
                    rank, returncode = self._exits.get_nowait()
                    by_rank[rank].returncode = returncode
            except queue.Empty:
                pass
            alive, strays = self._alive()
            if kill_strays:
                _send(strays, signal.SIGKILL)
            if not alive and not strays:
                return True
            now = time.monotonic()
            if now >= deadline or (until_kill and self._kill_at is not None and now >= self._kill_at):
                return False
            time.sleep(0.05)

    def _alive(self):
        """([workers whose process or group is alive], [pids of strays: see orphans.stray_pids])."""
        table = orphans.process_table()
        live_groups = orphans.live_process_groups(table)
        groups = {w.proc.pid for w in self._workers}
        return ([w for w in self._workers if w.alive(live_groups)],
                orphans.stray_pids(table, groups, self._before) if self._adopt else [])

    def _terminate_strays(self, strays=None):
        """SIGTERM to the strays, whenever the workers are told to stop, so that the strays too have
        --kill-after seconds before SIGKILL; SIGCONT as well, since a stopped process acts on it only then."""
        if strays is None:
            strays = self._alive()[1]
        _send(strays, signal.SIGTERM)
        _send(strays, signal.SIGCONT)

    def shutdown(self):
        """SIGTERM, then SIGKILL, every process group still populated and every stray; reap. (Their output
        is written after this: _finish_output.)"""
        if not self._collect_exits(time.monotonic()):
            self._kill_alive(*self._alive())
        if self._adopt:
            orphans.reap_children(self._keep())

    def _kill_alive(self, alive, strays):
        if self._kill_at is None or time.monotonic() < self._kill_at:
            for w in alive:
                w.terminate()
            self._terminate_strays(strays)
            if self._collect_exits(time.monotonic() + self._opts.kill_after, until_kill=True):
                return
        left, strays = self._alive()
        if left:
            said = [f"{w.spec.rank}" if w.returncode is None else f"{w.spec.rank} (exited; processes it started)"
                    for w in left]
            self._printer.message("sending SIGKILL to worker(s) " + ", ".join(said) + " (still running)")
        if strays:
            self._printer.message(f"sending SIGKILL to {_describe_strays(strays)} (still running)")
        for w in left:
            w.kill()
        if not self._collect_exits(time.monotonic() + 5.0, kill_strays=True):
            left, strays = self._alive()
            names = [w.describe() for w in left] + ([_describe_strays(strays)] if strays else [])
            self._printer.message(f"could not reap {', '.join(names)} after SIGKILL")


def _send(pids, signum):
    for pid in pids:
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass  # gone, or not ours to signal (a set-user-ID program)


def _describe_strays(pids, shown=5):
    """'2 processes the workers started outside their process groups (pids 41 sleep, 42 python3)'."""
    table = orphans.process_table() or {}
    named = [f"{pid} {table[pid].name}" if pid in table else str(pid) for pid in pids[:shown]]
    more = f", and {len(pids) - shown} more" if len(pids) > shown else ""
    what = "process" if len(pids) == 1 else "processes"
    return (f"{len(pids)} {what} the workers started outside their process groups "
            f"(pid{'s' if len(pids) > 1 else ''} {', '.join(named)}{more})")
