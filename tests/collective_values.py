"""Inputs and expected results shared by the collective checks (collectives_worker.py,
collectives_meeting_checks.py): every worker can compute every rank's input, so each checks exact values."""

import numpy as np
import tensorflow as tf

REDUCE_DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64]
COPY_DTYPES = REDUCE_DTYPES + [tf.uint8, tf.int8, tf.bool]
REDUCE_OPS = ["sum", "mean", "min", "max", "prod"]
BIG = 1000003
def data(rank, shape, dtype, op="sum", salt=0):
    """Rank rank's input: small integers, so every reduction is exact in every dtype."""
    n = int(np.prod(shape))
    i = np.arange(n, dtype=np.int64) + salt
    if op == "prod":
        v = np.array([1, -1, 2, -2, 1, 1, -1])[(i * 3 + rank) % 7]  # |product of 4| <= 16
    else:
        v = (i * 7 + rank * 3) % 11 - 5
    if dtype == tf.bool:
        return (v > 0).reshape(shape)
    if dtype == tf.uint8:
        v = v + 5
    return v.reshape(shape).astype(dtype.as_numpy_dtype)


def expected_reduce(shape, dtype, op, size, salt=0):
    xs = np.stack([data(r, shape, dtype, op, salt).astype(np.float64) for r in range(size)])
    np_dtype = dtype.as_numpy_dtype
    if op == "sum":
        return xs.sum(0).astype(np_dtype)
    if op == "prod":
        return xs.prod(0).astype(np_dtype)
    if op == "min":
        return xs.min(0).astype(np_dtype)
    if op == "max":
        return xs.max(0).astype(np_dtype)
    total = xs.sum(0)
    if dtype.is_integer:  # the engine truncates toward zero, as C++ does
        return (np.sign(total) * (np.abs(total) // size)).astype(np_dtype)
    if dtype == tf.float64:
        return total / size
    return (total.astype(np.float32) / np.float32(size)).astype(np_dtype)  # half types divide in float32


def assert_equal(got, want, what):
    got = got.numpy() if tf.is_tensor(got) else np.asarray(got)  # np.asarray fails on a bfloat16 scalar tensor
    want = np.asarray(want)
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {got.shape}, want {want.shape}")
    if got.dtype != want.dtype:
        raise AssertionError(f"{what}: dtype {got.dtype}, want {want.dtype}")
    g, w = got.astype(np.float64), want.astype(np.float64)
    bad = np.flatnonzero(g.ravel() != w.ravel())
    if bad.size:
        i = bad[0]
        raise AssertionError(f"{what}: {bad.size} elements differ, first at {i}: {g.ravel()[i]} != {w.ravel()[i]}")
