"""Monitoring overhead side by side: the step time of the same model trained with model.fit by KungFu
S-SGD on 2 workers under kfrun, with the monitors off, with monitor=["gns", "variance", "snr"] at
monitor_interval=1, and at monitor_interval=8.

    python3 benchmarks/monitoring.py              # 6 rounds, about 7 minutes on 2 cores
    python3 benchmarks/monitoring.py --quick      # a smoke run of about 1 minute
    python3 benchmarks/monitoring.py --rounds=8 --steps=200

Every round is one kfrun launch that trains the three configurations, a fresh model and optimizer each,
one epoch of each in turn (the order rotated from round to round), so bursts of load from other programs
fall on all of them alike; the launch has a deadline, after which every process it started is killed.
The workers run under `kfrun --bind-to core` (--bind_to): each on its own core, as on dedicated machines;
floating, two workers' TF thread pools fight over the 2 cores and step times swing by 2x.
Model, data and timing are those of benchmarks/training.py (benchmarks/_training/common.py).
The table is printed and written to --out. The 3% target is shown, never asserted.
"""
import os
import platform
import statistics
import sys
import tempfile

from absl import app
from absl import flags

import _meta
from _monitoring import report
from _training import common

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = [dict(key='off', interval=0), dict(key='k1', interval=1), dict(key='k8', interval=8)]

FLAGS = flags.FLAGS
flags.DEFINE_integer('batch', 32, 'rows per worker per step')
flags.DEFINE_integer('steps', 100, 'steps per epoch; epochs are the unit of timing')
flags.DEFINE_integer('epochs', 10, 'timed epochs per configuration and round')
flags.DEFINE_integer('warmup', 1, 'untimed epochs per configuration and round before the timed ones')
flags.DEFINE_integer('rounds', 6, 'kfrun launches, each training every configuration')
flags.DEFINE_bool('quick', False, 'smoke run: defaults --steps=20 --epochs=2 --rounds=1')
flags.DEFINE_float('kungfu_timeout', 120, 'kfrun --timeout: seconds any KungFu wait may take')
flags.DEFINE_enum('bind_to', 'core', ['none', 'core'], 'kfrun --bind-to: core gives each worker its own '
                  'core(s), as two workers on dedicated machines would have; none lets them float')
flags.DEFINE_string('launcher', sys.executable + ' -m kungfu.launcher', 'how to start kungfu workers')
flags.DEFINE_string('out', os.path.join(HERE, 'results', 'monitoring.md'), 'markdown report path; empty to skip')

QUICK = dict(steps=20, epochs=2, rounds=1)


def _flag(name):
    return _meta.flag_value(FLAGS, QUICK, name)


def run_round(r, work_dir):
    """One launch training every configuration; returns (per-rank results or None, why, output tail)."""
    out_dir = tempfile.mkdtemp(prefix='round%d-' % r, dir=work_dir)
    configs = _meta.rotated(CONFIGS, r)
    plan = dict(batch=FLAGS.batch, steps=_flag('steps'), epochs=_flag('epochs'), warmup=FLAGS.warmup,
                configs=configs, out_dir=out_dir)
    return _meta.launch_round(r, os.path.join(HERE, '_monitoring', 'worker.py'), plan, out_dir, FLAGS.launcher,
                              FLAGS.kungfu_timeout,
                              _meta.launch_timeout(plan['steps'] * (plan['epochs'] + plan['warmup']), len(configs)),
                              common.PLAN_ENV, FLAGS.bind_to)


def measure(work_dir, rounds, steps):
    """(results by configuration, failed launches, the 1-minute load average after each round)."""
    results, failures, loads = {}, [], []
    for r in range(rounds):
        per_rank, why, tail = run_round(r, work_dir)
        loads.append(os.getloadavg()[0])
        if per_rank is None:
            failures.append(('round %d' % (r + 1), why, tail))
            continue
        for key in per_rank[0]:
            n = min(len(p[key]['epochs']) for p in per_rank)
            epochs = [max(p[key]['epochs'][i] for p in per_rank) for i in range(n)]
            cpu = [statistics.mean(p[key]['cpu'][i] for p in per_rank) for i in range(n)]
            cell = results.setdefault(key, dict(epochs=[], rounds=[], by_round=[], cpu_by_round=[]))
            cell['epochs'] += epochs
            cell['by_round'].append(epochs)  # in time order: epoch i of each configuration ran side by side
            cell['cpu_by_round'].append(cpu)
            cell['rounds'].append(statistics.median(epochs) / steps if epochs else None)
            cell.update({k: v for k, v in per_rank[0][key].items() if k in ('monitors', 'updates')})
    return results, failures, loads


def run_meta(rounds):
    return _meta.machine_lines() + [
        ('software', 'Python %s, TensorFlow %s, Keras %s, kungfu library %s (tree %s)' % (
            platform.python_version(), _meta.version('tensorflow-cpu', 'tensorflow'), _meta.version('keras'),
            os.environ.get('KUNGFU_LIBRARY', 'the installed package\'s'), _meta.git_head())),
        ('plan', 'mlp, batch %d per worker, 2 workers; per configuration and round %d warm-up + %d timed epochs '
                 'of %d steps; %d round(s)%s' % (FLAGS.batch, FLAGS.warmup, _flag('epochs'), _flag('steps'),
                                                 rounds, ' (--quick)' if FLAGS.quick else '')),
        ('binding', 'kfrun --bind-to %s%s' % (FLAGS.bind_to, ': each worker on its own share of the cores'
                                            if FLAGS.bind_to == 'core' else ': the workers float over every core')),
    ]


def main(argv):
    del argv
    if min(FLAGS.batch, _flag('steps'), _flag('epochs'), FLAGS.warmup, _flag('rounds')) < 1:
        raise app.UsageError('--batch, --steps, --epochs, --warmup and --rounds must be >= 1')
    rounds = _flag('rounds')
    meta = run_meta(rounds)
    with tempfile.TemporaryDirectory(prefix='kf-monitoring-') as work_dir:
        results, failures, loads = measure(work_dir, rounds, _flag('steps'))
    meta.append(('load average at end', _meta.load_average()))
    meta.append(('1-minute load after each round', ', '.join('%.2f' % x for x in loads)))
    meta.append(('note', 'the load at end counts this benchmark\'s own 2 workers (about 2 of it)'))
    # Our own 2 workers account for about 2 of the load during a round.
    if float(meta[2][1].split()[0]) > os.cpu_count() or max(loads, default=0) > os.cpu_count() + 2:
        meta.append(('caution', 'the load exceeded what the %d cores and our 2 workers explain: other programs '
                                'competed for the cores, so the step times are noisy; compare the paired '
                                'overheads (and CPU times) and rerun when idle' % os.cpu_count()))
    text = report.render(results, [c['key'] for c in CONFIGS], _flag('steps'), FLAGS.batch, meta, failures)
    _meta.publish(text, FLAGS.out)


if __name__ == '__main__':
    app.run(main)
