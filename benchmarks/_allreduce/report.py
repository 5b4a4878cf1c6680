"""Turning per-rank timings into the tables the driver prints and writes as markdown.

results: {series: {np: {nbytes: median seconds}}}, where a missing entry means the launch failed or was skipped.
Algorithm bandwidth is size / time; bus bandwidth scales it by 2(n-1)/n, the share of the data each rank must
send in a bandwidth-optimal allreduce, so it is comparable across n and with the raw ring ceiling.

The ratios and targets compare one series of ours with the baselines: the eager kungfu.all_reduce (what a user's
code pays) when it was measured, else the bare engine (--systems=engine on a machine without TensorFlow), which
the report then says, since the engine's figures leave out what TensorFlow and the Python wrapper add.
"""
import statistics

from _allreduce import systems as S

OURS = S.KUNGFU_OP
# The series the ratios use when OURS is missing, in order: the engine built without TF, then the one inside TF.
OURS_FALLBACKS = [S.KUNGFU_ENGINE_NOTF, S.KUNGFU_ENGINE]
SERIES_ORDER = [S.KUNGFU_OP, S.KUNGFU_ENGINE, S.KUNGFU_ENGINE_NOTF, S.MPI_DEFAULT, S.MPI_TCP, S.MWMS, S.RAW_RING]
MiB = 1 << 20


def ours_series(results):
    """The series of ours that the ratios and targets compare: OURS if measured, else the first fallback."""
    return next((s for s in [OURS] + OURS_FALLBACKS if s in results), OURS)


def combine_ranks(per_rank):
    """per_rank: [[seconds per iteration] for each rank] -> median over iterations of the slowest rank's time."""
    n = min(len(times) for times in per_rank)
    if n == 0:
        return None
    return statistics.median(max(times[i] for times in per_rank) for i in range(n))


