"""Where this worker stands in its cluster: resolve_cluster() reads the launcher's environment.

Sources, first match wins:
  a. kfrun: KUNGFU_PEERS (+ KUNGFU_RANK, KUNGFU_SIZE, KUNGFU_LOCAL_RANK, KUNGFU_LOCAL_SIZE, KUNGFU_TOKEN,
     KUNGFU_CLUSTER_VERSION).
  b. OpenMPI: OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}; the peer list and token come from a
     rendezvous with rank 0 (kungfu._rendezvous) at KUNGFU_RENDEZVOUS=host:port. When it is unset and
     every rank is on this machine, the address is 127.0.0.1 and a port derived from OpenMPI's job id.
  c. Nothing: a single worker (no peers, no token).
KUNGFU_TIMEOUT (seconds, default 60, within the engine's TIMEOUT_MIN..TIMEOUT_MAX) applies to all. Bad
values raise ValueError naming the variable, before any rendezvous.
Call it once per process: under mpirun every call is a new rendezvous that all ranks must join.
Under mpirun the engine port is reserved (bound) before the rendezvous; resolve_cluster releases it when
it returns, unless called inside engine_port_held(), which releases it when its block ends.
This module imports only the standard library and kungfu._rendezvous (no TensorFlow).
"""

import contextlib
import dataclasses
import os
import socket
import threading
import zlib

from . import _rendezvous

DEFAULT_TIMEOUT = 60.0
TIMEOUT_MIN, TIMEOUT_MAX = 0.001, 1e7  # seconds: the engine's range for KUNGFU_TIMEOUT (cc/engine_api.cc)
RENDEZVOUS_PORT_BASE = 20000  # derived ports lie in [BASE, BASE + SPAN): below Linux's ephemeral
RENDEZVOUS_PORT_SPAN = 12000  # range (32768+), so the kernel never hands one out to a connection
_KFRUN_ONLY = ("KUNGFU_RANK", "KUNGFU_SIZE", "KUNGFU_LOCAL_RANK", "KUNGFU_LOCAL_SIZE", "KUNGFU_CLUSTER_VERSION")
_JOB_ID_VARS = ("OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE")  # same for every rank of one mpirun job
_held = threading.local()  # .sockets: inside engine_port_held(), where _meet_rank0 leaves its reserved port


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    peers: list  # "host:port" of every worker's engine, in rank order; [] for a lone worker
    rank: int  # this worker's index into peers
    size: int  # number of workers
    local_rank: int  # index among the workers on this machine
    local_size: int  # number of workers on this machine
    token: str  # the job secret the engine proves in its handshake; "" for a lone worker
    timeout: float  # seconds: the deadline of every blocking wait
    version: int  # cluster version (epoch) of this peer list
    launcher: str = ""  # "kfrun" or "mpirun": whose knobs error hints name; "" when neither started it


def _int(env, name, default=None, source=""):
    text = env.get(name)
    if text is None:
        if default is None:
            raise ValueError(f"{name} is not set{source}")
        return default
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"{name}={text!r} is not an integer{source}") from None


def _check_range(name, value, lo, hi, hi_name):
    if not lo <= value < hi:
        raise ValueError(f"{name}={value} is out of range: it must be in [{lo}, {hi_name}={hi})")


def parse_timeout(text):
    """KUNGFU_TIMEOUT's text -> seconds. Checked here against the engine's range, so that a bad value
    fails at once, not after the rendezvous (and never overflows a socket timeout: inf, 1e12)."""
    try:
        value = float(text) if text == text.strip() else float("nan")  # the engine refuses trailing blanks
    except ValueError:
        value = float("nan")
    if not TIMEOUT_MIN <= value <= TIMEOUT_MAX:  # also refuses nan
        raise ValueError(f"KUNGFU_TIMEOUT={text!r} is not a number of seconds from {TIMEOUT_MIN:g} to "
                         f"{TIMEOUT_MAX:g} (the engine's range)")
    return value


def _timeout(env):
    text = env.get("KUNGFU_TIMEOUT")
    return DEFAULT_TIMEOUT if text is None else parse_timeout(text)


def parse_address(text, name):
    """'host:port' -> (host, port); errors name the variable it came from."""
    host, sep, port_text = text.strip().rpartition(":")
    try:
        port = int(port_text)
    except ValueError:
        port = 0
    if not sep or not host or not 0 < port < 65536:
        raise ValueError(f"{name}: '{text}' is not of the form host:port (port 1-65535)")
    return host, port


