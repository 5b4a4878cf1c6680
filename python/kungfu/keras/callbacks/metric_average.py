"""MetricAverageCallback: epoch logs hold the mean over every worker, not this worker's own values."""

import keras
import numpy as np
import tensorflow as tf

from ... import _lib


class MetricAverageCallback(keras.callbacks.Callback):
    """At each epoch's end, replaces every numeric value in logs (loss, metrics, val_*) by its mean
    over the workers, so the progress bar, History and later callbacks see cluster-wide values.
    Scalars stay Python floats; a metric that logs an array (e.g. F1Score(average=None), one value
    per class) is averaged element by element and stays an array of its shape.

    Put it before callbacks that read the epoch's logs (ModelCheckpoint, EarlyStopping, ...): Keras
    calls callbacks in list order, and appends its own progress bar and History last. Every worker
    must log the same keys with the same shapes (for instance all or none run validation); a
    mismatch raises ValueError on every worker.
    """

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        from ...ops import collective

        _lib.require_init("MetricAverageCallback")
        values = {k: a for k, a in ((k, _numeric(v)) for k, v in logs.items()) if a is not None}
        keys = sorted(values)
        if _lib.size() == 1 or not keys:
            return
        layout = "\n".join(f"{k} {values[k].shape}" for k in keys)
        names = tf.constant(list(layout.encode()), tf.uint8)
        if not bool(collective.consensus(names, name="kungfu/metric_average/keys")):
            raise ValueError(f"MetricAverageCallback: the workers logged different metrics or shapes at epoch "
                             f"{epoch} (this worker: {', '.join(f'{k} {values[k].shape}' for k in keys)}); every "
                             "worker must log the same keys")
        flat = tf.constant(np.concatenate([values[k].ravel() for k in keys]), tf.float64)
        means = collective.all_reduce(flat, op="mean", name="kungfu/metric_average/values").numpy()
        at = 0
        for k in keys:
            a = values[k]
            mean = means[at:at + a.size]
            at += a.size
            # Scalars (and one-element arrays, as before) become floats; arrays keep shape and float dtype.
            logs[k] = float(mean[0]) if a.size == 1 else mean.reshape(a.shape).astype(_float_dtype(logs[k]))


def _numeric(v):
    """v as a float64 array if it is a number or a numeric array or tensor, else None."""
    if isinstance(v, (int, float, np.number)):
        return np.asarray(v, np.float64)
    if isinstance(v, (tf.Tensor, np.ndarray)) or hasattr(v, "numpy"):
        a = np.asarray(v.numpy() if hasattr(v, "numpy") else v)
        if a.dtype.kind in "biuf" and a.size > 0:
            return a.astype(np.float64)
    return None


def _float_dtype(v):
    dtype = np.asarray(v.numpy() if hasattr(v, "numpy") else v).dtype
    return dtype if dtype.kind == "f" else np.float64
