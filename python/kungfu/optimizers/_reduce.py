"""Averaging gradients over the workers: the S-SGD step, shared by the optimizer wrappers and
DistributedGradientTape.

Dense gradients are all-reduced (mean). They are split into buckets of about fusion_bytes, walking
the list from the end, because backprop produces the last layer's gradients first: each bucket is
one KfGroupAllReduce op with its own ordering token, so it starts as soon as its own gradients
exist, while backprop of earlier layers goes on, and the buckets are in flight together. Inside
an op, tensors smaller than fusion_bytes are packed into one network collective.

A tf.IndexedSlices gradient (an embedding lookup's) is not densified: its indices and values are
all-gathered (the first dimension differs between workers) and the values divided by the number of
workers. Rows that several workers touch appear more than once, as in one process's gradient of the
combined batch: SGD and momentum add the duplicates (ResourceScatterAdd/Sub), so for them it is the dense
mean; optimizers with per-row state (Adam, RMSprop, Adagrad) update a row given as duplicates differently
from the row summed (docs/training.md, "Sparse"). sparse_as_dense=True densifies instead, so the optimizer
sees the dense mean (cheaper, too, when most rows are touched anyway).
"""

import logging
import threading
import zlib

import tensorflow as tf

from .. import _lib
from ..ops import _compression
from ..ops import collective

_log = logging.getLogger("kungfu.optimizers")  # standard logging: absl's would configure the root logger

DEFAULT_FUSION_BYTES = 4 << 20  # bucket size; the ops' own packing threshold has the same default

_logged = set()  # variable names whose reduction was logged: once per variable per process
_logged_lock = threading.Lock()


def _var_name(var):
    return getattr(var, "path", None) or getattr(var, "name", None) or "?"


def _log_choices(choices):
    """Logs, on rank 0, how each variable's gradient travels: one line per kind, once per variable."""
    with _logged_lock:
        new = [(name, how) for name, how in choices if name not in _logged]
        _logged.update(name for name, _ in new)
    if not new or _lib.rank() != 0:
        return
    by_how = {}
    for name, how in new:
        by_how.setdefault(how, []).append(name)
    for how, names in by_how.items():
        _log.info("kungfu: %d gradient(s) %s: %s", len(names), how, ", ".join(names))


def check_fusion_bytes(fusion_bytes):
    if fusion_bytes is None:
        return DEFAULT_FUSION_BYTES
    if isinstance(fusion_bytes, bool) or not isinstance(fusion_bytes, int) or fusion_bytes < 0:
        raise ValueError(f"fusion_bytes must be an int >= 0 (0: one collective per gradient), got {fusion_bytes!r}")
    return fusion_bytes


def _nbytes(t):
    n = t.shape.num_elements()
    return (n if n is not None else 1 << 30) * t.dtype.size


def buckets(tensors, fusion_bytes):
    """Index lists, in backprop order (from the end of tensors), each about fusion_bytes of data."""
    groups, current, size = [], [], 0
    for i in reversed(range(len(tensors))):
        nbytes = _nbytes(tensors[i])
        if current and size + nbytes > fusion_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
    if current:
        groups.append(current)
    return groups


def present_layout(present, count):
    """Which of count gradients are present (not None; present: their indices) as the group ops' layout
    check (kungfu.ops.collective._layout_extra): 0 when all are. Workers whose gradients are None for
    different variables of the same shapes (a multi-task model whose batch on each worker had labels for
    another task) would otherwise average one variable's gradient with another's, silently; with it they
    fail with InvalidArgument, as when a gradient is None on some workers only."""
    present = list(present)
    if len(present) == count:
        return 0
    return zlib.crc32(f"{count}:{','.join(map(str, present))}".encode()) | 1


def mean_indexed_slices(g):
    """The mean over workers of an IndexedSlices, as an IndexedSlices of every worker's rows."""
    values = collective.all_gather(g.values)
    indices = collective.all_gather(g.indices)
    values = values / tf.cast(_lib.size(), values.dtype)
    return tf.IndexedSlices(values, indices, g.dense_shape)


def _reducible(g):
    if g.dtype not in collective.REDUCE_DTYPES:
        raise TypeError(f"kungfu: cannot average a gradient of dtype {g.dtype.name}; "
                        f"supported: {', '.join(d.name for d in collective.REDUCE_DTYPES)}")
    return g


