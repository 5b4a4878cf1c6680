"""The policy benchmark's table: median step time per configuration and the policy's cost over no policy,
paired epoch by epoch.

results: {config key: {"by_round": [[slowest rank's seconds per timed epoch, in time order] per round],
                       "hook": the same for the seconds spent inside runner.after_step (hook only),
                       "parts": [rank 0's ms per call of the parts of a due after_step, per round],
                       "batch", "learning_rate", "decided", "changes": rank 0's, at the end of its last launch}}
"""
import statistics

from _allreduce.report import table

LABELS = {'none': 'no policy', 'hook': 'Python hook, interval 1', 'graph': 'compiled into the step, interval 1',
          'none2': 'no policy, a second run (noise floor)', 'hook10': 'Python hook, interval 10',
          'graph10': 'compiled into the step, interval 10'}
MODELS = {'small': 'a small MLP, 784-64-10 (51 K parameters; a short step, on which a policy\'s cost shows)',
          'mlp': 'the MLP of benchmarks/_training, 784-512-512-10 (0.67 M parameters)',
          'cnn': 'the CNN of benchmarks/_training (0.23 M parameters)'}


def _epochs(cell):
    return [t for epochs in cell.get('by_round', []) for t in epochs]


def _ms(seconds, steps):
    return 1e3 * seconds / steps


def paired(results, key, steps):
    """(ms, fraction): the median over all timed epochs of t(key) - t(none) per step, each epoch of key against
    the epoch of no policy that ran next to it (same launch, same position), so a burst of load hits both
    sides of most pairs; and that median over the median no-policy step. None if either is missing."""
    base, mine = results.get('none', {}).get('by_round', []), results.get(key, {}).get('by_round', [])
    pairs = [(x, y) for a, b in zip(base, mine) for x, y in zip(a, b)]
    if not pairs:
        return None
    ms = statistics.median(_ms(y - x, steps) for x, y in pairs)
    return ms, ms / _ms(statistics.median(_epochs(results['none'])), steps)


def round_costs(results, key):
    """Per round: the median step time of key over that of no policy in the same launch, minus 1."""
    return [statistics.median(b) / statistics.median(a) - 1
            for a, b in zip(results.get('none', {}).get('by_round', []), results.get(key, {}).get('by_round', []))
            if a and b]


def main_table(results, configs, steps):
    header = ['configuration', 'ms/step, median (min-max)', 'policy cost, paired', 'cost per round',
              'inside after_step, ms/step', 'batch, lr at end']
    rows = []
    for c in configs:
        key, cell = c['key'], results.get(c['key'], {})
        e = _epochs(cell)
        if not e:
            rows.append([LABELS[key], 'failed', '-', '-', '-', '-'])
            continue
        p = paired(results, key, steps) if key != 'none' else None
        hook = _epochs(dict(by_round=cell.get('hook', [])))
        rows.append([LABELS[key],
                     '%.2f (%.2f-%.2f)' % (_ms(statistics.median(e), steps), _ms(min(e), steps), _ms(max(e), steps)),
                     '%+.2f ms (%+.1f%%)' % (p[0], 100 * p[1]) if p else '',
                     ', '.join('%+.1f%%' % (100 * x) for x in round_costs(results, key)) if key != 'none' else '',
                     '%.2f' % _ms(statistics.median(hook), steps) if hook else '',
                     '%s, %.4g' % (cell.get('batch'), cell.get('learning_rate'))])
    return table(header, rows)


def parts_line(results):
    """The parts of one due runner.after_step (worker.Run.hook_parts), median over rounds of rank 0's."""
    rounds = results.get('hook', {}).get('parts')
    if not rounds:
        return None
    p = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    rest = p['after_step'] - p['mean_of_metrics'] - p['exchange'] - p['policy']
    return ('One due runner.after_step, timed on its own after the epochs (ms per call, median over rounds, '
            'rank 0): %.2f in all; of it, timed alone: the all-reduce of the local metrics %.2f, the all-gather '
            'of the decisions %.2f, the policy\'s arithmetic in Python %.2f; the remaining %+.2f is six eager '
            'variable reads (the monitors, the batch size, the learning rate), the runner\'s books and the '
            'difference in waiting for the other worker (the parts are timed back to back, in separate loops).'
            % (p['after_step'], p['mean_of_metrics'], p['exchange'], p['policy'], rest))


