"""What each measured system runs: the commands and environments of one launch, which trains every model.

Every launch writes rank*.json into the plan's out_dir (see common.py). A system's `ranks` is how many
processes write a file; the driver reads them all.
"""
import itertools
import json
import os
import sys

from _allreduce import launch
from _training import common

HERE = os.path.dirname(os.path.abspath(__file__))

KUNGFU = 'KungFu S-SGD, 2 workers'
MWMS = 'TF MWMS (RING), 2 workers'
SINGLE = '1 worker alone'
KUNGFU_NOCOMM = 'KungFu, collectives skipped, 2 workers'
APART = '2 plain Keras workers at once, no communication'

_launches = itertools.count()


class System:
    """key: the --systems name; label: the table's name; ranks: processes that write results;
    commands(plan) -> [(argv, env), ...]."""

    def __init__(self, key, label, ranks, commands):
        self.key, self.label, self.ranks, self.commands = key, label, ranks, commands


def _env(plan, **extra):
    env = dict(os.environ)
    env[common.PLAN_ENV] = json.dumps(plan)
    env.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
    env['PYTHONUNBUFFERED'] = '1'
    env.update(extra)
    return env


def _worker(name):
    return os.path.join(HERE, name)


def _port_range():
    """20 engine ports for one kfrun launch, away from kfrun's default range and from the tests' 12000-19999;
    kfrun itself skips a port that is taken."""
    first = 20000 + ((os.getpid() + next(_launches)) % 500) * 20
    return '%d-%d' % (first, first + 19)


def _kungfu(plan, launcher, np, skip_comm, kungfu_timeout):
    plan = dict(plan, skip_comm=skip_comm)
    argv = launcher + ['-np', str(np), '--port-range', _port_range(), '--timeout', str(kungfu_timeout),
                       '--grace', '5', '--', sys.executable, _worker('worker_kungfu.py')]
    return [(argv, _env(plan))]


def _mwms(plan, np):
    workers = ['127.0.0.1:%d' % p for p in launch.free_ports(np)]
    out = []
    for i in range(np):
        tf_config = json.dumps({'cluster': {'worker': workers}, 'task': {'type': 'worker', 'index': i}})
        out.append(([sys.executable, _worker('worker_mwms.py')], _env(plan, TF_CONFIG=tf_config)))
    return out


def _single(plan, np):
    return [([sys.executable, _worker('worker_single.py')], _env(plan, KF_TRAIN_RANK=str(r), KF_TRAIN_RANKS=str(np)))
            for r in range(np)]


def all_systems(launcher, kungfu_timeout):
    """In the order they run within a round and appear in the table."""
    return [
        System('kungfu', KUNGFU, 2, lambda plan: _kungfu(plan, launcher, 2, False, kungfu_timeout)),
        System('mwms', MWMS, 2, lambda plan: _mwms(plan, 2)),
        System('single', SINGLE, 1, lambda plan: _single(plan, 1)),
        System('kungfu_nocomm', KUNGFU_NOCOMM, 2, lambda plan: _kungfu(plan, launcher, 2, True, kungfu_timeout)),
        System('apart', APART, 2, lambda plan: _single(plan, 2)),
    ]