def fmt_size(nbytes):
    for unit, scale in (('GiB', 1 << 30), ('MiB', MiB), ('KiB', 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return '%d %s' % (nbytes // scale, unit)
    return '%d B' % nbytes


def algbw(nbytes, seconds):
    return nbytes / seconds / 1e9


def busbw(nbytes, seconds, np):
    return algbw(nbytes, seconds) * 2 * (np - 1) / np


def _get(results, series, np, nbytes):
    return results.get(series, {}).get(np, {}).get(nbytes)


def _fmt_gbs(value):
    return '%.2f' % value if value >= 0.1 else '%.3f' % value


def _fmt_time(seconds):
    us = seconds * 1e6
    return '%.0f' % us if us >= 100 else '%.1f' % us


def _ratio(a, b):
    return '%.2fx' % (b / a) if a and b else '-'  # a, b are times: ours a against baseline b


def table(header, rows):
    """A markdown table padded so it also reads well in a terminal."""
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: '| ' + ' | '.join(str(c).ljust(w) for c, w in zip(r, widths)) + ' |'
    return '\n'.join([line(header), '|' + '|'.join('-' * (w + 2) for w in widths) + '|'] + [line(r) for r in rows])


def bandwidth_table(results, nps, sizes, series):
    header = ['np', 'size'] + series
    rows = []
    for np in nps:
        for n in sizes:
            cells = []
            for s in series:
                t = _get(results, s, np, n)
                cells.append('%s / %s' % (_fmt_gbs(algbw(n, t)), _fmt_gbs(busbw(n, t, np))) if t else '-')
            rows.append([np, fmt_size(n)] + cells)
    return table(header, rows)


def latency_table(results, nps, sizes, series):
    header = ['np', 'size'] + series
    rows = [[np, fmt_size(n)] + [_fmt_time(t) if (t := _get(results, s, np, n)) else '-' for s in series]
            for np in nps for n in sizes]
    return table(header, rows)


def ratio_table(results, nps, sizes, ours_name=OURS):
    header = ['np', 'size', 'ours/OpenMPI-TCP', 'ours/OpenMPI-default', 'ours/MWMS', 'ours busbw / raw ring']
    rows = []
    for np in nps:
        for n in sizes:
            ours = _get(results, ours_name, np, n)
            raw = _get(results, S.RAW_RING, np, n)
            rows.append([np, fmt_size(n), _ratio(ours, _get(results, S.MPI_TCP, np, n)),
                         _ratio(ours, _get(results, S.MPI_DEFAULT, np, n)),
                         _ratio(ours, _get(results, S.MWMS, np, n)),
                         '%.0f%%' % (100 * raw / ours) if ours and raw else '-'])
    return table(header, rows)


def oneway_line(results, sizes):
    measured = [(n, t) for n in sizes if (t := _get(results, S.RAW_ONEWAY, 2, n))]
    cells = ['%s %s' % (fmt_size(n), _fmt_gbs(algbw(n, t))) for n, t in measured]
    return 'Raw loopback TCP, one stream one way (GB/s): ' + ', '.join(cells) if cells else ''


def _check(name, pairs, want, fmt):
    """pairs: [(label, value)] with value None when not measured; met when every measured value >= want."""
    got = [(label, v) for label, v in pairs if v is not None]
    if not got:
        return '- %s: not measured' % name
    worst = min(got, key=lambda p: p[1])
    verdict = 'met' if worst[1] >= want else 'NOT met'
    return '- %s: %s (worst %s at %s)' % (name, verdict, fmt(worst[1]), worst[0])


def targets(results, nps, sizes, ours_name=OURS):
    """The speed targets, shown and never asserted: ratios are ours over the baseline (higher is better)."""
    def speedup(base, np, n):
        ours, theirs = _get(results, ours_name, np, n), _get(results, base, np, n)
        return theirs / ours if ours and theirs else None

    label = lambda np, n: 'np %d, %s' % (np, fmt_size(n))
    mid = [n for n in sizes if MiB <= n <= 64 * MiB]
    x = lambda v: '%.2fx' % v
    lines = [
        _check('>= 1.2x OpenMPI over TCP, 1 to 64 MiB', [(label(p, n), speedup(S.MPI_TCP, p, n))
                                                          for p in nps for n in mid], 1.2, x),
        _check('>= 5x TF MWMS (RING), every size', [(label(p, n), speedup(S.MWMS, p, n))
                                                    for p in nps for n in sizes], 5.0, x),
        _check('>= 80% of the raw TCP ring ceiling at 16 MiB',
               [(label(p, 16 * MiB), speedup(S.RAW_RING, p, 16 * MiB)) for p in nps if 16 * MiB in sizes], 0.8,
               lambda v: '%.0f%%' % (100 * v)),
        _check('4 KiB at np 4 no slower than OpenMPI over TCP (latency)',
               [(label(4, 4096), speedup(S.MPI_TCP, 4, 4096))] if 4 in nps and 4096 in sizes else [], 1.0, x),
    ]
    return '\n'.join(lines)


def render(results, nps, sizes, meta, failures):
    """The whole report as markdown; meta is an ordered list of (key, value) lines about the run."""
    series = [s for s in SERIES_ORDER if s in results]
    ours = ours_series(results)
    parts = ['# Allreduce, float32 sum, local processes', '']
    parts += ['- %s: %s' % kv for kv in meta]
    parts += ['', 'Each cell: median over iterations of the slowest rank (a barrier precedes every iteration), '
              'the best such median over the rounds.',
              '', '## Bandwidth, GB/s: algbw / busbw (busbw = algbw * 2(n-1)/n)', '',
              bandwidth_table(results, nps, sizes, series), '', '## Median time per allreduce, microseconds', '',
              latency_table(results, nps, sizes, series), '',
              '## Ratios (%s against each baseline; x = how many times faster)' % ours, '']
    if ours != OURS:
        parts += ['%s was not measured, so these ratios and the targets below are those of %s: the bare engine '
                  'through its C API, without what TensorFlow and the Python wrapper add to a user\'s call.'
                  % (OURS, ours), '']
    parts += [ratio_table(results, nps, sizes, ours), '']
    if any((o := _get(results, ours, np, n)) and (r := _get(results, S.RAW_RING, np, n)) and r > o
           for np in nps for n in sizes):
        parts += ['A ratio to the raw ring above 100% means the raw mover is not a tight ceiling there: on few '
                  'cores, how the processes are scheduled matters as much as the bytes moved.', '']
    oneway = oneway_line(results, sizes)
    if oneway:
        parts += [oneway, '']
    parts += ['## Targets (shown, not asserted%s)' % ('' if ours == OURS else '; ours: ' + ours), '',
              targets(results, nps, sizes, ours), '']
    if failures:
        parts += ['## Not measured', ''] + ['- %s: %s' % kv for kv in failures] + ['']
    return '\n'.join(parts)
