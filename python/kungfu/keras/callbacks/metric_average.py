"""MetricAverageCallback: epoch logs hold the mean over every worker, not this worker's own values."""

import keras
import numpy as np
import tensorflow as tf

from ... import _lib


class MetricAverageCallback(keras.callbacks.Callback):
    """At each epoch's end, replaces every numeric value in logs (loss, metrics, val_*) by its mean
    over the workers, so the progress bar, History and later callbacks see cluster-wide values.

    Put it before callbacks that read the epoch's logs (ModelCheckpoint, EarlyStopping, ...): Keras
    calls callbacks in list order, and appends its own progress bar and History last. Every worker
    must log the same keys (for instance all or none run validation); a mismatch raises ValueError.
    """

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        from ...ops import collective

        _lib.require_init("MetricAverageCallback")
        keys = sorted(k for k, v in logs.items() if isinstance(v, (int, float, np.number)) or _scalar(v))
        if _lib.size() == 1 or not keys:
            return
        names = tf.constant(list("\n".join(keys).encode()), tf.uint8)
        if not bool(collective.consensus(names, name="kungfu/metric_average/keys")):
            raise ValueError(f"MetricAverageCallback: the workers logged different metrics at epoch {epoch} "
                             f"(this worker: {', '.join(keys)}); every worker must log the same keys")
        values = tf.constant([float(logs[k]) for k in keys], tf.float64)
        means = collective.all_reduce(values, op="mean", name="kungfu/metric_average/values").numpy()
        for k, m in zip(keys, means):
            logs[k] = float(m)


def _scalar(v):
    return (isinstance(v, (tf.Tensor, np.ndarray)) or hasattr(v, "numpy")) and np.size(v) == 1