def notes(model, steps):
    return [
        'The step: a custom loop over kungfu.rewrite(train_step, monitors=["gns"], local_batch_size='
        'ds.local_batch_size_variable), train_step a tf.function with tf.GradientTape and keras SGD(0.01, '
        'momentum 0.9).apply_gradients, on %s, fed by a kungfu.data.AdaptiveDataset of synthetic '
        'data in memory (global batch 64, 32 rows per worker); 2 workers under kfrun. Every configuration has '
        'its own model, optimizer, dataset and rewritten step, and all pay for the gns monitor alike.' % MODELS[model],
        'The policy: kungfu.policies.gns_batch_size(64, 64, interval=k, warmup_steps=0, cooldown_steps=0). Its '
        'bounds equal the batch, so at every due step it evaluates its whole decision (the noise scale, the '
        'step-time fit, the target and the predicted gain) but never changes the batch or the learning rate: '
        'every configuration trains the same sizes (batch, lr at end: the same in every row).',
        'Python hook: kungfu.PolicyRunner([policy], optimizer=opt, dataset=ds, monitors=step) and '
        'runner.after_step(loss=loss) after every step. On a due step it reads the loss (loss.numpy(): a few '
        'microseconds, as TensorFlow runs the eager call of the step synchronously, so the step has already '
        'ended), the monitors\' variables, the batch size and the learning rate; runs two small eager '
        'collectives, an all-reduce of the local metrics (loss, step_time, samples_per_sec) and an all-gather '
        'of every worker\'s decisions (JSON), each one more point per step where the workers wait for each '
        'other; and runs the policy\'s arithmetic in Python. On the other steps (interval 10) it costs a few '
        'attribute reads. "inside after_step": the time spent in those calls, waiting for the other worker '
        'included.',
        'Compiled: kungfu.rewrite(train_step, ..., policies=[policy], optimizer=opt, dataset=ds). After the '
        'update the step counts itself and runs the policy under a tf.cond that is true every k steps (also '
        'at k = 1). In the traced graph the true branch of this policy holds about 285 ops besides constants '
        'and identities: 36 variable reads, 19 assigns (its state and the controls), about 225 float64 '
        'scalar ops (mul, select, cast, div, ...), 2 asserts, and one all-reduce of one float64 (step_time, '
        'which the policy reads, and one more point per due step where the workers wait for each other); no '
        'Python between steps. The false branch is two ops.',
        'ms/step: per timed epoch of %d steps (one pass of the dataset lasts the whole launch, so no epoch '
        'starts an iterator), timed from a barrier to the last step\'s loss read, the slowest rank\'s time; '
        'the median over the timed epochs of every round (warm-up epochs dropped).' % steps,
        'policy cost, paired: the median over the timed epochs of t(config) - t(no policy) per step, each epoch '
        'against the no-policy epoch of the same launch and position in it; in % of the median no-policy '
        'step. cost per round: the ratio of the round medians. Every round is one kfrun launch that trains '
        'all configurations one epoch of each in turn, in an order rotated from round to round, so bursts of '
        'load from other programs fall on all of them alike. The second no-policy run is paired the same '
        'way: its "cost" is what this machine\'s noise makes of a zero.',
    ]


def render(results, configs, steps, model, meta, failures):
    parts = ['# Policy cost: a policy as a Python hook and compiled into the step', '']
    parts += ['- %s: %s' % kv for kv in meta]
    parts += ['', main_table(results, configs, steps), '']
    decided = [(c['key'], results[c['key']].get('decided')) for c in configs
               if results.get(c['key'], {}).get('decided')]
    if parts_line(results):
        parts += [parts_line(results), '']
    if decided:
        parts += ['Last decision, rank 0: ' + '; '.join('%s: %s' % kv for kv in decided) + '.', '']
    parts += ['## How to read it', ''] + ['- ' + n for n in notes(model, steps)] + ['']
    if failures:
        parts += ['## Failed launches', '']
        for what, why, tail in failures:
            parts += ['- %s: %s' % (what, why)]
            if tail:
                parts += ['', '```', tail.strip()[-3000:], '```', '']
    return '\n'.join(parts)
