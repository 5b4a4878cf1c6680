"""One started worker process and the ways to stop it.

A local worker runs in its own session, so its process group id is its pid and a signal to the group
reaches whatever it started that stayed in the group (what left it, e.g. under setsid: orphans.py).
A remote worker is an ssh client (also in its own group); its stdin is the remote worker's lifeline
(see ssh.py): closing it makes the remote side SIGTERM the worker, and a line naming one of PASSABLE
makes the remote side send that signal to the worker's group.
"""

import errno
import os
import shutil
import signal
import subprocess

from . import orphans
from . import output
from . import ssh

# Signals passed on to a worker without ending it: a remote worker gets them as a line on its stdin.
PASSABLE = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGSTOP, signal.SIGCONT)


class LaunchError(Exception):
    """A worker could not be started; exit_code is what kfrun exits with (127: command not found; 126:
    found but not executable, as shells and mpirun say)."""

    def __init__(self, message, exit_code):
        super().__init__(message)
        self.exit_code = exit_code


class Worker:
    def __init__(self, spec, proc, pumps):
        self.spec = spec  # plan.WorkerSpec
        self.proc = proc  # subprocess.Popen of the worker (local) or of ssh (remote)
        self.pumps = pumps  # output threads
        self.returncode = None  # set by the supervisor once the process is reaped
        self.signalled = False  # whether a signal from kfrun's user was forwarded to it
        self.stopped = False  # whether kfrun stopped it (SIGTSTP to kfrun) and has not continued it yet

    def describe(self):
        where = "" if self.spec.is_local else " via ssh"
        return f"worker {self.spec.rank} ({self.spec.addr}{where})"

    def _killpg(self, signum):
        try:
            os.killpg(self.proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass  # the group is gone

    def _close_stdin(self):
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass

    def _send_line(self, text):
        """One line to the remote script (ssh.py), written unbuffered: this runs in signal handlers, and
        the token line was flushed at start, so nothing can come between or before it."""
        stdin = self.proc.stdin
        if stdin is None or stdin.closed:
            return
        try:
            os.write(stdin.fileno(), text.encode() + b"\n")
        except (OSError, ValueError):
            pass  # ssh is gone; its exit is reported by the supervisor

    def send(self, signum):
        """Passes signum (one of PASSABLE) on to the worker's process group; the job goes on."""
        if signum in (signal.SIGSTOP, signal.SIGCONT):
            self.stopped = signum == signal.SIGSTOP
        if self.spec.is_local:
            self._killpg(signum)
        else:
            self._send_line(signal.Signals(signum).name[len("SIG"):])

    def signal(self, signum):
        """Forwards a signal that ends the job to a local worker's group, continuing the group if kfrun
        had stopped it (a stopped process cannot run its handler); a remote worker gets SIGTERM
        (stdin closed; the remote script continues it too)."""
        self.signalled = True
        if self.spec.is_local:
            self._killpg(signum)
            if self.stopped:
                self.send(signal.SIGCONT)
        else:
            self._close_stdin()

    def terminate(self):
        self.signal(signal.SIGTERM)

    def kill(self):
        self._close_stdin()
        self._killpg(signal.SIGKILL)

    def alive(self, live_groups):
        """True while the process is unreaped or its process group still has a live member.

        live_groups is orphans.live_process_groups(): zombies do not count, since an orphan that no init
        reaps (as in some containers) would otherwise keep its group "alive" forever."""
        if self.returncode is None:
            return True
        if live_groups is not None:
            return self.proc.pid in live_groups
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False


def _start_local(spec, command, env, opts):
    return subprocess.Popen(
        command,
        env={**os.environ, **opts.forward_env, **env},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


def _start_remote(spec, command, env, opts):
    remote_env = {**opts.forward_env, **{k: v for k, v in env.items() if k != "KUNGFU_TOKEN"}}
    argv = ssh.ssh_command(spec.host, os.getcwd(), remote_env, command, opts.timeout, opts.kill_after,
                           keepalive=not ssh.user_sets_keepalive(spec.host))
    proc = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
        env={**os.environ, orphans.SSH_MARK: str(os.getpid())},  # what ssh starts here is not a stray of the job
    )
    try:
        os.write(proc.stdin.fileno(), env["KUNGFU_TOKEN"].encode() + b"\n")  # unbuffered, like _send_line
    except OSError:
        pass  # ssh already died; its exit code and stderr tell why
    return proc


def _close(files):
    for f in files:
        if f is not None:
            f.close()


def _open_copies(opts, rank):
    """With --output-filename, the files worker rank's stdout and stderr are copied to; else [None, None]."""
    if opts.output_dir is None:
        return [None, None]
    opened = []
    try:
        for to_stderr in (False, True):
            opened.append(output.copy_file(opts.output_dir, rank, to_stderr))
    except OSError as e:
        _close(opened)
        raise LaunchError(f"cannot write worker {rank}'s output to {e.filename}: {e.strerror or e}", 1) from e
    return opened


def _launch_code(e):
    """127 when the program (or its interpreter) is not there, 126 when it is but cannot be executed (no
    execute permission, a directory, not a format the kernel runs): what sh and mpirun exit with."""
    if isinstance(e, FileNotFoundError):
        return 127
    if isinstance(e, (PermissionError, IsADirectoryError)) or e.errno == errno.ENOEXEC:
        return 126
    return 1


def _resolve(program, env):
    """The file that exec would run for program: itself if it names a path, else the first executable
    (else existing) file of that name on the PATH of the worker's environment; None if there is none."""
    if os.sep in program:
        return program
    dirs = os.get_exec_path(env)
    return shutil.which(program, path=os.pathsep.join(dirs)) or shutil.which(program, os.F_OK, os.pathsep.join(dirs))


def _why(e, program, env):
    """The reason a start failed. EACCES for a directory says so; ENOENT for a file that exists means its
    interpreter is missing: the one its #! line names (or, for a binary, its dynamic loader)."""
    reason = e.strerror or str(e)
    path = _resolve(program, env) if isinstance(e, (FileNotFoundError, PermissionError)) else None
    if isinstance(e, PermissionError) and path is not None and os.path.isdir(path):
        return "it is a directory"
    if not isinstance(e, FileNotFoundError):
        return reason
    if path is None or not os.path.isfile(path):
        return reason
    try:
        with open(path, "rb") as f:
            first = f.readline(4096)
    except OSError:
        return reason
    if first.startswith(b"#!"):
        # As the kernel reads it: up to the first blank or the end of the line (a \r stays in the name).
        interpreter = first[2:].rstrip(b"\n").lstrip(b" \t").replace(b"\t", b" ").split(b" ")[0]
        if not interpreter:
            return "its #! line names no interpreter"
        crlf = " (the file has Windows line ends: \\r\\n)" if interpreter.endswith(b"\r") else ""
        return f"its interpreter {interpreter.decode('utf-8', 'replace')!r}, named in its #! line, was not found{crlf}"
    return f"{reason} (the file exists: the interpreter it needs, e.g. its dynamic loader, was not found)"


def start(spec, command, env, opts, printer):
    """Starts one worker with its KUNGFU_* env and output pumps. Raises LaunchError if it cannot start."""
    copies = _open_copies(opts, spec.rank)
    try:
        if spec.is_local:
            proc = _start_local(spec, command, env, opts)
        else:
            proc = _start_remote(spec, command, env, opts)
    except OSError as e:
        _close(copies)
        program = command[0] if spec.is_local else "ssh"
        env_path = {**os.environ, **opts.forward_env, **env} if spec.is_local else os.environ
        raise LaunchError(f"cannot start worker {spec.rank}: {program}: {_why(e, program, env_path)}",
                          _launch_code(e)) from e
    pumps = [
        output.start_pump(proc.stdout, spec.rank, printer, to_stderr=False, copy=copies[0]),
        output.start_pump(proc.stderr, spec.rank, printer, to_stderr=True, copy=copies[1]),
    ]
    return Worker(spec, proc, pumps)
