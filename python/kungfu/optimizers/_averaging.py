"""Model averaging: the variable updates of synchronous model averaging (SMA) and of pair averaging.

SMA (KungFu's SynchronousAveragingOptimizer, after EA-SGD): every worker all-reduces its model and
moves it a fraction alpha toward the global average, v <- v + alpha * (mean(v) - v), then applies
its own gradients. Workers stay close without exchanging gradients; each learns from its own batch.

Pair averaging (AD-PSGD, Lian et al. 2018): every worker publishes its model in its local store
after each step (KfSaveVariable) and, before the next, fetches the latest model of one random peer
(KfRequestVariable) and averages with it, v <- (v + v_peer) / 2. The peer's engine answers from its
store; the peer's own training step takes no part, so no worker waits for another's step. The model
travels as one flat tensor per dtype, so each step makes one request per dtype, not one per variable.

Which copy is the right one. Each copy is stored under its model's store_prefix: the model's layout
(dtypes and shapes) and which wrapped optimizer over that layout this is in the process (0, 1, ...),
so two models of one architecture (an ensemble, a teacher and a student, a second run in one process)
never meet. Only the variables with gradients are exchanged (a frozen layer's, an unused head's are left
alone): a part of the model is stored under a prefix of its own (part_prefix), so what a worker requests
always has the size of what its peers published under that name. Each copy also ends with a tag, one more
element: how many pair averaging phases have begun (on entering pair averaging, and on a step over another
set of variables than the step before), the same on every worker since all switch at the same step
(whatever steps each took before).
A copy with another tag, left from an earlier phase before a switch away and back, counts as none. A peer that has
published nothing in this phase yet (the first step, or just after a switch to this strategy), or
that has left the cluster (it finished its steps first and finalized), answers none, and the worker
keeps its own model for that step.
"""

import collections
import threading
import zlib

import tensorflow as tf

from .. import _lib
from .. import _variables
from . import _reduce


def _wide(variables):
    """The variables' values, float16 ones as float32: the all-reduce sums before it divides, and a sum of
    float16 weights overflows where their mean would not (two workers' 33000 gave inf)."""
    values = [tf.convert_to_tensor(v) for v in variables]  # Keras and tf Variables alike
    return [tf.cast(x, tf.float32) if x.dtype == tf.float16 else x for x in values]


def sma_update(variables, alpha, fusion_bytes, layout=0):
    """v <- v + alpha * (mean over workers of v - v) for every variable, all at once. layout: the
    variables' _reduce.present_layout() among the optimizer's (checked in the all-reduce)."""
    values = _wide(variables)
    means = _reduce.mean_tensors(values, fusion_bytes, layout)
    for v, x, m in zip(variables, values, means):
        v.assign(tf.cast(x + tf.cast(alpha, x.dtype) * (m - x), v.dtype))


def _by_dtype(variables):
    groups = {}
    for v in variables:
        groups.setdefault(tf.as_dtype(v.dtype).name, []).append(v)
    return sorted(groups.items())


def _flat(group):
    return tf.concat([tf.reshape(tf.convert_to_tensor(v), [-1]) for v in group], axis=0)


_lock = threading.Lock()
_instances = collections.Counter()  # layout key -> wrapped optimizers given a prefix for it so far


def model_key(variables):
    """A model's layout as a short key: its variables' dtypes and shapes, which every worker's copy of
    the same model shares. (Names would not do: Keras counts automatic names, "sgd_1" or "dense_2", per
    process, so they can differ between workers.)"""
    return f"kungfu/model/{zlib.crc32(_variables.layout(variables).encode()):08x}"


def new_store_prefix(variables):
    """The store name prefix of one wrapped optimizer's copies: model_key plus how many optimizers over
    the same layout this process gave a prefix before, the same count on every worker running the same
    program."""
    key = model_key(variables)
    with _lock:
        n = _instances[key]
        _instances[key] += 1
    return f"{key}/{n}"


def part_prefix(prefix, indices, count):
    """The store prefix of the copies of a part of a model: the model's prefix, and for a part (the variables
    at `indices` in the optimizer's list of `count`, in the order exchanged) a key of those positions, which
    every worker shares. Two parts of one layout (two alike layers, either frozen) never meet."""
    if list(indices) == list(range(count)):
        return prefix
    return f"{prefix}/part-{zlib.crc32(','.join(map(str, indices)).encode()):08x}"


def store_name(prefix, dtype):
    return f"{prefix}/{dtype}"


# The tag is stored in the model's own dtype, which holds integers exactly up to these.
_TAG_MODULUS = {tf.float16: 2048, tf.bfloat16: 256}


def _tagged(group, dtype, phase):
    flat = _flat(group)
    tag = tf.cast(tf.math.floormod(tf.cast(phase, tf.int64), _TAG_MODULUS.get(flat.dtype, 1 << 24)), flat.dtype)
    return tf.concat([flat, tf.reshape(tag, [1])], axis=0)


def random_peer(step):
    """A peer other than this worker, drawn from (rank, step): different workers draw differently."""
    rank, size = _lib.rank(), _lib.size()
    seed = tf.stack([tf.constant(rank, tf.int64), tf.cast(step, tf.int64)])
    offset = tf.random.stateless_uniform([], seed=seed, minval=1, maxval=size, dtype=tf.int32)
    return (rank + offset) % size


def pair_average(variables, prefix, step, phase):
    """v <- (v + the same variable in a random peer's store) / 2; unchanged if the peer has no copy of
    this phase (the step at which it began) yet."""
    from ..ops import p2p

    target = random_peer(step)
    for dtype, group in _by_dtype(variables):
        mine = _tagged(group, dtype, phase)
        # A peer that has left (it finished first and its finalize stopped waiting) answers none.
        theirs, _ = p2p.request_variable(target, mine, name=store_name(prefix, dtype), departed_ok=True)
        same_phase = tf.equal(theirs[-1], mine[-1])  # no copy at all: theirs is mine, and so is the tag
        half = tf.cast(0.5, mine.dtype)  # halved before the sum, which in float16 overflows from 32768
        averaged = tf.where(same_phase, mine[:-1] * half + theirs[:-1] * half, mine[:-1])
        sizes = [v.shape.num_elements() for v in group]
        for v, part in zip(group, tf.split(averaged, sizes)):
            v.assign(tf.reshape(part, v.shape))


def publish(variables, prefix, phase):
    """Saves this worker's model, tagged with its phase, in its store, for its peers' pair averaging."""
    from ..ops import p2p

    for dtype, group in _by_dtype(variables):
        p2p.save_variable(_tagged(group, dtype, phase), name=store_name(prefix, dtype))


def average_variables(variables, fusion_bytes):
    """v <- mean over workers of v, all at once: the same bits on every worker."""
    for v, m in zip(variables, _reduce.mean_tensors(_wide(variables), fusion_bytes)):
        v.assign(tf.cast(m, v.dtype))
