"""What every benchmark report starts with (when, on what machine, which software) and how it is written.

Shared by allreduce.py, training.py and monitoring.py; each adds its own software and plan lines.
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
