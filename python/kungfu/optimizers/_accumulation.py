"""Gradient accumulation under the distributed optimizer (Keras's gradient_accumulation_steps=N, Horovod's
backward_passes_per_step): the workers exchange once per update, not once per micro-step, also when a
LossScaleOptimizer's inner optimizer accumulates. Functions of the wrapped optimizer `opt` (a
_wrapper.DistributedMixin), called from its apply()."""

import tensorflow as tf

from . import _reduce


def exchange_accumulated(opt, grads, variables, is_update):
    """Gradient accumulation (the base optimizer's gradient_accumulation_steps; Horovod's
    backward_passes_per_step): the workers exchange once per update, not once per micro-step.
    Between updates the base class adds each gradient to its accumulator acc; on the update step
    it applies (g + acc) / steps. So on that step the exchange runs on this worker's g + acc and
    empties the accumulators, and the base class applies its result / steps: S-SGD the mean over
    the workers of their accumulated gradients, the same bits on every worker; SMA and pair
    averaging average the model once per update. It reads Keras 3.15's own _iterations,
    _accumulated_gradients and _get_variable_index; the gradient accumulation check of
    tests/training_worker.py fails if a Keras upgrade changes them."""
    live = [i for i, g in enumerate(grads) if g is not None]
    dense = [tf.convert_to_tensor(grads[i]) for i in live]  # the accumulators are dense anyway

    def exchange():
        return exchange_totals(opt, dense, [variables[i] for i in live], opt,
                               layout=_reduce.present_layout(live, len(grads)))

    new = tf.cond(is_update, exchange, lambda: dense) if live else []
    out = list(grads)
    for i, g in zip(live, new):
        out[i] = g
    return out


def exchange_totals(opt, grads, variables, accumulator, scale=None, layout=None):
    """The update step's exchange: of this worker's gradient plus its accumulated ones (read from
    accumulator, the optimizer that holds them; times scale, the loss scale that grads carry and the
    accumulators do not), each dense; the accumulators are emptied. Returns the exchanged gradients.
    layout: which of the optimizer's variables these are (_reduce.present_layout), checked in the exchange."""
    accs = [accumulator._accumulated_gradients[accumulator._get_variable_index(v)] for v in variables]
    totals = []
    for g, a in zip(grads, accs):
        a = tf.cast(a, g.dtype)
        totals.append(g + (a if scale is None else a * tf.cast(scale, g.dtype)))
    new = opt._kungfu_exchange(totals, variables, layout)
    for a in accs:  # after the reads above, before the base class reads them (program order)
        a.assign(tf.zeros(a.shape, a.dtype))
    return new


def apply_scaled_accumulated(opt, apply_checked, grads, variables, is_update, inner):
    """A LossScaleOptimizer around an optimizer with gradient_accumulation_steps=N (inner, the one
    Keras lets accumulate): the workers exchange once per update, as in exchange_accumulated.
    Between updates this worker's scaled gradient goes to the loss-scale optimizer's finite-gradient
    path (divided by the scale, added to inner's accumulators, the scale's growth counter advanced),
    without its overflow check, which would read this worker's own gradient and skip the micro-step
    on this worker alone (its micro-step count, and so its next exchange, would then differ from the
    others'). The update step exchanges the scaled sum g + scale * acc, and the loss-scale optimizer
    checks and applies the exchanged result as usual: with S-SGD, exactly one process's update on the
    global batches, the same bits on every worker. An overflow in any worker's micro-batch of the
    cycle makes the exchanged sum non-finite, so every worker skips that update (the scale halves);
    inner's step count then goes back to the cycle's start, so that the next cycle accumulates N
    micro-batches again. It reads Keras 3.15's LossScaleOptimizer._stateful_handle_finite_grads too;
    tests/training_worker.py's check of this case fails if a Keras upgrade changes it."""
    live = [i for i, g in enumerate(grads) if g is not None]
    if not live:
        return apply_checked(grads, variables)
    dense = [tf.convert_to_tensor(grads[i]) for i in live]
    back = inner.gradient_accumulation_steps - 1  # micro-steps from the cycle's start to its update step

    def update():
        with tf.name_scope("kungfu"):
            new = exchange_totals(opt, dense, [variables[i] for i in live], inner, opt.dynamic_scale,
                                  layout=_reduce.present_layout(live, len(grads)))
        out = list(grads)
        for i, g in zip(live, new):
            out[i] = g
        counted = tf.convert_to_tensor(inner._iterations)
        apply_checked(out, variables)
        skipped = tf.equal(tf.convert_to_tensor(inner._iterations), counted)  # inner applied nothing
        inner._iterations.assign_sub(tf.cast(tf.where(skipped, back, 0), counted.dtype))
        return tf.constant(True)

    def accumulate():
        opt._stateful_handle_finite_grads(grads, variables)
        return tf.constant(False)

    tf.cond(is_update, update, accumulate)
