"""kfrun: starts a KungFu job's workers on this machine and, through ssh, on others.

    kfrun -np 4 [-H 127.0.0.1:4,10.1.0.2:4 | --hostfile FILE] [--timeout S] [--port-range A-B] -- cmd args

Each worker gets KUNGFU_PEERS, KUNGFU_RANK, KUNGFU_SIZE, KUNGFU_LOCAL_RANK, KUNGFU_LOCAL_SIZE,
KUNGFU_TOKEN, KUNGFU_TIMEOUT and KUNGFU_CLUSTER_VERSION (read by kungfu._env.resolve_cluster).
See docs/launcher.md. This package imports nothing from the rest of kungfu but kungfu._env's timeout
range (the standard library only; no TensorFlow).
"""

import os
import secrets
import sys
import threading

from . import cli
from . import hosts as hosts_lib
from . import output
from . import plan
from .hosts import UsageError
from .supervisor import Supervisor

__all__ = ["main", "run"]


def _write(stream, text):
    """Writes text to sys.stdout or sys.stderr, or drops it when that stream is closed (`>&-`: Python makes
    it None, or, started through a shell wrapper, a stream on a descriptor that cannot be written)."""
    if stream is None:
        return
    try:
        stream.flush()
        fd = stream.fileno()
    except (OSError, ValueError, AttributeError):
        fd = None  # a stream without a file descriptor (or a closed one)
    try:
        if fd is None:
            stream.write(text)
            stream.flush()
        else:  # waits where another process made the descriptor non-blocking
            output.write_all(fd, text.encode(getattr(stream, "encoding", None) or "utf-8", "replace"))
    except (OSError, ValueError):
        pass


def _flush(stream):
    try:
        if stream is not None:
            stream.flush()
    except (OSError, ValueError):
        pass


def _usage_error(message):
    _write(sys.stderr, f"kfrun: error: {message}\nRun `kfrun --help` for usage.\n")
    return 2


def _plan(opts):
    specs = plan.plan_workers(opts.hosts, opts.np, opts.port_range)
    local = {s.host: s.is_local for s in specs}
    hosts_lib.check_reachable_names([s.host for s in specs], local_check=local.__getitem__)
    return specs


def _refuse_inside_mpirun(environ):
    """mpirun -np N kfrun ...: each of the N ranks would start a whole job of its own (duplicates that train
    and checkpoint side by side), so refuse; mpirun -np 1 kfrun ... is one job and fine."""
    size = environ.get("OMPI_COMM_WORLD_SIZE", "").strip()
    if size.isdigit() and int(size) > 1:
        raise UsageError(f"kfrun is running as one of {size} OpenMPI ranks (mpirun ... kfrun ...), so each rank "
                         "would start a whole job of its own; use one launcher: kfrun -np N python3 train.py, or "
                         "mpirun -np N python3 train.py")


def run(argv, adopt_orphans=False):
    """Runs kfrun with argv (program name first); returns the exit code. adopt_orphans: be the workers'
    child subreaper and end what they detach (setsid) with the job, as the kfrun command does; leave it
    False inside a program that starts processes of its own (they would be taken for the job's)."""
    try:
        opts = cli.parse_args(argv)
        if opts is None:
            _write(sys.stdout, cli.help_text())
            return 0
        _refuse_inside_mpirun(os.environ)
        specs = _plan(opts)
        cli.make_output_dirs(opts)
    except UsageError as e:
        return _usage_error(e)
    token = secrets.token_hex(32)
    environ = {**os.environ, **opts.forward_env}  # what the workers inherit, before their KUNGFU_* contract
    envs = [plan.worker_env(s, specs, token, opts.timeout, environ, opts.bind_to) for s in specs]
    printer = output.LinePrinter()
    try:
        return Supervisor(specs, opts.command, envs, opts, printer, adopt_orphans).run()
    finally:
        printer.close()  # Supervisor.run() did, unless it failed before (then: the notes so far)


def main(argv=None):
    """Console-script entry point (kfrun)."""
    code = run(sys.argv if argv is None else argv, adopt_orphans=True)
    if any(t.name.startswith("kfrun-") and t.is_alive() for t in threading.enumerate()):
        # An output thread is still blocked writing to a reader that stopped reading (a signal to kfrun told
        # it to give up; the note says so). Leave at once with the job's code rather than wait for it.
        _flush(sys.stdout)
        _flush(sys.stderr)
        os._exit(code)
    sys.exit(code)
