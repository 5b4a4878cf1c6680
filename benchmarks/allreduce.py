"""Allreduce side by side: KungFu against OpenMPI (shared memory and TCP), TF MultiWorkerMirroredStrategy
and the raw loopback TCP ceiling, float32 sum, on local processes.

    python3 benchmarks/allreduce.py                       # np 2 and 4, 4 KiB .. 64 MiB, about 10 minutes
    python3 benchmarks/allreduce.py --quick               # a smoke run of about 2 minutes
    python3 benchmarks/allreduce.py --np=2 --sizes=16M --systems=kungfu,mpi_tcp
    python3 benchmarks/allreduce.py --systems=engine,raw,mpi_tcp,mpi   # no TensorFlow or kungfu needed

The `engine` system is the bare engine (cc/) compiled from this tree by _allreduce/build_engine.sh and driven
through its C API by plain processes, for machines without TensorFlow or the kungfu package: only Python, numpy,
absl-py and a C++ compiler (mpi4py and OpenMPI for the mpi systems). Nothing in this driver imports TensorFlow,
kungfu or mpi4py; each system's needs are checked only when it is chosen.

Each system runs once per np and measures every size in that launch; each launch has a deadline, after which
every process it started is killed. A system that cannot run (kungfu not installed, no mpirun or mpi4py, no
compiler) is listed as not measured and the rest still run. The tables are printed and written as markdown to
--out.
"""
import json
import os
import platform
import sys
import tempfile
import time

from absl import app
from absl import flags

import _meta
from _allreduce import launch
from _allreduce import report
from _allreduce import systems as S

FLAGS = flags.FLAGS
flags.DEFINE_list('np', ['2', '4'], 'numbers of local processes')
flags.DEFINE_list('sizes', ['4K', '64K', '1M', '16M', '64M'], 'message sizes in bytes (K, M, G suffixes: KiB...)')
flags.DEFINE_list('systems', ['kungfu', 'mpi', 'mpi_tcp', 'mwms', 'raw'],
                  'which systems to measure, of %s (engine: the bare engine without TensorFlow)' % ', '.join(S.KEYS))
flags.DEFINE_integer('iters', 200, 'most timed iterations per size (fewer when --seconds runs out)')
flags.DEFINE_integer('min_iters', 5, 'fewest timed iterations per size')
flags.DEFINE_integer('warmup', 3, 'untimed iterations per size')
flags.DEFINE_float('seconds', 2.0, 'time budget per size and system for the timed iterations')
flags.DEFINE_integer('rounds', 2, 'times the whole sweep is run; each cell keeps its best median')
flags.DEFINE_bool('quick', False, 'smoke run (about 2 minutes): defaults --seconds=0.25 --iters=30 --min_iters=3 '
                  '--warmup=2 --rounds=1')
flags.DEFINE_integer('launch_timeout', 0, 'seconds before a launch is killed; 0 derives it from the plan')
flags.DEFINE_string('launcher', sys.executable + ' -m kungfu.launcher', 'how to start kungfu workers')
flags.DEFINE_string('out', os.path.join(os.path.dirname(os.path.abspath(__file__)), 'results', 'allreduce.md'),
                    'markdown report path; empty to skip')

UNITS = {'K': 1 << 10, 'M': 1 << 20, 'G': 1 << 30}


def parse_size(text):
    text = text.strip().upper().rstrip('B').rstrip('I')
    nbytes = int(text[:-1]) * UNITS[text[-1]] if text[-1] in UNITS else int(text)
    if nbytes <= 0 or nbytes % 4:
        raise ValueError('size %r must be a positive multiple of 4 bytes (float32)' % text)
    return nbytes


QUICK = dict(seconds=0.25, iters=30, min_iters=3, warmup=2, rounds=1)  # --quick's values for flags not given


def _flag(name):
    return _meta.flag_value(FLAGS, QUICK, name)


def make_plan(sizes, out_dir):
    """What every worker is told (through harness.PLAN_ENV)."""
    return dict(sizes=sizes, warmup=_flag('warmup'), max_iters=_flag('iters'), min_iters=_flag('min_iters'),
                seconds=_flag('seconds'), out_dir=out_dir)


def launch_timeout(plan, np):
    if FLAGS.launch_timeout:
        return FLAGS.launch_timeout
    # start-up (TF import per rank on few cores) plus, per size, the budget, warm-up and barrier overheads
    return 60 + 20 * np + len(plan['sizes']) * (3 * plan['seconds'] + 10)


def _rank_files(out_dir, np):
    paths = [os.path.join(out_dir, 'rank%d.json' % r) for r in range(np)]
    return paths if all(os.path.exists(p) for p in paths) else None


def read_ranks(out_dir, np):
    """{series: {nbytes: median seconds}} from rank*.json, or None unless every rank wrote its file."""
    paths = _rank_files(out_dir, np)
    if paths is None:
        return None
    per_rank = []
    for p in paths:
        with open(p) as f:
            per_rank.append(json.load(f))
    merged = {}
    for series in per_rank[0]:
        for size in per_rank[0][series]:
            t = report.combine_ranks([r[series][size] for r in per_rank])
            if t:
                merged.setdefault(series, {})[int(size)] = t
    return merged


