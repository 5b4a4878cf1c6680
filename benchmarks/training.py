"""Training throughput side by side: the same Keras model and per-worker batch trained with model.fit by
KungFu S-SGD (SynchronousSGDOptimizer, 2 workers under kfrun), TF MultiWorkerMirroredStrategy (RING, 2 local
workers) and 1 worker alone, on synthetic data.

    python3 benchmarks/training.py                        # mlp and cnn, 3 rounds, about 5 minutes
    python3 benchmarks/training.py --quick                # a smoke run of about 1.5 minutes
    python3 benchmarks/training.py --models=mlp --systems=kungfu,mwms --rounds=3

Two more launches measure the communication share: KungFu with its gradient all-reduce skipped, and two
plain Keras processes at once (see _training/report.py for how the shares are computed). Every launch trains
all models; each launch has a deadline, after which every process it started is killed. A launch that fails
is reported with its output's tail and the rest still run. The table is printed and written to --out.
"""
import os
import platform
import sys
import tempfile
import time

from absl import app
from absl import flags

import _meta
from _allreduce import launch
from _training import common
from _training import report
from _training import systems as S

FLAGS = flags.FLAGS
flags.DEFINE_list('models', list(common.MODELS), 'models to train: mlp, cnn')
flags.DEFINE_list('systems', ['kungfu', 'mwms', 'single', 'kungfu_nocomm', 'apart'],
                  'kungfu, mwms, single (1 worker alone), kungfu_nocomm (collectives skipped), '
                  'apart (2 plain Keras processes at once); the last two give the comm shares')
flags.DEFINE_integer('batch', 32, 'rows per worker per step (MWMS gets 2x this as its global batch)')
flags.DEFINE_integer('steps', 50, 'steps per epoch; epochs are the unit of timing')
flags.DEFINE_integer('epochs', 3, 'timed epochs per model and launch')
flags.DEFINE_integer('warmup', 1, 'untimed epochs per model and launch before the timed ones')
flags.DEFINE_integer('rounds', 3, 'times every launch is repeated, interleaved; timed epochs are pooled')
flags.DEFINE_bool('quick', False, 'smoke run: defaults --steps=10 --epochs=2 --rounds=1')
flags.DEFINE_integer('launch_timeout', 0, 'seconds before a launch is killed; 0 derives it from the plan')
flags.DEFINE_integer('fusion_bytes', None, 'SynchronousSGDOptimizer(fusion_bytes=...) for the kungfu runs; '
                     'unset: the library default (4 MiB buckets)')
flags.DEFINE_float('kungfu_timeout', 120, 'kfrun --timeout: seconds any KungFu wait may take')
flags.DEFINE_string('launcher', sys.executable + ' -m kungfu.launcher', 'how to start kungfu workers')
flags.DEFINE_string('out', os.path.join(os.path.dirname(os.path.abspath(__file__)), 'results', 'training.md'),
                    'markdown report path; empty to skip')

QUICK = dict(steps=10, epochs=2, rounds=1)  # --quick's values for flags not given


def _flag(name):
    return _meta.flag_value(FLAGS, QUICK, name)


def make_plan(out_dir):
    """What every worker is told (through common.PLAN_ENV)."""
    return dict(models=list(FLAGS.models), batch=FLAGS.batch, steps=_flag('steps'), epochs=_flag('epochs'),
                warmup=FLAGS.warmup, fusion_bytes=FLAGS.fusion_bytes, out_dir=out_dir)


def launch_timeout(plan):
    if FLAGS.launch_timeout:
        return FLAGS.launch_timeout
    # start-up (TF import, cluster set-up) plus, per model, tracing and the epochs at a generous step time
    return _meta.launch_timeout(plan['steps'] * (plan['epochs'] + plan['warmup']), len(plan['models']))


