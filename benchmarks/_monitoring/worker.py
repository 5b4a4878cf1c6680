"""One kfrun launch of the monitoring benchmark: on every worker, the same MLP trained with model.fit by
SynchronousSGDOptimizer once per configuration of plan['configs'], a fresh model and optimizer each, one
epoch of each in turn (model.fit(initial_epoch=e, epochs=e + 1); the order is rotated by the driver
from round to round). A configuration is {"key", "interval"}; interval 0 means no monitors, else
monitor=["gns", "variance", "snr"] at that monitor_interval. Model, data and timing are the training
benchmark's (benchmarks/_training/common.py), so the figures compare with benchmarks/results/training.md.

Writes rank<r>.json: {config key: {"epochs": [seconds per timed epoch], "cpu": [this process's CPU seconds
(all its threads) per timed epoch], "monitors": latest() at the end, "updates": how many steps ran the
gradient monitors (kungfu.monitor.update_count)}}.
"""
import os
import sys
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), '_training'))

import kungfu  # noqa: E402
from kungfu.keras import callbacks as kf_callbacks  # noqa: E402

import common  # noqa: E402  (benchmarks/_training/common.py)

MONITORS = ['gns', 'variance', 'snr']
MODEL = 'mlp'


def optimizer(plan, interval):
    if not interval:
        return kungfu.optimizers.SynchronousSGDOptimizer(common.plain_sgd())
    return kungfu.optimizers.SynchronousSGDOptimizer(common.plain_sgd(), monitor=MONITORS,
                                                     monitor_interval=interval, local_batch_size=plan['batch'])


def build(plan, rank, config):
    model = common.build_model(MODEL, seed=1 + rank)  # differs until the broadcast
    opt = optimizer(plan, config['interval'])
    common.compile_model(model, opt)
    return model, opt, common.dataset(MODEL, plan['batch'], rank)


def main():
    """Epoch by epoch, every configuration in turn: a burst of load from other programs then falls on all
    configurations alike instead of on one of them."""
    plan = common.load_plan()
    kungfu.init()
    rank = kungfu.rank()
    configs = plan['configs']
    common.log(rank, '%s: %d workers, batch %d per worker' % (', '.join(c['key'] for c in configs),
                                                              kungfu.size(), plan['batch']))
    runs = [build(plan, rank, c) for c in configs]
    seconds, cpu = [[] for _ in configs], [[] for _ in configs]
    for epoch in range(plan['warmup'] + plan['epochs']):
        for i, (model, _, data) in enumerate(runs):
            timer = common.epoch_timer()
            callbacks = [kf_callbacks.BroadcastGlobalVariablesCallback(0)] if epoch == 0 else []
            cpu0 = time.process_time()  # CPU time resists load from other programs better than wall time
            model.fit(data, steps_per_epoch=plan['steps'], initial_epoch=epoch, epochs=epoch + 1, verbose=0,
                      shuffle=False, callbacks=callbacks + [timer])
            if epoch >= plan['warmup']:
                seconds[i] += timer.seconds
                cpu[i].append(time.process_time() - cpu0)
    results = {}
    for config, (model, opt, _), epochs, cpu_s in zip(configs, runs, seconds, cpu):
        results[config['key']] = dict(epochs=epochs, cpu=cpu_s)
        if config['interval']:
            results[config['key']].update(monitors=kungfu.monitor.latest(opt),
                                          updates=kungfu.monitor.update_count(opt))
    common.write_results(plan, rank, results)


if __name__ == '__main__':
    main()
