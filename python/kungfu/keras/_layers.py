"""kungfu.keras.SyncBatchNormalization: batch normalization over the global batch of every worker."""

import keras
import tensorflow as tf

from .. import ops


@tf.custom_gradient
def _sum_over_workers(x):
    """ops.all_reduce(x, "sum"), differentiable: the gradient of a sum over workers with respect to one
    worker's x is the sum over workers of the upstream gradients (every worker's loss depends on x)."""

    def grad(dy):
        return ops.all_reduce(dy, "sum")

    return ops.all_reduce(x, "sum"), grad


@keras.saving.register_keras_serializable(package="kungfu")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """keras.layers.BatchNormalization whose training-time statistics are those of the global batch.

    In training, plain BatchNormalization normalises with the mean and variance of each worker's own
    batch, so with small per-worker batches the statistics are noisy and the workers' moving averages
    drift apart. This layer combines every worker's per-channel count, mean and sum of squared distances
    to that mean in one all-reduce, and normalises with the global mean and variance: what one process
    would compute on the concatenation of the workers' batches (as Horovod's hvd.SyncBatchNormalization).
    The moving mean and variance then stay equal on every worker. Gradients flow through the all-reduce,
    so with DistributedOptimizer's averaged gradients training equals one process on the global batch
    when the workers' batches are equal (Keras averages each worker's loss over its own batch; the
    statistics are the global batch's whatever the sizes). Inference uses the moving statistics and
    communicates nothing.

    Takes BatchNormalization's arguments, except synchronized=True (that one is tf.distribute's own
    synchronisation). Every worker must call the layer in training mode at the same steps (each call is
    one collective); per-worker batch sizes may differ, and a worker's batch may be empty.

    Accuracy: each worker takes its moments as BatchNormalization does (the mean, then the squared
    distances to it), and the all-reduce sums count, count * mean and M2 + count * mean^2 in float64
    (Chan et al.'s parallel variance), so a mean large against the spread costs nothing: outputs,
    gradients and moving statistics are as close to an exact computation as BatchNormalization's own,
    from the first step. (E[x^2] - E[x]^2 in float32, which Keras's synchronized=True computes, as does
    Horovod's layer across workers, loses the spread to rounding: with mean 100 and spread 0.1, outputs
    off by up to 0.35 and gradients by 11% in tests/layers_worker.py.)
    Needs kungfu.init(); with one worker it equals BatchNormalization to float32 rounding.
    """

    def __init__(self, *args, synchronized=False, **kwargs):
        if synchronized:
            raise ValueError(
                "SyncBatchNormalization(synchronized=True): that flag synchronises through tf.distribute; "
                "SyncBatchNormalization synchronises over the KungFu workers already: leave it out")
        super().__init__(*args, **kwargs)
        self.supports_jit = False  # the all-reduce has no XLA kernel: model.compile's "auto" picks no XLA

    def _moments(self, inputs, mask):
        # inputs: float32 or float64 already (BatchNormalization.call casts half types up). Each worker's
        # own moments first, from the distances to its rounded mean (what BatchNormalization squares), so
        # that a large mean does not swamp the spread as in E[x^2] - E[x]^2; the mean of those distances
        # is the rounding left in that mean (its gradient carries the mean's, the shift's is stopped).
        axes = self._reduction_axes
        if mask is None:
            count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(inputs), axes)), inputs.dtype)
            shift = tf.stop_gradient(tf.math.divide_no_nan(tf.reduce_sum(inputs, axes, keepdims=True), count))
            distances = inputs - shift
            local_count = tf.fill(tf.shape(tf.reshape(shift, [-1])), count)
        else:
            keep = tf.broadcast_to(tf.expand_dims(tf.cast(mask, tf.bool), -1), tf.shape(inputs))
            count = tf.reduce_sum(tf.cast(keep, inputs.dtype), axes, keepdims=True)
            total = tf.reduce_sum(tf.where(keep, inputs, tf.zeros_like(inputs)), axes, keepdims=True)
            shift = tf.stop_gradient(tf.math.divide_no_nan(total, count))
            distances = tf.where(keep, inputs - shift, tf.zeros_like(inputs))
            local_count = tf.reshape(count, [-1])
        residual = tf.math.divide_no_nan(tf.reduce_sum(distances, axes), local_count)
        squares = tf.reduce_sum(tf.square(distances), axes)
        # Combined over the workers as sums (Chan et al.'s parallel formula, in one all-reduce): count,
        # count * mean and M2 + count * mean^2 per channel, M2 being the sum of squared distances to the
        # worker's mean. In float64, where the cancellation between the workers' means in the last sum
        # costs nothing a float32 result shows (relative error about 1e-16 (mean / spread)^2); the
        # products' gradients are large terms that cancel too, and they are summed in float64 as well.
        n, shift, residual, squares = (tf.cast(t, tf.float64) for t in (
            local_count, tf.reshape(shift, [-1]), residual, squares))
        mean = shift + residual
        m2 = squares - n * tf.square(residual)
        total = _sum_over_workers(tf.concat([n, n * mean, m2 + n * tf.square(mean)], 0))
        total_count, total_sum, total_squares = tf.split(total, 3)
        mean = tf.math.divide_no_nan(total_sum, total_count)
        variance = tf.maximum(tf.math.divide_no_nan(total_squares, total_count) - tf.square(mean), 0.0)
        return tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype)
