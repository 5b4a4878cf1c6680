"""The strategies' names and indices: what opt.set_strategy takes, in Python and in the graph.

The names and the Python-side rule (a name, or an integer index) are kungfu.policies.context's, so that
opt.set_strategy and a policy's ctx.set_strategy take the same values. In a tf.function the strategy may
also be a tensor: a tf.string name or an integer index, checked when the step runs.
"""

import tensorflow as tf

from ..policies.context import STRATEGIES
from ..policies.context import strategy_name

CHOICES = f"one of {', '.join(STRATEGIES)} (or its index, 0 to {len(STRATEGIES) - 1})"


def strategy_index(strategy, who="set_strategy"):
    """The index in STRATEGIES of a strategy given by name or index; ValueError, naming who, otherwise."""
    return STRATEGIES.index(strategy_name(strategy, who))


def strategy_index_tensor(strategy):
    """strategy_index for a scalar tensor: an int32 tensor, with an assertion that fails the step
    (InvalidArgumentError naming the choices) for a name or an index of no strategy."""
    strategy = tf.convert_to_tensor(strategy)
    if strategy.shape.rank not in (0, None):
        raise ValueError(f"set_strategy: a strategy tensor must be a scalar, got shape {strategy.shape}")
    strategy = tf.reshape(strategy, [])  # an unknown rank is checked when the step runs
    if strategy.dtype == tf.string:
        matches = tf.equal(tf.constant(STRATEGIES), strategy)
        check = tf.debugging.Assert(tf.reduce_any(matches), ["unknown strategy", strategy, "; choose " + CHOICES])
        with tf.control_dependencies([check]):
            return tf.argmax(tf.cast(matches, tf.int32), output_type=tf.int32)
    if not strategy.dtype.is_integer:
        raise TypeError(f"set_strategy: a strategy tensor must be a tf.string name or an integer index, "
                        f"got {strategy.dtype.name}")
    return checked_index(tf.cast(strategy, tf.int32), "unknown strategy index")


def checked_index(index, what):
    """index (an int32 scalar tensor), after an assertion that it is a strategy's index: tf.switch_case
    would run its last branch for one out of range."""
    check = tf.debugging.Assert(tf.logical_and(index >= 0, index < len(STRATEGIES)),
                                [what, index, "which is not the index of any strategy; choose " + CHOICES])
    with tf.control_dependencies([check]):
        return tf.identity(index)
