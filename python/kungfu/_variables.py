"""broadcast_variables: make every worker's variables equal to one worker's."""

import tensorflow as tf

from . import _lib


class _DefaultRoot(int):
    """The rank 0 of a root= left out, told apart from a 0 the caller passed (root_rank= may then name
    another rank). It is 0 in every other way, and shows as 0 in signatures."""

    def __repr__(self):
        return "0"


DEFAULT_ROOT = _DefaultRoot(0)


def root_alias(root, root_rank, what):
    """The root rank from root= or root_rank= (Horovod's spelling of it); ValueError when both are given and
    name different ranks. root's default must be DEFAULT_ROOT."""
    if root_rank is None:
        return 0 if root is DEFAULT_ROOT else root
    if root is not DEFAULT_ROOT and root != root_rank:
        raise ValueError(f"{what}: root={root!r} and root_rank={root_rank!r} (Horovod's spelling of root=) name "
                         "different ranks; give one of them")
    return root_rank


def broadcast_variables(variables, root=DEFAULT_ROOT, name=None, *, root_rank=None):
    """Assigns root's value of every variable (tf.Variable or Keras Variable) on every worker.
    root_rank= is Horovod's spelling of root= (hvd.broadcast_variables(variables, root_rank=0)).

    One broadcast per dtype, of the variables' values concatenated, so that a model of many small
    variables costs a few network round trips, not one per variable. Every worker must pass the same
    variables in the same order (shapes and dtypes are checked across workers). Works eagerly and in
    tf.function. When the workers' variables differ in dtype, shape or order, nothing is assigned and it
    raises ValueError (inside a tf.function, tf.errors.InvalidArgumentError when the step runs).
    """
    from .ops import collective

    root = root_alias(root, root_rank, "kungfu.broadcast_variables")
    _lib.require_init("kungfu.broadcast_variables")
    variables = list(variables)
    for i, v in enumerate(variables):  # before any collective, which the other workers would wait in
        if not callable(getattr(v, "assign", None)):
            raise TypeError(f"kungfu.broadcast_variables: item {i} is a {type(v).__name__}, not a variable "
                            "(tf.Variable or keras.Variable); only variables can be assigned root's value")
    checked = _check_same_variables(collective, variables, name)
    with tf.control_dependencies([checked] if checked is not None else []):  # in a graph: no broadcast first
        _broadcast(collective, variables, root, name)


def _broadcast(collective, variables, root, name):
    groups = {}
    for v in variables:
        groups.setdefault(tf.as_dtype(v.dtype), []).append(v)
    for dtype, group in sorted(groups.items(), key=lambda kv: kv[0].name):
        flat = tf.concat([tf.reshape(tf.convert_to_tensor(v), [-1]) for v in group], axis=0)
        key = None if name is None else f"{name}/{dtype.name}"
        flat = collective.broadcast(flat, root=root, name=key)
        parts = tf.split(flat, [int(v.shape.num_elements()) for v in group])
        for v, part in zip(group, parts):
            v.assign(tf.reshape(part, v.shape))


def layout(variables):
    """The variables' dtypes and shapes, in order, as text: what every worker's copy of a model shares."""
    return ";".join(f"{tf.as_dtype(v.dtype).name}{list(v.shape)}" for v in variables)


def _check_same_variables(collective, variables, name):
    # The broadcast itself checks only the concatenated length; this catches models whose variables
    # differ in shape or order but not in total size.
    key = None if name is None else f"{name}/layout"
    same = collective.consensus(tf.constant(list(layout(variables).encode()), tf.uint8), name=key)
    message = ("kungfu.broadcast_variables: the workers passed different variables (their dtypes and shapes, "
               "in order, differ); every worker must pass the same model's variables in the same order")
    if tf.executing_eagerly():
        if not bool(same):
            raise ValueError(message)
        return None
    return tf.debugging.Assert(same, [message])
