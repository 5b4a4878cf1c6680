"""DistributedGradientTape: a tf.GradientTape whose gradient() averages over the workers (S-SGD).

    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    tape = kungfu.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)   # the mean over every worker
    optimizer.apply_gradients(zip(grads, model.trainable_variables))

Dense gradients are all-reduced in buckets, sparse ones (IndexedSlices) all-gathered; see
kungfu/optimizers/_reduce.py. Every other method is tf.GradientTape's, on the wrapped tape's state;
jacobian() and batch_jacobian(), which TensorFlow computes by calling self.gradient() once per row,
run on a plain tf.GradientTape view of that state, so that they stay local as documented.
"""

import weakref

import tensorflow as tf

from . import _lib
from .ops import _compression
from .optimizers import _reduce

_settings = weakref.WeakKeyDictionary()  # DistributedGradientTape -> (fusion_bytes, sparse_as_dense, compression)


class DistributedGradientTape(tf.GradientTape):
    """Wraps tape; gradient() returns the mean of every worker's gradients.

    It is a tf.GradientTape, sharing the wrapped tape's state (its recording, watched variables and
    persistence), as Horovod's is: isinstance checks, watch(), stop_recording(), reset() and the rest
    are the tape's own; jacobian() and batch_jacobian() too, and they stay local (not averaged). Wrap a
    tape before or after its `with` block.

    fusion_bytes: gradient bucket size (default 4 MiB; 0: one collective per gradient).
    sparse_as_dense: all-reduce IndexedSlices gradients as dense tensors instead of all-gathering them.
    compression: None or "fp16", which sends dense float32/float64 gradients as float16 (half the bytes;
    see kungfu/ops/_compression.py).
    """

    def __init__(self, tape, fusion_bytes=None, sparse_as_dense=False, compression=None):
        # No super().__init__(): the state is the wrapped tape's, taken over below.
        if not isinstance(tape, tf.GradientTape):
            raise TypeError(f"DistributedGradientTape wraps a tf.GradientTape, got {type(tape).__name__}")
        if isinstance(tape, DistributedGradientTape):
            raise ValueError("this tape is already a kungfu.DistributedGradientTape; wrap the plain tape once")
        settings = (_reduce.check_fusion_bytes(fusion_bytes), bool(sparse_as_dense),
                    _compression.check(compression, "DistributedGradientTape"))
        self.__dict__ = tape.__dict__  # one tape state, whichever object records or computes with it
        _settings[self] = settings  # not in the shared state: two wrappers of one tape keep their own

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        _lib.require_init("DistributedGradientTape.gradient")
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        if _lib.size() == 1:
            return grads
        fusion_bytes, sparse_as_dense, compression = _settings[self]
        flat_grads, flat_sources = tf.nest.flatten(grads), tf.nest.flatten(sources)
        reduced = _reduce.mean_gradients(flat_grads, flat_sources, fusion_bytes, sparse_as_dense,
                                         compression=compression)
        return tf.nest.pack_sequence_as(grads, reduced)

    def jacobian(self, *args, **kwargs):
        """tf.GradientTape.jacobian, local: not averaged over the workers (see the module doc)."""
        return _plain(self).jacobian(*args, **kwargs)

    def batch_jacobian(self, *args, **kwargs):
        """tf.GradientTape.batch_jacobian, local: not averaged over the workers (see the module doc)."""
        return _plain(self).batch_jacobian(*args, **kwargs)


def _plain(tape):
    """A tf.GradientTape sharing tape's state, whose gradient() is the plain one."""
    view = tf.GradientTape.__new__(tf.GradientTape)
    view.__dict__ = tape.__dict__
    return view
