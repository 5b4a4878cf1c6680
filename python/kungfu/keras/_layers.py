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
    drift apart. This layer sums every worker's per-channel sum, sum of squares and count in one
    all-reduce, and normalises with the global mean and variance: what one process would compute on
    the concatenation of the workers' batches (as Horovod's hvd.SyncBatchNormalization). The moving
    mean and variance then stay equal on every worker. Gradients flow through the all-reduce, so with
    DistributedOptimizer's averaged gradients training equals one process on the global batch when the
    workers' batches are equal (Keras averages each worker's loss over its own batch; the statistics are
    the global batch's whatever the sizes). Inference
    uses the moving statistics and communicates nothing.

    Takes BatchNormalization's arguments, except synchronized=True (that one is tf.distribute's own
    synchronisation). Every worker must call the layer in training mode at the same steps (each call is
    one collective); per-worker batch sizes may differ, and a worker's batch may be empty. The variance
    is E[x^2] - E[x]^2 in float32 (float64 for float64 inputs), as Keras' synchronized=True computes it.
    Needs kungfu.init(); with one worker it equals BatchNormalization.
    """

    def __init__(self, *args, synchronized=False, **kwargs):
        if synchronized:
            raise ValueError(
                "SyncBatchNormalization(synchronized=True): that flag synchronises through tf.distribute; "
                "SyncBatchNormalization synchronises over the KungFu workers already: leave it out")
        super().__init__(*args, **kwargs)
        self.supports_jit = False  # the all-reduce has no XLA kernel: model.compile's "auto" picks no XLA

    def _moments(self, inputs, mask):
        # inputs: float32 or float64 already (BatchNormalization.call casts half types up).
        axes = self._reduction_axes
        if mask is None:
            count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(inputs), axes)), inputs.dtype)
            local_sum = tf.reduce_sum(inputs, axes)
            local_squares = tf.reduce_sum(tf.square(inputs), axes)
            local_count = tf.fill(tf.shape(local_sum), count)
        else:
            weights = tf.cast(tf.broadcast_to(tf.expand_dims(mask, -1), tf.shape(inputs)), inputs.dtype)
            local_sum = tf.reduce_sum(inputs * weights, axes)
            local_squares = tf.reduce_sum(tf.square(inputs) * weights, axes)
            local_count = tf.reduce_sum(weights, axes)
        total = _sum_over_workers(tf.concat([local_sum, local_squares, local_count], 0))
        total_sum, total_squares, total_count = tf.split(total, 3)
        mean = tf.math.divide_no_nan(total_sum, total_count)
        variance = tf.maximum(tf.math.divide_no_nan(total_squares, total_count) - tf.square(mean), 0.0)
        return mean, variance
