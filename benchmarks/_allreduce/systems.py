"""What each measured system runs: the commands and environments for one launch of np ranks.

Every launch measures all sizes in one go (start-up is paid once) and writes rank*.json into out_dir; a launch
may produce several series (the kungfu worker times the eager kungfu.all_reduce and the bare engine in the same
processes).

Nothing here imports TensorFlow, kungfu or mpi4py: whether a system can run is asked (System.missing) only for
the systems chosen, so `--systems=engine,raw,mpi_tcp` runs on a machine that has none of the three.
"""
import importlib.util
import json
import os
import secrets
import shutil
import subprocess
import sys

from _allreduce import harness
from _allreduce import launch

HERE = os.path.dirname(os.path.abspath(__file__))
KUNGFU_OP = 'kungfu (eager all_reduce)'
KUNGFU_ENGINE = 'kungfu (engine)'
KUNGFU_ENGINE_NOTF = 'kungfu (engine, no TF)'
MPI_DEFAULT = 'OpenMPI (default)'
MPI_TCP = 'OpenMPI (TCP)'
MWMS = 'TF MWMS (RING)'
RAW_RING = 'raw TCP ring'
RAW_ONEWAY = 'raw TCP one-way'

# Loopback TCP only: ob1 is the PML that honours the btl list (UCX would pick shared memory on its own),
# and OpenMPI's default if_exclude drops 127.0.0.1, so name the loopback device explicitly.
MPI_TCP_ARGS = ['--mca', 'pml', 'ob1', '--mca', 'btl', 'tcp,self', '--mca', 'btl_tcp_if_include', 'lo']


ENGINE_TIMEOUT = '60'  # KUNGFU_TIMEOUT for the engine workers, unless the environment sets one


class System:
    """key: the --systems name; series: what its workers report; commands(np, plan) -> [(argv, env), ...];
    missing() -> why it cannot run on this machine, '' when it can (asked once, and only when chosen)."""

    def __init__(self, key, series, commands, missing):
        self.key, self.series, self.commands, self.missing = key, series, commands, missing


def _env(plan, **extra):
    env = dict(os.environ)
    env[harness.PLAN_ENV] = json.dumps(plan)
    env.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
    if os.geteuid() == 0:  # containers often run as root, which mpirun refuses without these
        env.update(OMPI_ALLOW_RUN_AS_ROOT='1', OMPI_ALLOW_RUN_AS_ROOT_CONFIRM='1')
    env.update(extra)
    return env


def _worker(name):
    return os.path.join(HERE, name)


def _mpi(np, plan, tcp):
    argv = ['mpirun', '--oversubscribe', '-np', str(np)] + (MPI_TCP_ARGS if tcp else [])
    env = _env(dict(plan, series=MPI_TCP if tcp else MPI_DEFAULT))
    return [(argv + [sys.executable, _worker('worker_mpi.py')], env)]


def _mwms(np, plan):
    workers = ['127.0.0.1:%d' % p for p in launch.free_ports(np)]
    out = []
    for i in range(np):
        tf_config = json.dumps({'cluster': {'worker': workers}, 'task': {'type': 'worker', 'index': i}})
        env = _env(dict(plan, series=MWMS), TF_CONFIG=tf_config)
        out.append(([sys.executable, _worker('worker_mwms.py')], env))
    return out


def _kungfu(np, plan, launcher):
    return [(launcher + ['-np', str(np), '--', sys.executable, _worker('worker_kungfu.py')], _env(plan))]


def _engine(np, plan, library):
    """np plain processes, no launcher: each is told the cluster in kfrun's variables (worker_engine.py)."""
    peers = ','.join('127.0.0.1:%d' % p for p in launch.free_ports(np))
    token = secrets.token_hex(8)  # a fresh cluster each launch: a straggler of the last one cannot join it
    plan = dict(plan, series=KUNGFU_ENGINE_NOTF, library=library)
    timeout = os.environ.get('KUNGFU_TIMEOUT', ENGINE_TIMEOUT)
    return [([sys.executable, _worker('worker_engine.py')],
             _env(plan, KUNGFU_PEERS=peers, KUNGFU_RANK=str(r), KUNGFU_SIZE=str(np), KUNGFU_TOKEN=token,
                  KUNGFU_TIMEOUT=timeout))
            for r in range(np)]


def _raw(np, plan, binary, mode):
    ports = ','.join(str(p) for p in launch.free_ports(np))
    sizes = ','.join(str(s) for s in plan['sizes'])
    out = []
    for r in range(np):
        argv = [binary, mode, str(r), str(np), ports, sizes, str(plan['warmup']), str(plan['max_iters']),
                str(plan['min_iters']), str(plan['seconds']), os.path.join(plan['out_dir'], 'rank%d.json' % r)]
        out.append((argv, _env(plan)))
    return out