def run_system(system, np, sizes, work_dir):
    out_dir = tempfile.mkdtemp(prefix='%s-np%d-' % (system.key, np), dir=work_dir)
    plan = make_plan(sizes, out_dir)
    timeout = launch_timeout(plan, np)
    procs = system.commands(np, plan)
    print('[%s] %s, np %d (deadline %.0f s)' % (time.strftime('%H:%M:%S'), ' + '.join(system.series), np, timeout),
          flush=True)
    t0 = time.monotonic()
    _, why, tail = launch.run_group([c for c, _ in procs], [e for _, e in procs], out_dir, timeout,
                                     done=lambda: _rank_files(out_dir, np) is not None)
    merged = read_ranks(out_dir, np)
    if merged is None:
        print('    failed: %s\n%s' % (why or 'no results written', tail), flush=True)
        return None, why or 'no results written'
    print('    done in %.0f s%s' % (time.monotonic() - t0, ' (%s)' % why if why else ''), flush=True)
    return merged, ''


def measure_all(runs, sizes, work_dir, rounds):
    """Runs every (system, np) launch, the whole list `rounds` times over so that a burst of load from other
    programs hits one round of a system rather than all of them; keeps each cell's best median.
    Returns ({series: {np: {nbytes: seconds}}}, [(what, why) for launches that failed in every round])."""
    results, failed, succeeded = {}, {}, set()
    for r in range(rounds):
        if rounds > 1:
            print('round %d of %d' % (r + 1, rounds), flush=True)
        for system, np in runs:
            what = '%s, np %d' % (' + '.join(system.series), np)
            merged, why = run_system(system, np, sizes, work_dir)
            if merged is None:
                failed.setdefault(what, why)
                continue
            succeeded.add(what)
            for series, by_size in merged.items():
                cells = results.setdefault(series, {}).setdefault(np, {})
                for nbytes, t in by_size.items():
                    cells[nbytes] = min(t, cells.get(nbytes, t))
    return results, [(what, why) for what, why in failed.items() if what not in succeeded]


def _kungfu_build():
    """When the kungfu library that will be measured was built (its file time), without importing kungfu."""
    import importlib.util
    spec = importlib.util.find_spec('kungfu')
    path = os.environ.get('KUNGFU_LIBRARY') or (
        os.path.join(os.path.dirname(spec.origin), '_kungfu.so') if spec and spec.origin else '')
    if not path or not os.path.exists(path):
        return 'no library'
    return 'library built %s' % time.strftime('%Y-%m-%d %H:%M', time.localtime(os.path.getmtime(path)))


def run_meta(plan):
    """What a reader needs to judge the figures: when, on what, with which software and plan."""
    engine = [('engine (no TF)', 'cc/ of this tree, built by _allreduce/build_engine.sh with %s'
               % _meta.first_line(S.engine_compiler(), '--version'))] if 'engine' in FLAGS.systems else []
    return _meta.machine_lines() + engine + [
        ('software', 'Python %s, TensorFlow %s, mpi4py %s, %s, kungfu %s (%s; tree %s)' % (
            platform.python_version(), _meta.version('tensorflow-cpu', 'tensorflow'), _meta.version('mpi4py'),
            _meta.first_line('mpirun', '--version'), _meta.version('kungfu'), _kungfu_build(), _meta.git_head())),
        ('plan', 'per size and system: %d warm-up, then %d to %d timed iterations within %.2f s; best of %d '
                 'round(s)%s' % (plan['warmup'], plan['min_iters'], plan['max_iters'], plan['seconds'],
                                 _flag('rounds'), ' (--quick)' if FLAGS.quick else '')),
    ]


def main(argv):
    del argv
    try:
        nps = sorted({int(n) for n in FLAGS.np})
        sizes = sorted({parse_size(s) for s in FLAGS.sizes})
    except (ValueError, KeyError) as e:
        raise app.UsageError('--np takes integers, --sizes e.g. 4K,1M,4096: %s' % e)
    unknown = set(FLAGS.systems) - set(S.KEYS)
    if unknown or min(nps) < 2:
        raise app.UsageError('--systems takes %s; --np values must be >= 2' % ', '.join(S.KEYS))
    failures = []
    with tempfile.TemporaryDirectory(prefix='kf-allreduce-') as work_dir:
        meta = run_meta(make_plan(sizes, work_dir))
        tcp_ring = S.build_tcp_ring(work_dir) if 'raw' in FLAGS.systems else (None, '')
        engine = (None, '')
        if 'engine' in FLAGS.systems:
            print('engine: compiling cc/ with _allreduce/build_engine.sh (%s, a file per core)' % S.engine_compiler(),
                  flush=True)
            engine = S.build_engine(work_dir)
        chosen = []
        for system in S.all_systems(FLAGS.launcher.split(), tcp_ring, engine):
            if system.key not in FLAGS.systems:
                continue  # what it needs is not even looked for: no kungfu import probe, no TF lookup
            why = system.missing()
            if why:
                print('%s skipped: %s' % (system.key, why), flush=True)
                failures.append((system.key, why))
            else:
                chosen.append(system)
        runs = [(s, np) for np in nps for s in chosen]
        if tcp_ring[0]:
            runs.append((S.oneway_system(tcp_ring[0]), 2))
        results, failed = measure_all(runs, sizes, work_dir, _flag('rounds'))
        failures += failed
    meta.append(('load average at end', _meta.load_average()))
    text = report.render(results, nps, sizes, meta, failures)
    _meta.publish(text, FLAGS.out)


if __name__ == '__main__':
    app.run(main)