def mean_gradients(grads, variables=None, fusion_bytes=None, sparse_as_dense=False, extra=(), compression="none",
                   layout=None):
    """The mean of each gradient over all workers; None stays None. variables (optional, same length)
    only name the gradients in the one-time log line of how each is reduced. compression: "fp16" sends
    the dense float gradients as float16 (kungfu/ops/_compression.py). layout: present_layout() of the
    caller's whole list, when grads holds only the present ones; by default that of grads' Nones. It is
    checked in the dense gradients' collectives (sparse ones alone, all-gathered, are not checked).

    extra: more dense tensors (e.g. a monitor's scalar) averaged in the same collectives as the dense
    gradients, so they cost no collective of their own; their means follow the gradients in the
    result. They go into the bucket of the first gradients (sent last), which waits for all of
    backprop anyway, so a value computed from every gradient delays no bucket."""
    fusion_bytes = check_fusion_bytes(fusion_bytes)
    variables = variables if variables is not None else [None] * len(grads)
    if layout is None:
        layout = present_layout((i for i, g in enumerate(grads) if g is not None), len(grads))
    out = list(grads)
    dense = []  # indices into grads
    choices = []  # (variable name, how its gradient travels)
    for i, (g, v) in enumerate(zip(grads, variables)):
        if g is None:
            continue
        if isinstance(g, tf.IndexedSlices):
            if sparse_as_dense:
                out[i] = _reducible(tf.convert_to_tensor(g))
                dense.append(i)
                choices.append((_var_name(v), "sparse, densified and all-reduced (sparse_as_dense=True)"))
            else:
                _reducible(g.values)
                out[i] = mean_indexed_slices(g)
                choices.append((_var_name(v), "sparse (IndexedSlices), all-gather of indices and values"))
        else:
            out[i] = _reducible(tf.convert_to_tensor(g))
            dense.append(i)
            choices.append((_var_name(v), "dense, all-reduce"))
    _log_choices(choices)
    extra = [tf.convert_to_tensor(t) for t in extra]
    originals = [out[i] for i in dense]
    reduced = mean_tensors(extra + _compression.compress(originals, compression), fusion_bytes, layout)
    for i, r in zip(dense, _compression.decompress(reduced[len(extra):], originals)):
        out[i] = r
    return out + reduced[:len(extra)]


def norms_fusable(grads, sparse_as_dense):
    """Whether mean_gradients_with_norms takes these gradients: every one dense (or densified) and of a
    float dtype."""
    for g in grads:
        if g is None:
            continue
        if isinstance(g, tf.IndexedSlices) and not sparse_as_dense:
            return False
        if g.dtype not in collective.NORM_DTYPES:
            return False
    return True


def mean_gradients_with_norms(grads, variables, fusion_bytes, sparse_as_dense, norms, compression="none", layout=None):
    """(mean_gradients(grads), mean over the workers of their local squared norm, squared norm of the
    mean), for gradients norms_fusable() accepts. The norms come out of the all-reduce itself
    (KfGroupAllReduceNorms sums the squares as it packs and unpacks its buckets), with no pass over the
    gradients of their own; norms (a bool scalar tensor, equal on every worker) false gives 0s. With
    compression="fp16" the norms are those of the float16 gradients sent. layout: as mean_gradients'."""
    fusion_bytes = check_fusion_bytes(fusion_bytes)
    variables = variables if variables is not None else [None] * len(grads)
    if layout is None:
        layout = present_layout((i for i, g in enumerate(grads) if g is not None), len(grads))
    out, dense, choices = list(grads), [], []
    for i, (g, v) in enumerate(zip(grads, variables)):
        if g is None:
            continue
        out[i] = _reducible(tf.convert_to_tensor(g))
        dense.append(i)
        choices.append((_var_name(v), "dense, all-reduce" if not isinstance(g, tf.IndexedSlices) else
                        "sparse, densified and all-reduced (sparse_as_dense=True)"))
    _log_choices(choices)
    originals = [out[i] for i in dense]
    tensors = _compression.compress(originals, compression)
    local, reduced = [], []
    for bucket in buckets(tensors, fusion_bytes):
        means, local_sq, reduced_sq = collective.group_all_reduce_with_norms(
            [tensors[j] for j in bucket], norms=norms, op="mean", fusion_bytes=fusion_bytes, _layout=layout)
        for j, r in zip(bucket, _compression.decompress(means, [originals[j] for j in bucket])):
            out[dense[j]] = r
        local.append(local_sq)
        reduced.append(reduced_sq)
    zero = tf.constant(0.0, tf.float32)
    return out, tf.add_n(local) if local else zero, tf.add_n(reduced) if reduced else zero


def mean_tensors(tensors, fusion_bytes=None, layout=0):
    """The mean of each dense tensor over all workers, in buckets of about fusion_bytes (see above);
    layout: present_layout() of the variables they stand for (0: all)."""
    fusion_bytes = check_fusion_bytes(fusion_bytes)
    out = list(tensors)
    for bucket in buckets(tensors, fusion_bytes):
        reduced = collective.group_all_reduce([tensors[j] for j in bucket], op="mean", fusion_bytes=fusion_bytes,
                                              _layout=layout)
        for j, r in zip(bucket, reduced):
            out[j] = r
    return out
