"""What the one-process op tests share (test_ops.py, test_ops_eager.py): the dtypes each collective takes
and a small tensor of any of them."""

import numpy as np
import tensorflow as tf

REDUCE_DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64]
COPY_ONLY_DTYPES = [tf.uint8, tf.int8, tf.bool]
REDUCE_OPS = ["sum", "mean", "min", "max", "prod"]


def sample(shape, dtype):
    n = int(np.prod(shape))
    values = (np.arange(n) % 7) - 3
    if dtype == tf.bool:
        return tf.constant(values.reshape(shape) > 0)
    if dtype == tf.uint8:
        values = values + 3
    return tf.constant(values.reshape(shape), dtype=dtype)

