"""Re-importing a traced graph into a new tf.function, with the passes' ops between its two parts.

The new function has the original's Python signature, so TensorFlow hands it the same argument
placeholders in the same order. While it is traced (core.py), rebuild():
  1. binds the original's argument placeholders to its own, and each captured tensor (a variable's
     handle, mostly) to the same tensor captured again: the imported ops update the same variables;
  2. imports the first part (forward and backward pass, graphdef.split) and takes the gradient tensors;
  3. runs the passes on them (passes.py), which build their ops in this graph;
  4. imports the second part (updates, outputs) with each gradient tensor bound to the passes' result;
  5. returns the original's outputs, in the original's structure.
Everything is created after its inputs, so TensorFlow's automatic control dependencies, which order
stateful ops by creation, add no edge against the data flow.
"""

import dataclasses

import tensorflow as tf

from . import _conventions as conv
from . import graphdef
from . import passes as passes_lib


@dataclasses.dataclass
class Plan:
    """Everything the body needs, worked out once per concrete function."""

    cf: object  # the original ConcreteFunction
    sites: list  # find.GradientSite, in backward-pass order
    split: graphdef.Split
    arg_names: list  # names of the original's argument placeholder tensors
    arg_dtypes: list  # and their dtypes
    captures: dict  # name of a capture placeholder tensor -> the tensor captured
    first_returns: list  # tensors of the first part the body needs, by name


def plan(cf, sites, what="kungfu.rewrite"):
    """A Plan for rebuilding cf with its gradient tensors (sites) replaceable; what names the step in errors."""
    arg_phs, capture_phs = conv.split_inputs(cf)
    removed = {t.op.name for t in arg_phs + capture_phs}
    graph = cf.graph
    roots = {t.split(":")[0] for s in sites for t in (s.values, s.indices) if t}
    graph_def = graph.as_graph_def()
    cut = graphdef.split(graph_def, roots, removed,
                         has_outputs=lambda name: bool(graph.get_operation_by_name(name).outputs))
    _check_updates_after_cut(what, sites, cut, graph_def)
    removed_tensors = {t.name for t in arg_phs + capture_phs}
    needed = set(cut.second_links.values()) | {t for s in sites for t in (s.values, s.indices) if t}
    needed |= {t.name for t in cf.outputs}
    first_nodes = {n.name for n in cut.first.node}
    first_returns = sorted(t for t in needed if t not in removed_tensors and t.split(":")[0] in first_nodes)
    return Plan(cf=cf, sites=sites, split=cut, arg_names=[t.name for t in arg_phs],
                arg_dtypes=[t.dtype for t in arg_phs],
                captures={ph.name: ext for ph, ext in zip(capture_phs, cf.captured_inputs)},
                first_returns=first_returns)


def _check_updates_after_cut(what, sites, cut, graph_def):
    """Raises ValueError unless every update is in the second part, where it reads the passes' gradients.

    An update lands in the first part when a gradient depends on it: a step that updates one model and
    then computes another's gradient through the updated one (a GAN's discriminator, then its generator).
    Imported before the passes run, that update would apply its local gradient, unaveraged, and the
    workers would drift apart; one cut cannot put it both after its gradient's reduction and before the
    later gradient that reads its result."""
    first = {n.name for n in cut.first.node}
    early = [(s, u) for s in sites for u in s.updates if u in first]
    if not early:
        return
    needs = {o.name: graphdef.ancestors(graph_def, [o.values.split(":")[0]]) for o in sites}
    lines = []
    for site, update in early:
        after = sorted(o.name for o in sites if o is not site and update in needs[o.name])
        lines.append(f"  - {site.name} is updated ({update}) before the gradient of "
                     f"{', '.join(after[:3]) + (' ...' if len(after) > 3 else '') or 'another variable'} is computed\n")
    raise ValueError(f"{what}: some updates come before later gradients that depend on them, through the "
                     "updated variables (e.g. a GAN step that updates D, then computes G's loss through the "
                     "updated D):\n" + "".join(lines)
                     + "kungfu.rewrite averages all of a step's gradients at one point, between the backward "
                     "passes and the updates, so it cannot average these. Average in the step itself: "
                     "kungfu.DistributedGradientTape(tape).gradient(...) for each tape, or "
                     "kungfu.optimizers.SynchronousSGDOptimizer for each optimizer, without kungfu.rewrite; "
                     "or split the step in two tf.functions, one per model, and rewrite each.")


def rebuild(p, arguments, passes, ctx):
    """Rebuilds p.cf in the tf.function being traced, the passes between its parts; returns its outputs.

    arguments: the traced function's argument placeholders (conv.traced_arguments(), read before
    anything was captured), standing for the original's, in the same order.
    """
    bound = _bind(p, arguments)
    first_map = {ref: bound[t] for ref, t in p.split.first_links.items()}
    got = tf.graph_util.import_graph_def(p.split.first, input_map=first_map, return_elements=p.first_returns,
                                         name="backprop")
    tensors = {**dict(zip(p.first_returns, got)), **bound}
    grads = [passes_lib.Gradient(name=s.name, variable=s.variable, values=tensors[s.values],
                                 indices=tensors[s.indices] if s.indices else None) for s in p.sites]
    new = passes_lib.run_passes(passes, grads, ctx)
    replaced = {}
    for site, g in zip(p.sites, new):
        replaced[site.values] = g.values
        if site.indices:
            replaced[site.indices] = g.indices
    second_map = {ref: (tensors[t] if ref.startswith("^") else replaced.get(t, tensors[t]))
                  for ref, t in p.split.second_links.items()}
    outputs = [t.name for t in p.cf.outputs if t.name not in tensors]
    got = tf.graph_util.import_graph_def(p.split.second, input_map=second_map, return_elements=outputs,
                                         name="update")
    tensors.update(zip(outputs, got))
    return tf.nest.map_structure(lambda t: tensors[t.name] if isinstance(t, tf.Tensor) else t,
                                 p.cf.structured_outputs, expand_composites=True)


def _bind(p, args):
    """{name of an original placeholder tensor: the tensor of the new function it stands for}."""
    if len(args) != len(p.arg_names) or any(a.dtype != d for a, d in zip(args, p.arg_dtypes)):
        raise RuntimeError(f"kungfu.rewrite: the rewritten function got argument tensors {args} where the "
                           f"original has {p.arg_names}; kungfu/_rewrite/_conventions.py needs updating")
    bound = dict(zip(p.arg_names, args))
    used = set(p.split.first_links.values()) | set(p.split.second_links.values())
    for name, captured in p.captures.items():
        if name in used:
            bound[name] = tf.identity(captured)  # captures it again: the same variable, the same handle
    return bound
