"""Turning per-rank epoch times into the table the driver prints and writes as markdown.

results: {system label: {model: Cell}}; a missing entry means the launch failed or was not run.
"""
import statistics

from _allreduce.report import table
from _training import systems as S

TARGET = 1.3  # KungFu S-SGD steps/s over MWMS steps/s, per model (shown, never asserted)


class Cell:
    """One system on one model: per timed epoch, the slowest rank's seconds, pooled over rounds."""

    def __init__(self, steps):
        self.steps = steps  # steps per epoch
        self.epochs = []  # slowest rank's seconds per timed epoch
        self.extra = {}  # rank 0's counters (kungfu: collectives and bytes sent per step)
        self.in_sync = []  # per launch of several ranks: did all ranks end with the same weights?

    def add(self, per_rank):
        """per_rank: [{'epochs': [...], ...} for each rank] of one launch."""
        n = min(len(r['epochs']) for r in per_rank)
        self.epochs += [max(r['epochs'][i] for r in per_rank) for i in range(n)]
        self.extra.update({k: v for k, v in per_rank[0].items() if k not in ('epochs', 'weights')})
        if len(per_rank) > 1 and all('weights' in r for r in per_rank):
            self.in_sync.append(all(_close(r['weights'], per_rank[0]['weights']) for r in per_rank[1:]))

    @property
    def step_seconds(self):
        return statistics.median(self.epochs) / self.steps if self.epochs else None

    @property
    def spread(self):
        """(fastest, slowest) seconds per step over the timed epochs."""
        return min(self.epochs) / self.steps, max(self.epochs) / self.steps


def _close(a, b, rtol=1e-4):
    return len(a) == len(b) and all(abs(x - y) <= rtol * max(1.0, abs(x), abs(y)) for x, y in zip(a, b))


def _get(results, label, model):
    cell = results.get(label, {}).get(model)
    return cell.step_seconds if cell else None


def _share(t_without, t_with):
    return '%.0f%%' % (100 * max(0.0, 1 - t_without / t_with)) if t_without and t_with else '-'


def comm_share(results, label, model):
    """How much of the 2-worker step the distribution adds (see the notes in render())."""
    if label == S.KUNGFU:
        return _share(_get(results, S.KUNGFU_NOCOMM, model), _get(results, label, model))
    if label == S.MWMS:
        return _share(_get(results, S.APART, model), _get(results, label, model))
    return ''


def _num(v):
    return '%.1f' % v if v >= 10 else '%.2f' % v


def main_table(results, models, labels, batch):
    header = ['system', 'model', 'steps/s (per worker)', 'samples/s (all workers)', 'ms/step (min-max)',
              'vs MWMS', 'comm share', 'vs 2 apart']
    rows = []
    for model in models:
        mwms = _get(results, S.MWMS, model)
        for label in labels:
            cell = results.get(label, {}).get(model)
            if cell is None or not cell.epochs:
                rows.append([label, model, 'failed', '-', '-', '-', '-', '-'])
                continue
            t = cell.step_seconds
            workers = 1 if label == S.SINGLE else 2
            lo, hi = cell.spread
            distributed = label in (S.KUNGFU, S.MWMS)
            rows.append([label, model, _num(1 / t), '%.0f' % (workers * batch / t),
                         '%.1f (%.1f-%.1f)' % (1e3 * t, 1e3 * lo, 1e3 * hi),
                         '%.2fx' % (mwms / t) if mwms else '-', comm_share(results, label, model),
                         _share(_get(results, S.APART, model), t) if distributed else ''])
    return table(header, rows)


def kungfu_traffic(results, models):
    cells = [(m, results.get(S.KUNGFU, {}).get(m)) for m in models]
    parts = ['%s %.0f collective(s) and %.2f MB sent per step per worker' % (
        m, c.extra['collectives_per_step'], c.extra['bytes_sent_per_step'] / 1e6)
        for m, c in cells if c and 'bytes_sent_per_step' in c.extra]
    return 'KungFu engine counters over the timed epochs: ' + '; '.join(parts) + '.' if parts else ''


