"""Policy cost side by side: the step time of the same custom loop over a kungfu.rewrite-n S-SGD step
(2 workers under kfrun, monitors=["gns"], kungfu.data.AdaptiveDataset of global batch 64) with no policy,
with gns_batch_size run as a Python hook (kungfu.PolicyRunner), and with it compiled into the step
(kungfu.rewrite(..., policies=[...])); at interval 1, and again at interval 10. A second no-policy run
shows what a zero cost measures as on this machine.

    python3 benchmarks/policies.py              # 6 rounds, about 4 minutes on 2 busy cores
    python3 benchmarks/policies.py --quick      # a smoke run of about 1 minute
    python3 benchmarks/policies.py --model=mlp  # the MLP of benchmarks/training.py (a longer step)

Every round is one kfrun launch that trains every configuration, a fresh model, optimizer, dataset and
step each, one epoch of each in turn (the order rotated from round to round), so bursts of load from
other programs fall on all of them alike; the launch has a deadline, after which every process it
started is killed. The policy's bounds equal the batch, so it decides at every due step and never
changes the batch: every configuration trains the same sizes. The default model is small (784-64-10),
so that the step is short and a policy's cost per step is not lost in its noise. The table is printed
and written to --out.
"""
import os
import platform
import sys
import tempfile

from absl import app
from absl import flags

import _meta
from _policies import report
from _training import common

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = [dict(key='none', kind='none', interval=1),
           dict(key='hook', kind='hook', interval=1), dict(key='graph', kind='graph', interval=1),
           dict(key='none2', kind='none', interval=1),  # a second no-policy run: what a zero cost measures as
           dict(key='hook10', kind='hook', interval=10), dict(key='graph10', kind='graph', interval=10)]

FLAGS = flags.FLAGS
flags.DEFINE_enum('model', 'small', ['mlp', 'small', 'cnn'], 'mlp, cnn: the models of benchmarks/_training/common.py; '
                  'small: 784-64-10')
flags.DEFINE_integer('steps', 10, 'steps per epoch; epochs are the unit of timing, short so that paired '
                     'epochs of two configurations run close in time')
flags.DEFINE_integer('epochs', 25, 'timed epochs per configuration and round')
flags.DEFINE_integer('warmup', 2, 'untimed epochs per configuration and round before the timed ones')
flags.DEFINE_integer('rounds', 6, 'kfrun launches, each training every configuration (6: each in each position once)')
flags.DEFINE_bool('quick', False, 'smoke run: defaults --epochs=3 --rounds=1')
flags.DEFINE_float('kungfu_timeout', 120, 'kfrun --timeout: seconds any KungFu wait may take')
flags.DEFINE_enum('bind_to', 'core', ['none', 'core'], 'kfrun --bind-to: core gives each worker its own '
                  'core(s), as two workers on dedicated machines would have; none lets them float')
flags.DEFINE_string('launcher', sys.executable + ' -m kungfu.launcher', 'how to start kungfu workers')
flags.DEFINE_string('out', os.path.join(HERE, 'results', 'policies.md'), 'markdown report path; empty to skip')

QUICK = dict(epochs=3, rounds=1)


def _flag(name):
    return _meta.flag_value(FLAGS, QUICK, name)


def run_round(r, work_dir):
    """One launch training every configuration; returns (per-rank results or None, why, output tail)."""
    out_dir = tempfile.mkdtemp(prefix='round%d-' % r, dir=work_dir)
    configs = _meta.rotated(CONFIGS, r)
    plan = dict(model=FLAGS.model, steps=_flag('steps'), epochs=_flag('epochs'), warmup=FLAGS.warmup,
                configs=configs, out_dir=out_dir)
    return _meta.launch_round(r, os.path.join(HERE, '_policies', 'worker.py'), plan, out_dir, FLAGS.launcher,
                              FLAGS.kungfu_timeout,
                              _meta.launch_timeout(plan['steps'] * (plan['epochs'] + plan['warmup']), len(configs)),
                              common.PLAN_ENV, FLAGS.bind_to)


def measure(work_dir, rounds):
    """{config key: {"by_round": [[slowest rank's seconds per timed epoch, in time order] per round],
    "hook": the same for the time inside runner.after_step, "parts": [rank 0's hook parts per round],
    and rank 0's end-of-run fields}}."""
    results, failures = {}, []
    for r in range(rounds):
        per_rank, why, tail = run_round(r, work_dir)
        if per_rank is None:
            failures.append(('round %d' % (r + 1), why, tail))
            continue
        for key in per_rank[0]:
            cell = results.setdefault(key, dict(by_round=[], hook=[], parts=[]))
            for field in ('by_round', 'hook'):
                series = [p[key].get('epochs' if field == 'by_round' else 'hook') for p in per_rank]
                if all(series):
                    n = min(len(s) for s in series)
                    cell[field].append([max(s[i] for s in series) for i in range(n)])
            if 'parts' in per_rank[0][key]:
                cell['parts'].append(per_rank[0][key]['parts'])
            cell.update({k: v for k, v in per_rank[0][key].items() if k not in ('epochs', 'hook', 'parts')})
    return results, failures


def run_meta(rounds):
    return _meta.machine_lines() + [
        ('software', 'Python %s, TensorFlow %s, Keras %s, kungfu library %s (tree %s)' % (
            platform.python_version(), _meta.version('tensorflow-cpu', 'tensorflow'), _meta.version('keras'),
            os.environ.get('KUNGFU_LIBRARY', 'the package\'s'), _meta.git_head())),
        ('plan', '%s, global batch %d on 2 workers; per configuration and round %d warm-up + %d timed epochs '
                 'of %d steps; %d round(s)%s' % (FLAGS.model, 64, FLAGS.warmup, _flag('epochs'), _flag('steps'),
                                                 rounds, ' (--quick)' if FLAGS.quick else '')),
        ('binding', 'kfrun --bind-to %s%s' % (FLAGS.bind_to, ': each worker on its own share of the cores'
                                            if FLAGS.bind_to == 'core' else ': the workers float over every core')),
    ]


def main(argv):
    del argv
    if min(_flag('steps'), _flag('epochs'), FLAGS.warmup, _flag('rounds')) < 1:
        raise app.UsageError('--steps, --epochs, --warmup and --rounds must be >= 1')
    rounds = _flag('rounds')
    meta = run_meta(rounds)
    with tempfile.TemporaryDirectory(prefix='kf-policies-') as work_dir:
        results, failures = measure(work_dir, rounds)
    meta.append(('load average at end', _meta.load_average()))
    meta.append(('note', 'the load at end counts this benchmark\'s own 2 workers (about 2 of it)'))
    if float(meta[2][1].split()[0]) > os.cpu_count():
        meta.append(('caution', 'the 1-minute load at start exceeded the %d cores: other programs competed for '
                                'them, so the step times are noisy; compare the paired costs and rerun when idle'
                     % os.cpu_count()))
    text = report.render(results, CONFIGS, _flag('steps'), FLAGS.model, meta, failures)
    _meta.publish(text, FLAGS.out)


if __name__ == '__main__':
    app.run(main)
