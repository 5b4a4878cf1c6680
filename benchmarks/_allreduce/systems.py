"""What each measured system runs: the commands and environments for one launch of np ranks.

Every launch measures all sizes in one go (start-up is paid once) and writes rank*.json into out_dir; a launch
may produce several series (the kungfu worker times the TF op and the bare engine in the same processes).
"""
import json
import os
import shutil
import subprocess
import sys

from _allreduce import harness
from _allreduce import launch

HERE = os.path.dirname(os.path.abspath(__file__))
KUNGFU_OP = 'kungfu (tf eager op)'
KUNGFU_ENGINE = 'kungfu (engine)'
MPI_DEFAULT = 'OpenMPI (default)'
MPI_TCP = 'OpenMPI (TCP)'
MWMS = 'TF MWMS (RING)'
RAW_RING = 'raw TCP ring'
RAW_ONEWAY = 'raw TCP one-way'

# Loopback TCP only: ob1 is the PML that honours the btl list (UCX would pick shared memory on its own),
# and OpenMPI's default if_exclude drops 127.0.0.1, so name the loopback device explicitly.
MPI_TCP_ARGS = ['--mca', 'pml', 'ob1', '--mca', 'btl', 'tcp,self', '--mca', 'btl_tcp_if_include', 'lo']


class System:
    """key: the --systems name; series: what its workers report; commands(np, plan) -> [(argv, env), ...]."""

    def __init__(self, key, series, commands, available):
        self.key, self.series, self.commands, self.available = key, series, commands, available


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


def _raw(np, plan, binary, mode):
    ports = ','.join(str(p) for p in launch.free_ports(np))
    sizes = ','.join(str(s) for s in plan['sizes'])
    out = []
    for r in range(np):
        argv = [binary, mode, str(r), str(np), ports, sizes, str(plan['warmup']), str(plan['max_iters']),
                str(plan['min_iters']), str(plan['seconds']), os.path.join(plan['out_dir'], 'rank%d.json' % r)]
        out.append((argv, _env(plan)))
    return out


def build_tcp_ring(build_dir):
    """Compiles tcp_ring.c; returns the binary path, or None with the reason printed."""
    cc = shutil.which('cc') or shutil.which('gcc')
    if cc is None:
        print('raw TCP ceiling skipped: no C compiler (cc) on PATH')
        return None
    binary = os.path.join(build_dir, 'tcp_ring')
    r = subprocess.run([cc, '-O2', '-o', binary, os.path.join(HERE, 'tcp_ring.c')], capture_output=True,
                       text=True, timeout=120)
    if r.returncode != 0:
        print('raw TCP ceiling skipped: cc failed:\n' + r.stderr[-2000:])
        return None
    return binary


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


def all_systems(launcher, tcp_ring_binary):
    return [
        System('kungfu', [KUNGFU_OP, KUNGFU_ENGINE], lambda np, plan: _kungfu(np, plan, launcher), True),
        System('mpi', [MPI_DEFAULT], lambda np, plan: _mpi(np, plan, tcp=False), bool(shutil.which('mpirun'))),
        System('mpi_tcp', [MPI_TCP], lambda np, plan: _mpi(np, plan, tcp=True), bool(shutil.which('mpirun'))),
        System('mwms', [MWMS], _mwms, True),
        System('raw', [RAW_RING], lambda np, plan: _raw(np, plan, tcp_ring_binary, 'ring'),
               tcp_ring_binary is not None),
    ]


def oneway_system(tcp_ring_binary):
    return System('raw', [RAW_ONEWAY], lambda np, plan: _raw(2, plan, tcp_ring_binary, 'oneway'),
                  tcp_ring_binary is not None)