def _compile(argv, output, timeout):
    """Runs a compiler command in a session of its own; returns (output, '') or (None, why). On a timeout or an
    interrupt, launch.kill_group stops the whole session: build_engine.sh's compilers are children of its xargs
    (SIGTERM first, so that the script removes its objects)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
    except BaseException as e:  # the timeout, or an interrupt of the driver
        launch.kill_group([proc])
        proc.communicate()
        if isinstance(e, subprocess.TimeoutExpired):
            return None, '%s took over %d s' % (os.path.basename(argv[0]), timeout)
        raise
    launch.kill_group([proc])  # anything the command left running (nothing, when it exits normally)
    if proc.returncode != 0:
        return None, '%s failed:\n%s' % (' '.join(argv[:2]), err[-2000:])
    return output, ''


def build_tcp_ring(build_dir):
    """Compiles tcp_ring.c; returns (binary path, '') or (None, why)."""
    cc = shutil.which('cc') or shutil.which('gcc')
    if cc is None:
        return None, 'no C compiler (cc) on PATH'
    binary = os.path.join(build_dir, 'tcp_ring')
    return _compile([cc, '-O2', '-o', binary, os.path.join(HERE, 'tcp_ring.c')], binary, 120)


def engine_compiler():
    """The C++ compiler build_engine.sh runs: $CXX, else g++."""
    return os.environ.get('CXX', 'g++')


def build_engine(build_dir):
    """Compiles the engine (cc/) into a C API library with build_engine.sh, from this tree, every run: the
    engine measured is the one the sources say, whatever kungfu is installed. Returns (path, '') or (None, why).
    """
    cxx = engine_compiler()
    if shutil.which(cxx) is None:
        return None, 'no C++ compiler (%s) on PATH; set CXX to name one' % cxx
    library = os.path.join(build_dir, 'libkungfu_engine.so')
    return _compile(['sh', os.path.join(HERE, 'build_engine.sh'), library], library, 600)


def kungfu_importable(launcher):
    """Why the kungfu systems cannot run, or '' when `import kungfu` and its launcher work."""
    probe = 'import kungfu, kungfu.launcher; assert callable(kungfu.all_reduce)'
    try:
        r = subprocess.run([sys.executable, '-c', probe], capture_output=True, text=True, timeout=120,
                           env=_env({}), cwd='/')
    except subprocess.TimeoutExpired:
        return 'import kungfu took over 120 s'
    if r.returncode != 0:
        return 'import kungfu failed: ' + (r.stderr.strip().splitlines() or ['?'])[-1]
    return ''


def _module_missing(module, worker, hint=''):
    """Why `import module` would fail in the workers (they run this Python), found without importing it."""
    if importlib.util.find_spec(module) is None:
        return '%s is not importable by %s (%s needs it%s)' % (module, sys.executable, worker, hint)
    return ''


def _mpi_missing():
    if not shutil.which('mpirun'):
        return 'no mpirun on PATH (OpenMPI: apt install openmpi-bin libopenmpi-dev)'
    return _module_missing('mpi4py', 'worker_mpi.py', ': pip install mpi4py')


KEYS = ['kungfu', 'engine', 'mpi', 'mpi_tcp', 'mwms', 'raw']


def all_systems(launcher, tcp_ring, engine):
    """Every system, in KEYS order. tcp_ring and engine are build_tcp_ring's and build_engine's answers,
    (path, why), or (None, '') when that system was not chosen."""
    return [
        System('kungfu', [KUNGFU_OP, KUNGFU_ENGINE], lambda np, plan: _kungfu(np, plan, launcher),
               lambda: kungfu_importable(launcher)),
        System('engine', [KUNGFU_ENGINE_NOTF], lambda np, plan: _engine(np, plan, engine[0]),
               lambda: engine[1] or ('' if engine[0] else 'not built')),
        System('mpi', [MPI_DEFAULT], lambda np, plan: _mpi(np, plan, tcp=False), _mpi_missing),
        System('mpi_tcp', [MPI_TCP], lambda np, plan: _mpi(np, plan, tcp=True), _mpi_missing),
        System('mwms', [MWMS], _mwms, lambda: _module_missing('tensorflow', 'worker_mwms.py')),
        System('raw', [RAW_RING], lambda np, plan: _raw(np, plan, tcp_ring[0], 'ring'),
               lambda: tcp_ring[1] or ('' if tcp_ring[0] else 'not built')),
    ]


def oneway_system(tcp_ring_binary):
    """The raw one-way stream, np 2 only; run when the raw ring is (same binary)."""
    return System('raw', [RAW_ONEWAY], lambda np, plan: _raw(2, plan, tcp_ring_binary, 'oneway'), lambda: '')
