"""KungFu S-SGD, started by kfrun: model.fit with kungfu.optimizers.SynchronousSGDOptimizer around Keras SGD,
every worker its own batch of plan['batch'] rows, BroadcastGlobalVariablesCallback so all start alike.

With plan['skip_comm'] the same program runs with the wrapper's gradient all-reduce replaced by the
identity (kungfu.optimizers._reduce.mean_gradients patched in this process only): the step keeps
everything else of the wrapper (its switch_case, the strategy variable), so the difference in step time
is what the collectives add, waiting for the other worker included. Workers then train apart.

Also records the engine's counters over the timed epochs (collectives and bytes sent per step), to show
what one step sends.
"""
import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import keras  # noqa: E402

import kungfu  # noqa: E402
from kungfu import _lib  # noqa: E402
from kungfu.keras import callbacks as kf_callbacks  # noqa: E402

import common  # noqa: E402


def _skip_collectives():
    from kungfu.optimizers import _reduce

    # mean_gradients' own signature: what it returns is the gradients, then the means of extra.
    def identity(grads, variables=None, fusion_bytes=None, sparse_as_dense=False, extra=(), compression='none',
                 layout=None):
        return list(grads) + list(extra)

    _reduce.mean_gradients = identity


class EngineCounters(keras.callbacks.Callback):
    """The engine's counters from the first timed epoch on (epoch hooks only, like the timer)."""

    def __init__(self, first_timed_epoch):
        super().__init__()
        self.first, self.start = first_timed_epoch, None

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.first:
            self.start = _lib.engine_stats()

    def per_step(self, steps):
        end = _lib.engine_stats()
        return dict(collectives_per_step=(end['completed'] - self.start['completed']) / steps,
                    bytes_sent_per_step=(end['bytes_sent'] - self.start['bytes_sent']) / steps)


def main():
    plan = common.load_plan()
    kungfu.init()
    rank = kungfu.rank()
    if plan.get('skip_comm'):
        _skip_collectives()
    results = {}
    for name in plan['models']:
        common.log(rank, '%s: %d workers, batch %d per worker' % (name, kungfu.size(), plan['batch']))
        model = common.build_model(name, seed=1 + rank)  # differs until the broadcast
        opt = kungfu.optimizers.SynchronousSGDOptimizer(common.plain_sgd(), fusion_bytes=plan.get('fusion_bytes'))
        common.compile_model(model, opt)
        data = common.dataset(name, plan['batch'], rank)
        counters = EngineCounters(plan['warmup'])
        callbacks = [kf_callbacks.BroadcastGlobalVariablesCallback(0), counters]
        if plan.get('skip_comm'):  # no collective keeps the workers in step any more
            callbacks.append(common.start_together(plan, rank, kungfu.size(), name))
        epochs = common.train(model, data, plan, callbacks)
        results[name] = dict(epochs=epochs, weights=common.weights_digest(model),
                             **counters.per_step(plan['steps'] * plan['epochs']))
    common.write_results(plan, rank, results)


if __name__ == '__main__':
    main()
