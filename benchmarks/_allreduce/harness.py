"""The timing loop every Python allreduce worker shares, so all systems are measured the same way.

Each worker implements a tiny collective adapter (barrier, an agreement sum, and prepare(nbytes) returning one
allreduce call on preallocated buffers) and hands it to measure(). The driver passes the plan through the
environment (sizes, time budget, iteration cap) and reads back one JSON file per rank:
    {series name: {nbytes: [seconds per timed iteration, ...]}}
It combines the ranks itself (max over ranks per iteration, then the median), so workers only record.

Every timed iteration is preceded by a barrier so that one iteration's stragglers do not overlap the next.
The number of timed iterations is derived from the last warm-up time and agreed on by all ranks (an integer sum
through the system's own allreduce), so a slow system at 64 MiB is capped by time, not by --iters.
"""
import json
import os
import time

PLAN_ENV = 'KF_BENCH_PLAN'  # JSON: sizes, warmup, max_iters, min_iters, seconds, out_dir


def load_plan():
    return json.loads(os.environ[PLAN_ENV])


def _timed(barrier, run):
    barrier()
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


def _measure_size(coll, nbytes, plan, log):
    run, first_value = coll.prepare(nbytes)
    warm = [_timed(coll.barrier, run) for _ in range(plan['warmup'])]
    got = first_value()
    if abs(got - coll.size) > 1e-3 * coll.size:
        raise RuntimeError('allreduce of ones over %d ranks gave %r at %d bytes' % (coll.size, got, nbytes))
    want = int(plan['seconds'] / max(warm[-1], 1e-7))
    want = min(plan['max_iters'], max(plan['min_iters'], want))
    iters = coll.sum_over_ranks(want) // coll.size  # identical on every rank
    times = [_timed(coll.barrier, run) for _ in range(iters)]
    if coll.rank == 0:
        ordered = sorted(times)
        log('  %9d B: %4d iters, median %.1f us' % (nbytes, iters, ordered[len(ordered) // 2] * 1e6), flush=True)
    return times


def measure_series(coll, plan, log=print):
    """Runs the plan on one adapter and returns {nbytes: [seconds, ...]}.

    coll needs: rank, size, barrier(), sum_over_ranks(int) -> int, prepare(nbytes) -> (run, first_value)
    where run() does one allreduce of ones and first_value() reads element 0 of its last output.
    """
    return {str(nbytes): _measure_size(coll, nbytes, plan, log) for nbytes in plan['sizes']}


def measure_interleaved(colls, plan, log=print):
    """measure_series for several adapters in the same processes, {series: coll}, taking turns size by
    size, so that the series being compared are measured seconds apart rather than a whole sweep
    apart. Returns {series: {nbytes: [seconds, ...]}}."""
    results = {series: {} for series in colls}
    for nbytes in plan['sizes']:
        for series, coll in colls.items():
            if coll.rank == 0:
                log('%s' % series, flush=True)
            results[series][str(nbytes)] = _measure_size(coll, nbytes, plan, log)
    return results


def write_results(plan, rank, all_series):
    path = os.path.join(plan['out_dir'], 'rank%d.json' % rank)
    with open(path + '.tmp', 'w') as f:
        json.dump(all_series, f)
    os.replace(path + '.tmp', path)  # the driver never reads a half-written file