def _parse_peers(text):
    peers = [p.strip() for p in text.split(",") if p.strip()]
    if not peers:
        raise ValueError("KUNGFU_PEERS is set but empty; unset it for a single worker, or let kfrun set it")
    for p in peers:
        parse_address(p, "KUNGFU_PEERS")
    if len(set(peers)) != len(peers):
        dup = next(p for p in peers if peers.count(p) > 1)
        raise ValueError(f"KUNGFU_PEERS lists {dup} twice; every worker needs its own host:port")
    return peers


def _from_kfrun(env, timeout):
    peers = _parse_peers(env["KUNGFU_PEERS"])
    size = len(peers)
    if _int(env, "KUNGFU_SIZE", size) != size:
        raise ValueError(f"KUNGFU_SIZE={env['KUNGFU_SIZE']} but KUNGFU_PEERS lists {size} peers; "
                         "are variables from two jobs mixed?")
    rank = _int(env, "KUNGFU_RANK", source=" but KUNGFU_PEERS is; kfrun sets both")
    _check_range("KUNGFU_RANK", rank, 0, size, "KUNGFU_SIZE")
    my_host = peers[rank].rpartition(":")[0]
    same_host = [p for p in peers if p.rpartition(":")[0] == my_host]
    local_size = _int(env, "KUNGFU_LOCAL_SIZE", len(same_host))
    _check_range("KUNGFU_LOCAL_SIZE", local_size, 1, size + 1, "KUNGFU_SIZE+1")
    local_rank = _int(env, "KUNGFU_LOCAL_RANK", same_host.index(peers[rank]))
    _check_range("KUNGFU_LOCAL_RANK", local_rank, 0, local_size, "KUNGFU_LOCAL_SIZE")
    version = _int(env, "KUNGFU_CLUSTER_VERSION", 0)
    _check_range("KUNGFU_CLUSTER_VERSION", version, 0, 1 << 32, "2**32")
    return ClusterSpec(peers, rank, size, local_rank, local_size, env.get("KUNGFU_TOKEN", ""), timeout, version,
                       "kfrun")


def job_id(env):
    """OpenMPI's id of this job (shared by all its ranks), or ''."""
    return next((env[v] for v in _JOB_ID_VARS if env.get(v)), "")


def default_rendezvous_port(env):
    """A port every rank of one mpirun job derives alike: BASE + crc32(job id) % SPAN."""
    job = job_id(env)
    if not job:
        raise ValueError(f"cannot derive a rendezvous port: neither of {', '.join(_JOB_ID_VARS)} is set; "
                         "pass one: mpirun -x KUNGFU_RENDEZVOUS=127.0.0.1:<free port> ...")
    return RENDEZVOUS_PORT_BASE + zlib.crc32(job.encode()) % RENDEZVOUS_PORT_SPAN


def _rendezvous_address(env, size, local_size):
    if env.get("KUNGFU_RENDEZVOUS"):
        return parse_address(env["KUNGFU_RENDEZVOUS"], "KUNGFU_RENDEZVOUS")
    if local_size != size:
        raise ValueError(
            f"KUNGFU_RENDEZVOUS is not set and the job spans several hosts (OMPI_COMM_WORLD_LOCAL_SIZE={local_size} "
            f"< OMPI_COMM_WORLD_SIZE={size}); pass rank 0's address: mpirun -x KUNGFU_RENDEZVOUS=<rank 0 host>:<port>")
    return "127.0.0.1", default_rendezvous_port(env)


def _engine_host(env, address, all_local):
    """The address other workers will use to reach this one."""
    if all_local:
        return "127.0.0.1"
    if env.get("KUNGFU_HOST"):
        return env["KUNGFU_HOST"].strip()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(address)  # sends nothing; asks the kernel which local address routes there
        except OSError as e:
            raise ValueError(f"KUNGFU_RENDEZVOUS={address[0]}:{address[1]}: no route to it ({e}); "
                             "check the address, or set KUNGFU_HOST to this machine's address") from None
        host = s.getsockname()[0]
    if host.startswith("127."):
        raise ValueError(f"the route to KUNGFU_RENDEZVOUS host {address[0]} is loopback ({host}), which other hosts "
                         "cannot reach; use rank 0's LAN address in KUNGFU_RENDEZVOUS, or set KUNGFU_HOST")
    return host


