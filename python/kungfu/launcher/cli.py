"""kfrun's command line, parsed with absl flags into an Options value.

The flags live in a private FlagValues, so importing the launcher never clashes with a program's own
absl flags. Parsing stops at `--` or at the first argument that is not a flag: everything after it is
the worker command, untouched (its own flags included).
"""

import dataclasses
import math
import os

from absl import flags

from .. import _env  # the standard library only: KUNGFU_TIMEOUT's range, shared with the workers
from . import hosts as hosts_lib
from . import plan
from . import ssh
from .hosts import UsageError

USAGE = """\
usage: kfrun -np N [-H host:slots,... | --hostfile FILE] [options] -- command [args...]

Starts N workers of `command`, gives each its KUNGFU_* environment (peers, rank, token, timeout) and
prefixes every output line with the worker's rank. Example:
  kfrun -np 4 -- python train.py --epochs 3
  kfrun -np 8 -H 10.1.0.1:4,10.1.0.2:4 --timeout 120 -- python train.py
"""


@dataclasses.dataclass(frozen=True)
class Options:
    np: int  # number of workers
    hosts: list  # [hosts.HostSpec], in the order ranks fill them
    timeout: float  # KUNGFU_TIMEOUT: the deadline of every blocking wait in the workers
    grace: float  # after a failure, how long the others may run on before SIGTERM (see also supervisor.py)
    kill_after: float  # from SIGTERM to SIGKILL
    port_range: tuple  # (first, last) engine port, inclusive
    forward_env: dict  # extra variables for every worker (-x); the KUNGFU_* contract is not among them
    bind_to: str  # KUNGFU_BIND_TO: "none", or "core" (each worker its share of its machine's cores)
    command: list  # the worker command line
    output_dir: str = None  # --output-filename: also copy worker r's output to DIR/rank.r/{stdout,stderr}


def _define_flags():
    fv = flags.FlagValues()
    flags.DEFINE_boolean("help", False, "Show this help and exit.", short_name="h", flag_values=fv)
    flags.DEFINE_integer("np", None, "Number of workers (required).", flag_values=fv)
    flags.DEFINE_multi_string("H", None, "Hosts and slots: host:N,host:N,... (default: 127.0.0.1:np); repeatable: "
                              "-H a:2 -H b:2 is -H a:2,b:2, and a host given again adds its slots, as with mpirun",
                              flag_values=fv)
    flags.DEFINE_string("hostfile", None, "File of 'host slots=N [max_slots=M]' or 'host:N' lines; # comments; as "
                        "with mpirun, each further line of a host adds one slot.", flag_values=fv)
    # No absl default: --help would print it, where the default is $KUNGFU_TIMEOUT when set (_timeout).
    flags.DEFINE_float("timeout", None, "Seconds; every blocking wait in a worker (KUNGFU_TIMEOUT; default: "
                       "$KUNGFU_TIMEOUT if set, else 60).", flag_values=fv)
    flags.DEFINE_float(
        "grace", None, "Seconds the others may run on after a worker fails, before SIGTERM "
        "(default: timeout + 10). Once a worker has exited 0, the others must exit within timeout + grace "
        "seconds, or they are taken to have stalled: SIGTERM, and exit code 124.", flag_values=fv)
    flags.DEFINE_float("kill-after", 5.0, "Seconds from SIGTERM to SIGKILL.", flag_values=fv)
    flags.DEFINE_string("port-range", plan.DEFAULT_PORT_RANGE, "Engine ports A-B to pick from, from a random "
                        "place in the range (so that jobs started together rarely pick the same ports).",
                        flag_values=fv)
    flags.DEFINE_enum(
        "bind-to", "none", ["none", "core"], "core: bind each worker to its share of its machine's cores "
        "(like mpirun --bind-to core); none: let them float.", flag_values=fv)
    flags.DEFINE_string(
        "output-filename", None, "DIR: also write each worker's output, unprefixed, to DIR/rank.N/stdout and "
        "DIR/rank.N/stderr (as horovodrun does); the files are replaced.", flag_values=fv)
    flags.DEFINE_multi_string(
        "x", [], "NAME or NAME=VALUE: set this variable for every worker, remote ones included (they do not "
        "inherit kfrun's environment; local ones do). Repeatable.", flag_values=fv)
    fv.set_gnu_getopt(False)  # stop at the first non-flag: the worker command keeps its own flags
    return fv


def help_text():
    return USAGE + "\noptions:\n" + _define_flags().get_help(include_special_flags=False)