def sync_check(results, models, labels):
    """Each worker trains on its own data, so equal weights at the end show the gradients were averaged."""
    lines = []
    for label in labels:
        for model in models:
            cell = results.get(label, {}).get(model)
            if cell is None or not cell.in_sync:
                continue
            same = sum(cell.in_sync)
            synchronous = label in (S.KUNGFU, S.MWMS)
            ok = same == len(cell.in_sync) if synchronous else same == 0
            verdict = 'as expected' if ok else 'NOT as expected: %s' % (
                'its workers did not average their gradients' if synchronous else 'they should differ')
            lines.append('- %s, %s: workers ended with equal weights in %d of %d launches (%s)' % (
                label, model, same, len(cell.in_sync), verdict))
    return '\n'.join(lines)


def targets(results, models):
    lines = []
    for model in models:
        ours, theirs = _get(results, S.KUNGFU, model), _get(results, S.MWMS, model)
        if ours and theirs:
            x = theirs / ours
            lines.append('- %s: KungFu %.2fx MWMS steps/s, target >= %.1fx: %s' % (
                model, x, TARGET, 'met' if x >= TARGET else 'NOT met'))
        else:
            lines.append('- %s: not measured' % model)
    return '\n'.join(lines)


NOTES = [
    'steps/s: steps per second of model.fit on each worker, from the median epoch time (the slowest rank\'s '
    'per epoch) over the timed epochs of every round, warm-up epochs dropped; each worker computes on the '
    'same per-worker batch in every system, so 2 workers handle twice the samples of 1 worker per step.',
    'comm share, KungFu: 1 - t(KungFu, collectives skipped) / t(KungFu). The skipped run is the same kfrun '
    'launch and the same wrapped optimizer with its gradient all-reduce replaced by the identity, so the '
    'share is what the collectives add to a step: moving and reducing the bytes, and waiting for the other '
    'worker to reach the same step.',
    'comm share, MWMS: its collectives cannot be taken out of its step, so this is 1 - t(2 plain Keras '
    'workers at once) / t(MWMS): everything MWMS adds over two independent processes (collectives, '
    'per-replica bookkeeping, its distributed input pipeline).',
    'vs 2 apart: the same measure for both distributed systems: 1 - t(2 plain Keras workers at once) / t(system).',
    'MWMS under Keras 3.15: model.fit does not run out of the box (keras-team/keras#20585). Its worker '
    'patches two Keras internals, in its own process only: the model is built from a local batch instead '
    'of an eagerly reduced per-replica one, and each step logs the worker\'s own loss instead of a mean over '
    'workers that fails on a scalar. The second also spares MWMS a scalar all-reduce per step; the training '
    'steps are otherwise Keras\'s own (see _training/worker_mwms.py).',
    'Both workers of a 2-worker run share this machine\'s cores: their computations compete with each other '
    '(and with the engines\' threads), so a 2-worker step is slower than a 1-worker step even with no '
    'communication, and while one worker waits on the network the other computes faster. The comm shares '
    'are therefore those of this oversubscribed setting, not of workers on their own machines.',
]


def render(results, models, labels, batch, meta, failures):
    parts = ['# Training throughput: KungFu S-SGD against TF MultiWorkerMirroredStrategy', '']
    parts += ['- %s: %s' % kv for kv in meta]
    parts += ['', main_table(results, models, labels, batch), '']
    traffic = kungfu_traffic(results, models)
    if traffic:
        parts += [traffic, '']
    parts += ['## Targets (shown, not asserted)', '', targets(results, models), '']
    sync = sync_check(results, models, labels)
    if sync:
        parts += ['## Do the workers train together?', '',
                  'Every worker trains on its own random data, so the workers\' weights agree at the end only '
                  'if every step averaged their gradients.', '', sync, '']
    parts += ['## How to read it', '']
    parts += ['- ' + n for n in NOTES] + ['']
    if failures:
        parts += ['## Failed launches', '']
        for what, why, tail in failures:
            parts += ['- %s: %s' % (what, why)]
            if tail:
                parts += ['', '```', tail.strip()[-3000:], '```', '']
        parts += ['']
    return '\n'.join(parts)