def run_system(system, work_dir):
    """One launch of system; returns (per-rank results or None, why it failed, output tail)."""
    out_dir = tempfile.mkdtemp(prefix=system.key + '-', dir=work_dir)
    plan = make_plan(out_dir)
    timeout = launch_timeout(plan)
    procs = system.commands(plan)
    print('[%s] %s (deadline %.0f s)' % (time.strftime('%H:%M:%S'), system.label, timeout), flush=True)
    t0 = time.monotonic()
    _, why, tail = launch.run_group([c for c, _ in procs], [e for _, e in procs], out_dir, timeout,
                                     done=lambda: _meta.read_ranks(out_dir, system.ranks) is not None)
    per_rank = _meta.read_ranks(out_dir, system.ranks)
    if per_rank is None:
        why = why or 'no results written'
        print('    failed: %s\n%s' % (why, tail), flush=True)
        return None, why, tail
    print('    done in %.0f s%s' % (time.monotonic() - t0, ' (%s)' % why if why else ''), flush=True)
    return per_rank, '', ''


def measure_all(chosen, work_dir, rounds, steps):
    """Runs every system once per round, in turn, so a burst of load from other programs hits one round of a
    system rather than all of its epochs. Returns ({label: {model: Cell}}, [(label, why, tail)] for systems
    that failed in every round)."""
    results, failed = {}, {}
    for r in range(rounds):
        if rounds > 1:
            print('round %d of %d' % (r + 1, rounds), flush=True)
        for system in chosen:
            per_rank, why, tail = run_system(system, work_dir)
            if per_rank is None:
                failed.setdefault(system.label, (why, tail))
                continue
            for model in per_rank[0]:
                results.setdefault(system.label, {}).setdefault(model, report.Cell(steps)).add(
                    [ranks[model] for ranks in per_rank])
    return results, [(label, why, tail) for label, (why, tail) in failed.items() if label not in results]


def run_meta(plan, rounds):
    """What a reader needs to judge the figures: when, on what, with which software and plan."""
    library = os.environ.get('KUNGFU_LIBRARY', 'the installed package\'s')
    return _meta.machine_lines() + [
        ('software', 'Python %s, TensorFlow %s, Keras %s, kungfu library %s (tree %s)' % (
            platform.python_version(), _meta.version('tensorflow-cpu', 'tensorflow'), _meta.version('keras'),
            library, _meta.git_head())),
        ('plan', 'batch %d per worker, Keras SGD(0.01, momentum 0.9), synthetic data; per model and launch %d '
                 'warm-up + %d timed epochs of %d steps; %d round(s) of every launch, interleaved; kungfu fusion_bytes '
                 '%s%s' % (plan['batch'], plan['warmup'], plan['epochs'], plan['steps'], rounds,
                           'default' if plan['fusion_bytes'] is None else plan['fusion_bytes'],
                           ' (--quick)' if FLAGS.quick else '')),
    ]


def main(argv):
    del argv
    known = {s.key for s in S.all_systems([], 0)}
    if set(FLAGS.systems) - known or set(FLAGS.models) - set(common.MODELS):
        raise app.UsageError('--systems takes %s; --models takes %s' % (', '.join(sorted(known)),
                                                                        ', '.join(common.MODELS)))
    if FLAGS.batch < 1 or _flag('steps') < 1 or _flag('epochs') < 1 or FLAGS.warmup < 1 or _flag('rounds') < 1:
        raise app.UsageError('--batch, --steps, --epochs, --warmup and --rounds must be >= 1')
    chosen = [s for s in S.all_systems(FLAGS.launcher.split(), FLAGS.kungfu_timeout) if s.key in FLAGS.systems]
    with tempfile.TemporaryDirectory(prefix='kf-training-') as work_dir:
        plan = make_plan(work_dir)
        meta = run_meta(plan, _flag('rounds'))
        results, failures = measure_all(chosen, work_dir, _flag('rounds'), plan['steps'])
    meta.append(('load average at end', _meta.load_average()))
    text = report.render(results, plan['models'], [s.label for s in chosen], plan['batch'], meta, failures)
    _meta.publish(text, FLAGS.out)


if __name__ == '__main__':
    app.run(main)