def _forward_env(specs):
    env = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        try:
            ssh.check_env_name(name)
        except ValueError as e:
            raise UsageError(f"-x {spec}: {e}") from None
        if name in plan.WORKER_CONTRACT:
            how = {"KUNGFU_TIMEOUT": "; use --timeout"}.get(name, "")
            raise UsageError(f"-x {spec}: kfrun sets {name} for each worker itself{how}")
        if not sep:
            if name not in os.environ:
                raise UsageError(f"-x {name}: {name} is not set in kfrun's environment; use -x {name}=VALUE")
            value = os.environ[name]
        env[name] = value
    return env


def _hosts(fv, np):
    if fv.H is not None and fv.hostfile is not None:
        raise UsageError("give either -H or --hostfile, not both")
    if fv.H is not None:
        return hosts_lib.parse_host_list(fv.H)
    if fv.hostfile is not None:
        return hosts_lib.parse_hostfile(fv.hostfile)
    return [hosts_lib.HostSpec("127.0.0.1", np)]


def _number(value):
    """value as %g where that is exact (1e+07, 0.001), else with the digits it takes (10000010)."""
    short = f"{value:g}"
    return short if not math.isfinite(value) or float(short) == value else repr(value).removesuffix(".0")


def _seconds(name, value, low, high=_env.TIMEOUT_MAX, low_open=True):
    """A finite number of seconds in (low, high], or [low, high] when not low_open."""
    if not math.isfinite(value) or value > high or (value <= low if low_open else value < low):
        if low == 0:
            bound = "be positive" if low_open else "not be negative"
            raise UsageError(f"--{name} must {bound} and at most {_number(high)} seconds, got {_number(value)}")
        raise UsageError(f"--{name} must be between {_number(low)} and {_number(high)} seconds, got {_number(value)}")
    return value


def _timeout(fv):
    """--timeout, else KUNGFU_TIMEOUT from kfrun's environment (as the workers would have read it), else 60;
    within the engine's range (kungfu._env.TIMEOUT_MIN..TIMEOUT_MAX). The error names where it came from."""
    if fv.timeout is not None or "KUNGFU_TIMEOUT" not in os.environ:
        timeout = 60.0 if fv.timeout is None else fv.timeout
        return _seconds("timeout", timeout, _env.TIMEOUT_MIN, _env.TIMEOUT_MAX, low_open=False)
    try:
        return _env.parse_timeout(os.environ["KUNGFU_TIMEOUT"])
    except ValueError as e:
        raise UsageError(f"{e}; kfrun takes it from its environment when --timeout is not given") from None


def parse_args(argv):
    """argv includes the program name. Returns Options, or None for --help. Raises UsageError."""
    fv = _define_flags()
    try:
        rest = fv(list(argv))
    except flags.Error as e:
        raise UsageError(str(e)) from None
    if fv.help:
        return None
    if fv.np is None:
        raise UsageError("-np is required: the number of workers, e.g. kfrun -np 4 -- python train.py")
    if fv.np < 1:
        raise UsageError(f"-np must be at least 1, got {fv.np}")
    command = rest[1:]
    if not command:
        raise UsageError("no worker command; put it after --, e.g. kfrun -np 2 -- python train.py")
    if not command[0]:
        raise UsageError("the worker command's program name is empty (''); e.g. kfrun -np 2 -- python train.py")
    if command[0].startswith("slots="):  # -H host slots=N: the hostfile's form, split by the shell
        raise UsageError(f"the worker command starts with '{command[0]}': -H takes host:N (e.g. -H 10.1.0.2:4); "
                         "'host slots=N' is the --hostfile form")
    timeout = _timeout(fv)
    grace = _seconds("grace", timeout + 10 if fv.grace is None else fv.grace, 0, _env.TIMEOUT_MAX + 10,
                     low_open=False)
    return Options(
        np=fv.np,
        hosts=_hosts(fv, fv.np),
        timeout=timeout,
        grace=grace,
        kill_after=_seconds("kill-after", fv["kill-after"].value, 0),
        port_range=plan.parse_port_range(fv["port-range"].value),
        forward_env=_forward_env(fv.x),
        bind_to=fv["bind-to"].value,
        command=command,
        output_dir=_output_dir(fv["output-filename"].value),
    )


def _output_dir(path):
    if path is not None and not path:
        raise UsageError("--output-filename needs a directory")
    return path


def make_output_dirs(opts):
    """--output-filename: makes DIR/rank.N for every rank, once the rest of the command line has been
    checked and before any worker starts, so that a path that cannot be made is a usage error."""
    if opts.output_dir is None:
        return
    try:
        for rank in range(opts.np):
            os.makedirs(os.path.join(opts.output_dir, f"rank.{rank}"), exist_ok=True)
    except OSError as e:
        raise UsageError(f"--output-filename {opts.output_dir}: cannot make its rank.N directories: "
                         f"{e.strerror or e}") from None
