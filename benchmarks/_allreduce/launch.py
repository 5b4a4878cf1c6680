"""Starting a group of benchmark processes and making sure none outlives its deadline.

Each command starts in its own session, so one killpg reaches it and whatever it forks that stays in the group.
mpirun and launchers may move children into new groups, so before killing we also walk /proc for every
descendant of the processes we started and kill those by pid. Output goes to log files (never pipes, which could
fill and stall a worker); the tail is shown when a group fails.
"""
import os
import signal
import socket
import subprocess
import time


def free_ports(n):
    """n distinct loopback ports that were free a moment ago (held open together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(('127.0.0.1', 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _children_map():
    kids = {}
    for entry in os.listdir('/proc'):
        if not entry.isdigit():
            continue
        try:
            with open('/proc/%s/stat' % entry) as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(')') + 2:].split()[1])  # the name may hold spaces and parens
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def _descendants(pids):
    kids, found, todo = _children_map(), [], list(pids)
    while todo:
        pid = todo.pop()
        for child in kids.get(pid, []):
            found.append(child)
            todo.append(child)
    return found


def _signal_all(procs, sig):
    for pid in _descendants([p.pid for p in procs]):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    for p in procs:
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def kill_group(procs, grace=2.0):
    """SIGTERM everything we started and its descendants, then SIGKILL what is left after grace seconds."""
    live = [p for p in procs if p.poll() is None]
    if not live and not _descendants([p.pid for p in procs]):
        return
    _signal_all(procs, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and (any(p.poll() is None for p in procs)
                                           or _descendants([p.pid for p in procs])):
        time.sleep(0.05)
    _signal_all(procs, signal.SIGKILL)
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def run_group(commands, envs, log_dir, timeout, done=None):
    """Runs commands (one process each) to completion or until timeout seconds have passed.

    done(), when given, is polled; once it returns True the group gets a short grace to exit on its own and is
    then killed (some runtimes hang in shutdown after their results are written). Returns (ok, why, log_tail).
    """
    procs, logs = [], []
    try:
        for i, (cmd, env) in enumerate(zip(commands, envs)):
            log = open(os.path.join(log_dir, 'proc%d.log' % i), 'wb')
            logs.append(log)
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True))
        deadline = time.monotonic() + timeout
        finished_at = None
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if now > deadline:
                return False, 'timed out after %.0f s' % timeout, _tail(logs)
            if done is not None and finished_at is None and done():
                finished_at = now
            if finished_at is not None and now - finished_at > 10:
                return True, 'killed after writing results (hung in shutdown)', ''
            time.sleep(0.1)
        bad = [p.returncode for p in procs if p.returncode != 0]
        if bad:
            return False, 'exit status %s' % bad, _tail(logs)
        return True, '', ''
    finally:
        kill_group(procs)
        for log in logs:
            log.close()


def _tail(logs, limit=3000):
    text = []
    for log in logs:
        log.flush()
        with open(log.name, 'rb') as f:
            data = f.read().decode('utf-8', 'replace')
        if data.strip():
            text.append('--- %s\n%s' % (os.path.basename(log.name), data[-limit:]))
    return '\n'.join(text)[-2 * limit:]