def _from_openmpi(env, timeout):
    src = " (OpenMPI sets it; was this started by mpirun?)"
    size = _int(env, "OMPI_COMM_WORLD_SIZE", source=src)
    _check_range("OMPI_COMM_WORLD_SIZE", size, 1, 1 << 31, "2**31")
    rank = _int(env, "OMPI_COMM_WORLD_RANK", source=src)
    _check_range("OMPI_COMM_WORLD_RANK", rank, 0, size, "OMPI_COMM_WORLD_SIZE")
    local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", source=src)
    _check_range("OMPI_COMM_WORLD_LOCAL_SIZE", local_size, 1, size + 1, "OMPI_COMM_WORLD_SIZE+1")
    local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", source=src)
    _check_range("OMPI_COMM_WORLD_LOCAL_RANK", local_rank, 0, local_size, "OMPI_COMM_WORLD_LOCAL_SIZE")
    if size == 1:
        return ClusterSpec([], 0, 1, 0, 1, "", timeout, 0, "mpirun")
    address = _rendezvous_address(env, size, local_size)
    host = _engine_host(env, address, local_size == size)
    peers, token = _meet_rank0(env, rank, size, address, host, timeout)
    return ClusterSpec(peers, rank, size, local_rank, local_size, token, timeout, 0, "mpirun")


def _meet_rank0(env, rank, size, address, host, timeout):
    """Binds a free engine port, then joins the rendezvous (kungfu._rendezvous); returns (peers, token).
    The port stays bound through the rendezvous and, inside engine_port_held(), until that block ends,
    so that the kernel cannot give it to an outgoing connection before the engine binds it."""
    reserved = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        reserved.bind(("0.0.0.0", 0))
        peer = f"{host}:{reserved.getsockname()[1]}"
        token = env.get("KUNGFU_TOKEN", "")
        if rank == 0:
            with _rendezvous.listen(address, size) as listener:
                result = _rendezvous.serve(listener, size, peer, job_id(env), token, timeout)
        else:
            result = _rendezvous.register(address, rank, size, peer, job_id(env), token, timeout)
    except BaseException:
        reserved.close()
        raise
    keep = getattr(_held, "sockets", None)
    if keep is None:
        reserved.close()
    else:
        keep.append(reserved)
    return result


@contextlib.contextmanager
def engine_port_held():
    """Within this block, the engine port that resolve_cluster reserves under mpirun stays bound after it
    returns; it is released when the block ends. kungfu.init() loads the library (and TensorFlow, seconds)
    inside it and starts the engine, which binds that port, right after."""
    _held.sockets = []
    try:
        yield
    finally:
        for s in _held.sockets:
            s.close()
        del _held.sockets


def timeout_knob(environ=None):
    """What sets KUNGFU_TIMEOUT for this worker's launcher, for error hints: mpirun's -x under OpenMPI (no
    KUNGFU_PEERS, an OpenMPI rank), else kfrun's flag."""
    env = os.environ if environ is None else environ
    if "KUNGFU_PEERS" not in env and "OMPI_COMM_WORLD_RANK" in env:
        return "`mpirun -x KUNGFU_TIMEOUT=S`"
    return "`kfrun --timeout`"


def nested_launchers(env):
    """Raises ValueError when OpenMPI started this process as one of several ranks and kfrun is involved
    too (mpirun ... kfrun ..., or kfrun ... mpirun ...): each launcher would start a whole job of its own,
    duplicate jobs that train and checkpoint side by side, or ranks claiming one engine port."""
    size = env.get("OMPI_COMM_WORLD_SIZE", "")
    if size.strip().isdigit() and int(size) > 1:
        raise ValueError(f"kfrun's KUNGFU_PEERS and OpenMPI's OMPI_COMM_WORLD_SIZE={size.strip()} are both set: one "
                         "launcher was started inside the other (mpirun ... kfrun ..., or kfrun ... mpirun ...), "
                         "which runs duplicate jobs; start the workers with one of them: kfrun -np N python3 "
                         "train.py, or mpirun -np N python3 train.py")


def resolve_cluster(environ=None):
    """Returns this worker's ClusterSpec from environ (default os.environ). See the module doc."""
    env = os.environ if environ is None else environ
    timeout = _timeout(env)
    if "KUNGFU_PEERS" in env:
        nested_launchers(env)
        return _from_kfrun(env, timeout)
    stray = [name for name in _KFRUN_ONLY if name in env]
    if stray:
        raise ValueError(f"{stray[0]} is set but KUNGFU_PEERS is not; set both (kfrun does) or neither")
    if "OMPI_COMM_WORLD_RANK" in env:
        return _from_openmpi(env, timeout)
    return ClusterSpec([], 0, 1, 0, 1, "", timeout, 0)
