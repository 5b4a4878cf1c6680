"""DistributedGradientTape: a tf.GradientTape whose gradient() averages over the workers (S-SGD).

    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    tape = kungfu.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)   # the mean over every worker
    optimizer.apply_gradients(zip(grads, model.trainable_variables))

Dense gradients are all-reduced in buckets, sparse ones (IndexedSlices) all-gathered; see
kungfu/optimizers/_reduce.py. Every other method and attribute is the wrapped tape's.
"""

import tensorflow as tf

from . import _lib
from .ops import _compression
from .optimizers import _reduce


class DistributedGradientTape:
    """Wraps tape; gradient() returns the mean of every worker's gradients.

    fusion_bytes: gradient bucket size (default 4 MiB; 0: one collective per gradient).
    sparse_as_dense: all-reduce IndexedSlices gradients as dense tensors instead of all-gathering them.
    compression: None or "fp16", which sends dense float32/float64 gradients as float16 (half the bytes;
    see kungfu/ops/_compression.py).
    """

    def __init__(self, tape, fusion_bytes=None, sparse_as_dense=False, compression=None):
        if not isinstance(tape, tf.GradientTape):
            raise TypeError(f"DistributedGradientTape wraps a tf.GradientTape, got {type(tape).__name__}")
        self._tape = tape
        self._fusion_bytes = _reduce.check_fusion_bytes(fusion_bytes)
        self._sparse_as_dense = bool(sparse_as_dense)
        self._compression = _compression.check(compression, "DistributedGradientTape")

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        _lib.require_init("DistributedGradientTape.gradient")
        grads = self._tape.gradient(target, sources, output_gradients, unconnected_gradients)
        if _lib.size() == 1:
            return grads
        flat_grads, flat_sources = tf.nest.flatten(grads), tf.nest.flatten(sources)
        reduced = _reduce.mean_gradients(flat_grads, flat_sources, self._fusion_bytes, self._sparse_as_dense,
                                         compression=self._compression)
        return tf.nest.pack_sequence_as(grads, reduced)

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)

    def __getattr__(self, name):  # watch, stop_recording, reset, jacobian, ...
        return getattr(self._tape, name)
