"""The extension point of kungfu.rewrite: a pass replaces gradient tensors with new tensors built from them.

A pass is a function `pass_(grads, ctx) -> grads`:
  - grads: one Gradient per updated trainable variable, in the order the backward pass produces them
    (the last layer's first), as tensors of the rewritten function's graph;
  - it runs while that function is traced, between the backward pass and the updates, so it builds new
    ops with ordinary TensorFlow and kungfu calls (kungfu.group_all_reduce, a monitor op, tf.print ...);
  - it returns the list of Gradients the updates and everything after the backward pass should use
    instead (grad.replace(values=...)), in the same order. Returning a Gradient unchanged leaves that
    gradient alone; an op a pass builds but does not feed into a returned tensor still runs if it is
    stateful (a collective, a monitor that writes a variable), as everything stateful in a tf.function does.
Passes run one after another, each on what the previous returned: a monitor placed after the S-SGD pass
sees the reduced gradients, and one placed before it the local ones; one that needs both (e.g. a
gradient-noise-scale estimate) wraps the reduction: it calls the S-SGD pass itself and builds its op from
the grads it got and the ones it returns.

Collectives a pass inserts need keys that agree across workers: ctx.key(...) makes one from the
function's name, and ctx.note(...) records each for the rewrite's report (Rewritten.report()).
"""

import dataclasses

import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class Gradient:
    """One trainable variable's gradient, as tensors of the graph being rewritten."""

    name: str  # the variable's name, e.g. 'sequential/dense/kernel'
    variable: tf.Variable  # the variable it updates
    values: tf.Tensor  # the dense gradient, or the values of an IndexedSlices (first dim: one row per index)
    indices: tf.Tensor | None = None  # the IndexedSlices' indices; None for a dense gradient

    @property
    def sparse(self):
        return self.indices is not None

    def replace(self, **changes):
        """This gradient with some tensors replaced: grad.replace(values=v) or (values=v, indices=i)."""
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class Inserted:
    """A collective a pass inserted, for the report."""

    op: str  # the kungfu call, e.g. 'group_all_reduce'
    key: str  # its key across workers
    variables: tuple  # names of the variables whose gradients it carries


@dataclasses.dataclass
class PassContext:
    """What a pass knows about the rewrite it runs in."""

    function: str  # the rewritten function's name, e.g. 'train_step'
    size: int  # kungfu.size() when the function was rewritten (the rewrite is redone when it changes)
    options: dict  # the keyword arguments of kungfu.rewrite, e.g. {'fusion_bytes': None}
    inserted: list = dataclasses.field(default_factory=list)  # of Inserted, in the order passes noted them

    def key(self, *parts):
        """A collective key that agrees across workers: 'kungfu.rewrite/<function>/<parts...>'."""
        return "/".join(["kungfu.rewrite", self.function, *parts])

    def note(self, op, key, grads):
        """Records a collective the pass inserted for the gradients grads."""
        self.inserted.append(Inserted(op=op, key=key, variables=tuple(g.name for g in grads)))


def run_passes(passes, grads, ctx):
    """Applies each pass in turn, checking that each returns one Gradient of each kind per input."""
    for pass_ in passes:
        out = pass_(list(grads), ctx)
        what = getattr(pass_, "__name__", repr(pass_))
        if not isinstance(out, (list, tuple)) or len(out) != len(grads):
            got = f"{type(out).__name__}" + (f" of {len(out)}" if isinstance(out, (list, tuple)) else "")
            raise ValueError(f"kungfu.rewrite: pass {what} must return a list of {len(grads)} Gradients, got {got}")
        for old, new in zip(grads, out):
            _check_replacement(what, old, new)
        grads = list(out)
    return grads


def _check_replacement(what, old, new):
    if not isinstance(new, Gradient) or new.name != old.name:
        raise ValueError(f"kungfu.rewrite: pass {what} must return the Gradients it got, in order, each "
                         f"possibly .replace()d; got {new!r} where {old.name}'s was")
    if new.sparse != old.sparse or new.values.dtype != old.values.dtype:
        raise ValueError(f"kungfu.rewrite: pass {what} changed the kind or dtype of {old.name}'s gradient")
    if not old.sparse and not new.values.shape.is_compatible_with(old.values.shape):
        raise ValueError(f"kungfu.rewrite: pass {what} changed the shape of {old.name}'s gradient from "
                         f"{old.values.shape} to {new.values.shape}")
