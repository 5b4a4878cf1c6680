"""One kfrun launch of the policy benchmark: on every worker, a custom loop over a kungfu.rewrite-n step
(tf.GradientTape + SGD.apply_gradients on plan['model'], monitors=["gns"]) fed by a
kungfu.data.AdaptiveDataset of global batch 64, once per configuration of plan['configs'], each with its
own model, optimizer, dataset and rewritten step; one epoch (plan['steps'] steps) of each in turn, the
order rotated by the driver from round to round.

A configuration is {"key", "kind", "interval"}: kind "none" runs no policy, "hook" runs the policy as a
Python hook (kungfu.PolicyRunner.after_step(loss=loss) after every step), "graph" compiles it into the
step (kungfu.rewrite(..., policies=[policy])). The policy is gns_batch_size(64, 64, ...): bounds equal
to the batch, so it evaluates its whole decision at every due step and never changes the batch.

Writes rank<r>.json: {config key: {"epochs": [seconds per timed epoch], "hook": [seconds spent inside
runner.after_step per timed epoch] (hook only), "batch", "learning_rate": at the end, "decided": the
policy's last decision (hook) or the compiled policy's step count (graph), "changes": changes applied,
"parts": ms per call of the parts of a due after_step (hook at interval 1; see Run.hook_parts)}}.
"""
import gc
import os
import sys
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), '_training'))

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import kungfu  # noqa: E402
import kungfu.policies as kp  # noqa: E402

import common  # noqa: E402  (benchmarks/_training/common.py)

GLOBAL_BATCH = 64
SMALL_HIDDEN = 64  # the 'small' model: 784-64-10 (51 K parameters), a short step on which a policy's cost shows


def build_model(name):
    """'mlp' (benchmarks/_training/common.py: 784-512-512-10) or 'small' (784-64-10), the same on every worker."""
    if name != 'small':
        return common.build_model(name, seed=1)
    keras.utils.set_random_seed(1)
    layers = keras.layers
    return keras.Sequential([keras.Input(common.input_shape('mlp')), layers.Dense(SMALL_HIDDEN, activation='relu'),
                             layers.Dense(common.CLASSES)], name='small')


def policy(interval):
    """Bounds equal to the batch: the noise scale, the step-time fit and the gain are computed at every
    due step, and the batch never changes, so every configuration trains the same sizes."""
    return kp.gns_batch_size(GLOBAL_BATCH, GLOBAL_BATCH, interval=interval, warmup_steps=0, cooldown_steps=0)


class Run:
    """One configuration: its model, optimizer, dataset, rewritten step and (hook) runner."""

    def __init__(self, plan, config, data):
        self.config = config
        self.ds = kungfu.data.AdaptiveDataset(data, global_batch_size=GLOBAL_BATCH, seed=0)
        self.model = build_model(plan['model'])
        self.opt = common.plain_sgd()
        self.opt.build(self.model.trainable_variables)
        kungfu.broadcast_variables(self.model.variables)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        model, opt = self.model, self.opt

        def train_step(xb, yb):
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        train_step.__name__ = 'step_' + config['key']  # its own collective keys and monitor name
        fn = tf.function(train_step, input_signature=list(self.ds.element_spec))
        args = dict(monitors=['gns'], local_batch_size=self.ds.local_batch_size_variable)
        self.policy = policy(config['interval']) if config['kind'] != 'none' else None
        if config['kind'] == 'graph':
            args.update(policies=[self.policy], optimizer=opt, dataset=self.ds)
        self.step = kungfu.rewrite(fn, **args)
        self.runner = (kungfu.PolicyRunner([self.policy], optimizer=opt, dataset=self.ds, monitors=self.step)
                       if config['kind'] == 'hook' else None)
        self.batches = iter(self.ds.as_dataset())  # one pass of the dataset lasts the whole launch
        self.seconds, self.hook_seconds = [], []

    def epoch(self, steps, timed):
        """One epoch of the benchmark: the next `steps` batches, timed from a barrier (so that neither worker's
        time holds the other's lateness from the previous epoch) to the last step's loss read."""
        in_hook = 0.0
        kungfu.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = self.step(*next(self.batches))
            if self.runner is not None:
                h0 = time.perf_counter()
                self.runner.after_step(loss=loss)
                in_hook += time.perf_counter() - h0
        float(loss)
        if timed:
            self.seconds.append(time.perf_counter() - t0)
            self.hook_seconds.append(in_hook)

    def hook_parts(self, calls=50):
        """What one due runner.after_step costs, in ms per call, part by part, timed after the epochs (every
        worker makes the same calls): the whole call, its two collectives on their own (kungfu._policy.agree,
        as the runner calls them), and the policy's Python on a plain Context. The rest of the call reads
        the monitors' variables, the batch size and the learning rate, keeps the runner's books, and waits
        for the other worker."""
        from kungfu._policy import agree

        loss = self.step(*next(self.batches))
        metrics = {**kungfu.monitor.latest(self.step), 'loss': float(loss)}
        local = {k: v for k, v in metrics.items() if v is not None and k not in agree.AGREED_METRICS}
        parts = dict(
            after_step=lambda: self.runner.after_step(loss=loss),
            mean_of_metrics=lambda: agree.mean_local_metrics(local, 'benchmark/policies/metrics', 'benchmark'),
            exchange=lambda: agree.exchange({'error': None, 'changes': {}}, 'benchmark/policies/exchange'),
            policy=lambda: self.policy.after_step(kp.Context(step=10**6, batch_size=GLOBAL_BATCH, cluster_size=2,
                                                             learning_rate=0.01, metrics=metrics)))
        out = {}
        for name, call in parts.items():
            kungfu.barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                call()
            out[name] = 1e3 * (time.perf_counter() - t0) / calls
        return out

    def results(self):
        out = dict(epochs=self.seconds, batch=self.ds.batch_size, learning_rate=float(self.opt.learning_rate.numpy()))
        if self.runner is not None:
            out.update(hook=self.hook_seconds, decided=self.policy.describe_last(), changes=len(self.runner.history))
        elif self.policy is not None:
            out.update(decided='compiled policy counted %d steps' % self.step.policy_step)
        return out


def main():
    """Epoch by epoch, every configuration in turn: a burst of load from other programs then falls on all
    configurations alike instead of on one of them."""
    plan = common.load_plan()
    kungfu.init()
    rank = kungfu.rank()
    common.log(rank, '%s: %d workers, global batch %d' % (', '.join(c['key'] for c in plan['configs']),
                                                          kungfu.size(), GLOBAL_BATCH))
    epochs = plan['warmup'] + plan['epochs']
    inputs = 'mlp' if plan['model'] == 'small' else plan['model']
    # The whole data set, the same on every worker, shared by the configurations: enough whole batches for
    # every epoch and hook_parts, so that one pass lasts the launch and no epoch starts a new iterator.
    data = common.arrays(inputs, GLOBAL_BATCH * (plan['steps'] * epochs + 8))
    runs = [Run(plan, c, data) for c in plan['configs']]
    for epoch in range(epochs):
        for run in runs:
            run.epoch(plan['steps'], timed=epoch >= plan['warmup'])
    results = {run.config['key']: run.results() for run in runs}
    for run in runs:
        if run.runner is not None and run.config['interval'] == 1:
            results[run.config['key']]['parts'] = run.hook_parts()
    for run in runs:  # freed while Python runs: a tf.data generator iterator left to the interpreter's
        del run.batches  # shutdown can hang the exit in garbage collection
    gc.collect()
    common.write_results(plan, rank, results)
    common.log(rank, 'results written')


if __name__ == '__main__':
    main()
