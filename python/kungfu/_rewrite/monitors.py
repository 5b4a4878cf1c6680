"""The monitor pass: S-SGD with the training monitors of kungfu.monitor (gns, variance, snr).

    step = kungfu.rewrite(train_step, monitors=["gns", "variance"], local_batch_size=32)
    step(x, y); kungfu.monitor.latest("train_step")

It computes what the optimizer wrappers compute, with the same graph code (kungfu.monitor.Monitors):
on due steps (every monitor_interval-th call of the step, a tf.cond on a step counter, so the interval
costs no retrace) the S-SGD pass's all-reduce also gives the workers' mean squared gradient norm and the
squared norm of the reduced gradients (KfGroupAllReduceNorms sums them as it copies the gradients; with a
sparse gradient, this worker's norm rides in the last bucket instead), and they give the estimates,
before the update. On one worker (no second batch size) the estimates
pair each due step's gradients with the previous step's (Monitors.update_one_worker). Throughput
(step_time, samples_per_sec) is measured every step.

State: one Monitors object per kungfu.rewrite call, created and registered with kungfu.monitor when
rewrite() is called (so latest() finds it before the first step) and shared by all the rewrites of that
callable (every input signature, every cluster size): its variables and the GNS op's EMA carry on across
retracing, as the wrapper's do. The step counter is a variable of its own, since a rewritten step has no
optimizer iterations to go by.
"""

import tensorflow as tf

from .. import monitor as _monitor
from .ssgd import mean_gradients
from .ssgd import mean_gradients_with_norms
from .ssgd import norms_fusable


def _tensor(g):
    """A Gradient as squared_norm takes it: a tensor, or an IndexedSlices (duplicate rows summed)."""
    return tf.IndexedSlices(g.values, g.indices) if g.sparse else g.values


class MonitoredSSGD:
    """The S-SGD pass with monitors; a pass (passes.py), called as pass_(grads, ctx)."""

    __name__ = "ssgd_with_monitors"

    def __init__(self, names, interval, local_batch_size, name, alpha=_monitor.DEFAULT_ALPHA):
        self.monitors = _monitor.Monitors(names, interval, local_batch_size, name, alpha)
        with tf.init_scope(), tf.device("CPU:0"):
            self.step = tf.Variable(0, trainable=False, dtype=tf.int64, name="kungfu_rewrite_step")

    def __call__(self, grads, ctx):
        m = self.monitors
        local = [_tensor(g) for g in grads]
        m.tick(local)
        step = self.step.read_value()
        if ctx.size == 1 or not m.reduces:
            out = mean_gradients(grads, ctx)[0]
            if ctx.size == 1:  # no second batch size: this step's gradients and the previous step's
                m.update_one_worker(local, [g.variable for g in grads], step)
        else:
            due = m.due(step)
            if norms_fusable(grads):  # both squared norms from the all-reduce, summed as it copies
                out, local_sq, reduced_sq = mean_gradients_with_norms(grads, ctx, tf.convert_to_tensor(due, tf.bool))
                updated = m.update(due, local_sq, reduced_sq=reduced_sq)
            else:
                out, (mean_local_sq,) = mean_gradients(grads, ctx, extra=[m.local_sq_norm(local, due)])
                updated = m.update(due, mean_local_sq, [_tensor(g) for g in out])
            with tf.control_dependencies([updated]):  # before the update, not beside it (see the wrapper)
                out = [g.replace(values=tf.identity(g.values)) for g in out]
        with tf.control_dependencies([g.values for g in out]):
            self.step.assign_add(1)
        return out
