"""Processes a local worker started outside its own process group, and how kfrun ends them with the job.

A worker's child that starts a session of its own (setsid, a daemon's double fork) leaves the worker's
process group, so signalling that group misses it, and once its parent exits it is re-parented to init
and nothing connects it to the job any more. So kfrun makes itself a child subreaper (Linux's
prctl(PR_SET_CHILD_SUBREAPER)): such orphans are re-parented to kfrun instead, and every process the
workers started, however detached, stays a descendant of kfrun. At the end of the job the supervisor
terminates and kills the strays (stray_pids) as it does the workers' groups, and reaps the ones that
became its children (reap_children, also called now and then while the job runs, so that orphans that
exit on their own do not pile up as zombies).

Not strays: the workers' own process groups (the supervisor signals those whole), the ssh clients of
remote workers and what they start (ssh's ControlPersist master outlives the client on purpose; they
carry SSH_MARK in their environment), and children kfrun already had when the job started.
Elsewhere than Linux, or without /proc, all of this does nothing: orphans go to init, as before.
"""

import ctypes
import os
import sys

# In the environment of the ssh clients kfrun starts (value: kfrun's pid), and so of whatever they start.
SSH_MARK = "KFRUN_SSH_CLIENT_OF"

_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37


def _prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl
    except (OSError, AttributeError):
        return None


def become_subreaper():
    """Makes this process a child subreaper. Returns its previous setting (bool) for restore_subreaper(),
    or None where that is not possible (not Linux, or a kernel before 3.4)."""
    prctl = _prctl()
    if prctl is None:
        return None
    previous = ctypes.c_int(0)
    if prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(previous), 0, 0, 0) != 0:
        return None
    if prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        return None
    return bool(previous.value)


def restore_subreaper(previous):
    """Puts back what become_subreaper() returned (None: it changed nothing)."""
    if previous is not None:
        _prctl()(_PR_SET_CHILD_SUBREAPER, int(previous), 0, 0, 0)


class Process:
    __slots__ = ("pid", "name", "state", "ppid", "pgrp")

    def __init__(self, pid, name, state, ppid, pgrp):
        self.pid, self.name, self.state, self.ppid, self.pgrp = pid, name, state, ppid, pgrp


def process_table():
    """{pid: Process} of every process now, from /proc; None without Linux's /proc."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return None
    table = {}
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                head, tail = f.read().rsplit(b")", 1)
        except OSError:
            continue  # it exited while we looked
        fields = tail.split()
        try:
            table[int(name)] = Process(int(name), head.split(b"(", 1)[1].decode(errors="replace"),
                                       fields[0].decode(), int(fields[1]), int(fields[2]))
        except (IndexError, ValueError):
            continue
    return table


def live_process_groups(table):
    """The process group ids that have a member which is not a zombie; None when table is None."""
    if table is None:
        return None
    return {p.pgrp for p in table.values() if p.state != "Z"}


def _descends_from(pid, ancestor, table, known):
    """Whether ancestor is among pid's parents, grandparents, ... (known: a memo shared between calls)."""
    chain = []
    result = False
    while pid in table and pid not in known:
        chain.append(pid)
        ppid = table[pid].ppid
        if ppid == ancestor:
            result = True
            break
        if ppid <= 1 or ppid in chain:
            break
        pid = ppid
    else:
        result = known.get(pid, False)
    for p in chain:
        known[p] = result
    return result


def _ssh_started(pid):
    """Whether pid's environment (as it was at its exec) carries SSH_MARK for this kfrun."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
    except OSError:
        return False
    return f"{SSH_MARK}={os.getpid()}".encode() in env.split(b"\0")


def stray_pids(table, worker_groups, keep):
    """The live descendants of this process that are in none of worker_groups (the workers' process group
    ids) and neither are nor descend from a pid in keep, and were not started by a remote worker's ssh
    client; [] when table is None. Sorted, so messages list them in the order they were started (mostly)."""
    if table is None:
        return []
    me = os.getpid()
    mine, kept = {}, {}
    strays = []
    for p in table.values():
        if p.state == "Z" or p.pgrp in worker_groups or p.pid in keep or not _descends_from(p.pid, me, table, mine):
            continue
        if any(_descends_from(p.pid, k, table, kept.setdefault(k, {})) for k in keep):
            continue
        if not _ssh_started(p.pid):
            strays.append(p.pid)
    return sorted(strays)


def _task_children(pid):
    """pid's children, from /proc/PID/task/*/children; None where the kernel lacks that file."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    children = set()
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                children.update(int(c) for c in f.read().split())
        except FileNotFoundError:
            if not os.path.exists(f"/proc/{pid}/task/{tid}"):
                continue  # the thread ended
            return None  # no CONFIG_PROC_CHILDREN
        except OSError:
            continue
    return children


def children():
    """The pids of this process's children (zombies included); None without Linux's /proc."""
    found = _task_children(os.getpid())
    if found is not None:
        return found
    table = process_table()
    if table is None:
        return None
    me = os.getpid()
    return {p.pid for p in table.values() if p.ppid == me}


def reap_children(keep):
    """Reaps every child of this process that has exited, except the pids in keep (the workers, whose
    waiter threads reap them, and children kfrun had before the job). Never blocks."""
    for pid in children() or ():
        if pid in keep:
            continue
        try:
            os.waitpid(pid, os.WNOHANG)  # (0, 0) while it runs
        except ChildProcessError:
            pass  # not ours after all (it was reaped, and the pid reused)
