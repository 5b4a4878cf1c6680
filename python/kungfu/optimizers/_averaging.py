"""Model averaging: the variable updates of synchronous model averaging (SMA) and of pair averaging.

SMA (KungFu's SynchronousAveragingOptimizer, after EA-SGD): every worker all-reduces its model and
moves it a fraction alpha toward the global average, v <- v + alpha * (mean(v) - v), then applies
its own gradients. Workers stay close without exchanging gradients; each learns from its own batch.

Pair averaging (AD-PSGD, Lian et al. 2018): every worker publishes its model in its local store
after each step (KfSaveVariable) and, before the next, fetches the latest model of one random peer
(KfRequestVariable) and averages with it, v <- (v + v_peer) / 2. The peer's engine answers from its
store; the peer's own training step takes no part, so no worker waits for another's step. A peer
that has published nothing yet (the first step, or just after a switch to this strategy) answers
"none", and the worker keeps its own model for that step. The model travels as one flat tensor per
dtype, so each step makes one request per dtype, not one per variable.
"""

import zlib

import tensorflow as tf

from .. import _lib
from .. import _variables
from . import _reduce


def sma_update(variables, alpha, fusion_bytes):
    """v <- v + alpha * (mean over workers of v - v) for every variable, all at once."""
    values = [tf.convert_to_tensor(v) for v in variables]  # Keras and tf Variables alike
    means = _reduce.mean_tensors(values, fusion_bytes)
    for v, x, m in zip(variables, values, means):
        v.assign(x + tf.cast(alpha, x.dtype) * (m - x))


def _by_dtype(variables):
    groups = {}
    for v in variables:
        groups.setdefault(tf.as_dtype(v.dtype).name, []).append(v)
    return sorted(groups.items())


def _flat(group):
    return tf.concat([tf.reshape(tf.convert_to_tensor(v), [-1]) for v in group], axis=0)


def model_key(variables):
    """The store name prefix of a model's copy for pair averaging, from its variables' dtypes and shapes,
    which every worker's copy of the same model shares. (Names would not do: Keras counts automatic
    names, "sgd_1" or "dense_2", per process, so they can differ between workers.)"""
    return f"kungfu/model/{zlib.crc32(_variables.layout(variables).encode()):08x}"


def store_name(prefix, dtype):
    return f"{prefix}/{dtype}"


def random_peer(step):
    """A peer other than this worker, drawn from (rank, step): different workers draw differently."""
    rank, size = _lib.rank(), _lib.size()
    seed = tf.stack([tf.constant(rank, tf.int64), tf.cast(step, tf.int64)])
    offset = tf.random.stateless_uniform([], seed=seed, minval=1, maxval=size, dtype=tf.int32)
    return (rank + offset) % size


def pair_average(variables, prefix, step):
    """v <- (v + the same variable in a random peer's store) / 2; unchanged if the peer has none yet."""
    from ..ops import p2p

    target = random_peer(step)
    for dtype, group in _by_dtype(variables):
        mine = _flat(group)
        theirs, _ = p2p.request_variable(target, mine, name=store_name(prefix, dtype))
        averaged = (mine + theirs) * tf.cast(0.5, mine.dtype)
        sizes = [v.shape.num_elements() for v in group]
        for v, part in zip(group, tf.split(averaged, sizes)):
            v.assign(tf.reshape(part, v.shape))


def publish(variables, prefix):
    """Saves this worker's model in its store, for its peers' pair averaging."""
    from ..ops import p2p

    for dtype, group in _by_dtype(variables):
        p2p.save_variable(_flat(group), name=store_name(prefix, dtype))
