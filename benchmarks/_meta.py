"""What every benchmark report starts with (when, on what machine, which software) and how it is written.

Shared by allreduce.py, training.py, monitoring.py and policies.py; each adds its own software and plan lines.
monitoring.py and policies.py also share how a round is launched (launch_round, read_ranks).
"""
import datetime
import os
import platform
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))


def first_line(*argv):
    """The first line a command prints, or '?' when it fails or is missing (30 s deadline)."""
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        return r.stdout.strip().splitlines()[0] if r.returncode == 0 else '?'
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return '?'


def version(*dists):
    """The version of the first of dists that is installed."""
    from importlib import metadata
    for d in dists:
        try:
            return metadata.version(d)
        except metadata.PackageNotFoundError:
            pass
    return 'not installed'


def git_head():
    return first_line('git', '-C', HERE, 'rev-parse', '--short', 'HEAD')


def load_average():
    return '%.2f %.2f %.2f' % os.getloadavg()


def machine_lines():
    """(label, text) lines: date, machine (cores, CPU model, memory, kernel), load average at start."""
    with open('/proc/cpuinfo') as f:
        cpu = next((line.split(':', 1)[1].strip() for line in f if line.startswith('model name')), '?')
    with open('/proc/meminfo') as f:
        mem_gib = int(f.readline().split()[1]) / (1 << 20)
    return [
        ('date', datetime.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')),
        ('machine', '%d cores (%s), %.0f GiB, Linux %s' % (os.cpu_count(), cpu, mem_gib, platform.release())),
        ('load average at start', load_average()),
    ]


def publish(text, out):
    """Prints the report and, when out is set, writes it there."""
    print('\n' + text)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, 'w') as f:
            f.write(text)
        print('written to ' + out)


def flag_value(flag_values, quick, name):
    """A flag's value; with --quick, the smoke-run default in quick (a dict) for a flag not given."""
    if flag_values.quick and name in quick and not flag_values[name].present:
        return quick[name]
    return flag_values[name].value


SECONDS_PER_STEP_BOUND = 0.5  # a generous bound on one 2-worker step on 2 loaded cores, for the deadlines


def launch_timeout(steps, runs):
    """Seconds one launch may take that trains `runs` models or configurations for `steps` steps each:
    start-up (TF import, cluster set-up), then per run its tracing and steps at a generous step time."""
    return 120 + runs * (30 + steps * SECONDS_PER_STEP_BOUND)


def rotated(items, r):
    """items rotated left by r: round r's order, so that each item runs in each position in turn."""
    r %= len(items)
    return items[r:] + items[:r]


def read_ranks(out_dir, ranks=2):
    """The rank<r>.json results of a launch, in rank order, or None while any is missing."""
    import json
    paths = [os.path.join(out_dir, 'rank%d.json' % r) for r in range(ranks)]
    if not all(os.path.exists(p) for p in paths):
        return None
    out = []
    for p in paths:
        with open(p) as f:
            out.append(json.load(f))
    return out


def launch_round(r, worker, plan, out_dir, launcher, kungfu_timeout, timeout, plan_env, bind_to='none'):
    """Round r: one `kfrun -np 2 --bind-to bind_to` launch of worker (a path) with plan (JSON in plan_env),
    killed after timeout seconds; returns (per-rank results or None, why it failed, output tail). Shared by
    monitoring.py and policies.py."""
    import json
    import sys
    import time
    from _allreduce import launch
    first = 20000 + ((os.getpid() + r) % 500) * 20  # away from kfrun's default range and the tests' ports
    argv = launcher.split() + ['-np', '2', '--port-range', '%d-%d' % (first, first + 19), '--timeout',
                               str(kungfu_timeout), '--grace', '5', '--bind-to', bind_to, '--', sys.executable, worker]
    env = dict(os.environ, PYTHONUNBUFFERED='1', **{plan_env: json.dumps(plan)})
    env.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
    print('[%s] round %d: %s (deadline %.0f s, load %s)' % (
        time.strftime('%H:%M:%S'), r + 1, ', '.join(c['key'] for c in plan['configs']), timeout, load_average()),
        flush=True)
    t0 = time.monotonic()
    _, why, tail = launch.run_group([argv], [env], out_dir, timeout, done=lambda: read_ranks(out_dir) is not None)
    per_rank = read_ranks(out_dir)
    if per_rank is None:
        why = why or 'no results written'
        print('    failed: %s\n%s' % (why, tail), flush=True)
        return None, why, tail
    print('    done in %.0f s%s' % (time.monotonic() - t0, ' (%s)' % why if why else ''), flush=True)
    return per_rank, '', ''
