"""Finding the gradients of a traced training step and the variable updates they feed.

A *gradient tensor* is a tensor that the backward pass of a tf.GradientTape produced (an op under the
"gradient_tape/" name scope, the ops with which the tape sums or joins the gradients of a variable used
more than once, e.g. a layer called twice or an embedding looked up twice, or the call of a nested
tf.function's backward function) and that something outside the backward pass consumes. An *update* is an op
that writes a trainable variable (AssignSubVariableOp, ResourceScatterSub, ...). The gradient of a variable
is the gradient tensor its updates depend on, found by walking the data inputs of the updates backwards:
  - through the optimizer's own state: a read of a slot variable (Adam's m and v) continues at the
    writes of that slot, which is how a gradient reaches the variable's update in Adam;
  - not through reductions (a global norm, a clip factor): those make every update depend on every
    gradient, but only through a statistic;
  - through an IdentityN output k to its input k only (Keras's marker passes all gradients in one IdentityN).
A dense gradient is one float tensor; an IndexedSlices gradient is a float values tensor plus an integer
indices tensor (its dense shape is a constant and is left alone).

Trainable variables are the float and complex ones (an integer step counter, trainable by TF's default,
is no variable the tape can differentiate). The rewrite needs exactly one gradient per updated trainable
variable. Anything else raises ValueError, naming what was found; so does a step in which nothing was
found, and one whose updates already take their gradients through a KungFu collective (a step that
averages its gradients itself).
"""

import dataclasses

import tensorflow as tf

from . import _conventions as conv


@dataclasses.dataclass(frozen=True)
class GradientSite:
    """Where one variable's gradient is in the traced graph (tensor names, e.g. 'gradient_tape/MatMul:0')."""

    variable: tf.Variable  # the trainable variable it updates
    name: str  # the variable's name, e.g. 'sequential/dense/kernel'
    values: str  # the dense gradient, or the values of an IndexedSlices
    indices: str | None  # the indices of an IndexedSlices; None for a dense gradient
    updates: tuple  # names of the ops that write the variable
    order: int  # position of the op producing values in the graph: backward-pass order


def find_gradients(cf, what):
    """The GradientSites of a ConcreteFunction, in the order the backward pass produces them.

    what names the function in errors, e.g. "kungfu.rewrite(train_step)".
    """
    ops = cf.graph.get_operations()
    boundary = _boundary_tensors(ops)
    _, capture_phs = conv.split_inputs(cf)
    trainable = _trainable_placeholders(cf, capture_phs)
    writes = _writes_by_resource(ops)
    updated = {ph: ws for ph, ws in writes.items() if ph in trainable}
    if not boundary or not updated:
        raise ValueError(_nothing_found(what, ops, boundary, updated, trainable))
    walks = {ph: _gradients_of(ws, boundary, trainable, writes) for ph, ws in updated.items()}
    dependent = _gradient_dependent(ops, boundary)  # a collective counts only on a gradient's path
    _check_not_distributed(what, {ph: [op for op in w[3] if any(t.name in dependent for t in op.inputs)]
                                  for ph, w in walks.items()}, trainable, cf.graph)
    # A trainable variable with no gradient that other variables' updates read is optimizer state that
    # was made trainable (Keras's Nadam makes its u_product so): it is left alone, as the optimizer's own.
    read = set().union(*(w[2] for w in walks.values()))
    found = {ph: (floats, ints) for ph, (floats, ints, _, _) in walks.items() if floats or ints or ph not in read}
    updated = {ph: ws for ph, ws in updated.items() if ph in found}
    local = _local_data_writes(cf, ops, updated, boundary, trainable, writes)
    _check_one_per_variable(what, found, updated, trainable, local)
    order = {op.name: i for i, op in enumerate(ops)}
    sites = []
    for ph, (floats, ints) in found.items():
        values = next(iter(floats))
        sites.append(GradientSite(variable=trainable[ph], name=conv.variable_name(trainable[ph]),
                                  values=values.name, indices=next(iter(ints)).name if ints else None,
                                  updates=tuple(w.name for w in updated[ph]), order=order[values.op.name]))
    return sorted(sites, key=lambda s: s.order)


def _boundary_tensors(ops):
    """Outputs of backward-pass ops that an op outside the backward pass consumes, by name."""
    backward = set()  # names of the backward pass's ops; ops come in creation order, inputs first
    for op in ops:
        if conv.in_gradient_scope(op.name) or conv.is_backward_call(op):
            backward.add(op.name)
        else:
            backward.update(o.name for o in conv.gradient_sum_ops(op, backward))
    boundary = {}
    for op in ops:
        if op.name in backward:
            continue
        for t in op.inputs:
            if t.op.name in backward:
                boundary[t.name] = t
    return boundary


def _resource_root(t):
    """The op a resource handle comes from, seen through Identity ops."""
    while t.op.type in conv.HANDLE_PASSTHROUGH_OPS and t.op.inputs:
        t = t.op.inputs[t.value_index if t.op.type in conv.PER_OUTPUT_OPS else 0]
    return t.op.name


def _trainable_placeholders(cf, capture_phs):
    """{name of the capture placeholder: variable} for the trainable variables the function captures.

    Only float and complex variables count: TensorFlow makes an integer tf.Variable trainable by default
    (a step counter, tf.Variable(0, dtype=tf.int64)), but no gradient can reach it."""
    by_handle = {id(v.handle): v for v in cf.trainable_variables if conv.can_have_gradient(v.dtype)}
    return {ph.op.name: by_handle[id(ext)] for ext, ph in zip(cf.captured_inputs, capture_phs)
            if id(ext) in by_handle}


def _writes_by_resource(ops):
    writes = {}
    for op in ops:
        if conv.is_variable_write(op.type) and op.inputs:
            writes.setdefault(_resource_root(op.inputs[0]), []).append(op)
    return writes


def _gradients_of(update_ops, boundary, trainable, writes):
    """(float gradient tensors, integer index tensors, the trainable variables read, the KungFu
    collectives passed through) the updates depend on; see the module doc."""
    stack = [t for w in update_ops for t in w.inputs if t.dtype != tf.resource]
    seen, floats, ints, reads, collectives = set(), {}, {}, set(), {}
    while stack:
        t = stack.pop()
        if t.name in seen:
            continue
        seen.add(t.name)
        op = t.op
        if op.type in conv.KUNGFU_COLLECTIVE_OPS or op.type in conv.CALL_OPS:
            collectives[op.name] = op  # a call op counts if its functions hold a collective (checked later)
        if t.name in boundary:
            if t.dtype.is_floating or t.dtype.is_complex:
                floats[t.name] = t
            elif op.type not in conv.SHAPE_OPS:
                ints[t.name] = t
        elif op.type == "ReadVariableOp":
            root = _resource_root(op.inputs[0])
            if root not in trainable:  # optimizer state: follow what was written into it
                stack.extend(i for w in writes.get(root, []) for i in w.inputs if i.dtype != tf.resource)
            else:
                reads.add(root)
        elif op.type in conv.PER_OUTPUT_OPS:
            stack.append(op.inputs[t.value_index])
        elif op.type not in conv.REDUCTION_OPS:
            stack.extend(i for i in op.inputs if i.dtype != tf.resource)
    return list(floats.values()), list(ints.values()), reads, list(collectives.values())


def _local_data_writes(cf, ops, updated, boundary, trainable, writes):
    """{placeholder: [(write, the data op it reaches, whether it has a gradient)]} of the variables with an
    update that depends on the step's data (its arguments or an iterator it pulls) other than through a
    gradient: v.assign_add(f(x)) beside the gradient step, or a gradient scaled by something of this
    worker's batch (g / n_tokens, g * f(loss)). The rewrite averages the gradients only, so such an update
    would stay each worker's own and the workers' copies of v would drift apart. What comes from the
    variables alone (weight decay, an average of the weights) or through a KungFu collective (a count
    all-reduced over the workers) is the same on every worker and is left alone."""
    # Scalar arguments are taken as the same on every worker (a learning rate or a step passed in).
    data = ({t.op.name for t in conv.split_inputs(cf)[0] if t.shape.rank != 0}
            | {op.name for op in ops if op.type in _ITERATOR_OPS})
    tainted = _data_taint(ops, data, boundary, trainable)
    local = {}
    for ph, ws in updated.items():
        for w in ws:
            reached = next((tainted[t.name] for t in w.inputs if t.name in tainted and t.name not in boundary), None)
            if reached is not None:
                has_gradient = bool(_gradients_of([w], boundary, trainable, writes)[0])
                local.setdefault(ph, []).append((w, reached, has_gradient))
    return local


_ITERATOR_OPS = frozenset({"IteratorGetNext", "IteratorGetNextSync", "IteratorGetNextAsOptional"})


def _data_taint(ops, data, boundary, trainable):
    """{tensor name: the name of the op in data it depends on} for the tensors that depend on the step's
    data other than through a gradient tensor, a trainable variable's value or a KungFu collective's
    result; a read of another variable (optimizer state) depends on what the step writes into it. One
    pass over the ops in creation order (inputs first), repeated while a variable newly turns out to be
    written from data (a slot is read before it is written): linear in the graph's size."""
    tainted, variables = {}, {}  # variables: resource root -> data op
    while True:
        grew = False
        for op in ops:
            if op.name in data:
                src = op.name
            elif op.type in conv.KUNGFU_SHARED_RESULT_OPS:
                continue
            elif op.type == "ReadVariableOp":
                root = _resource_root(op.inputs[0])
                src = None if root in trainable else variables.get(root)
            else:
                src = next((tainted[t.name] for t in op.inputs if t.name in tainted and t.name not in boundary), None)
            if src is None:
                continue
            for t in op.outputs:
                tainted.setdefault(t.name, src)
            if conv.is_variable_write(op.type) and op.inputs:
                root = _resource_root(op.inputs[0])
                if root not in trainable and root not in variables:
                    variables[root] = src
                    grew = True
        if not grew:
            return tainted


def _gradient_dependent(ops, boundary):
    """The names of the tensors that depend on a gradient tensor (through data inputs), in one pass."""
    dependent = set(boundary)
    for op in ops:
        if any(t.name in dependent for t in op.inputs if t.dtype != tf.resource):
            dependent.update(t.name for t in op.outputs)
    return dependent


def _check_not_distributed(what, collectives, trainable, graph):
    """Raises ValueError when an update already takes its gradient through a KungFu collective, in the
    graph or in a function an op on the way calls (the optimizer wrappers all-reduce inside a tf.switch_case):
    the step averages its gradients itself (kungfu.DistributedGradientTape, SynchronousSGDOptimizer, ...)."""
    through, library = {}, None  # collective "Type 'name'" -> the variables whose updates pass through it
    for ph, ops in collectives.items():
        for op in ops:
            said = f"{op.type} '{op.name}'"
            if op.type in conv.CALL_OPS:
                if library is None:
                    library = {f.signature.name: f for f in graph.as_graph_def().library.function}
                inner = _collectives_called(op.node_def, library, set())
                if not inner:
                    continue
                said += f" (calling {', '.join(sorted(inner))})"
            through.setdefault(said, []).append(conv.variable_name(trainable[ph]))
    if not through:
        return
    said = "; ".join(f"{c} (for {', '.join(sorted(names))})" for c, names in sorted(through.items()))
    raise ValueError(f"{what}: this step already averages its gradients over the workers: its updates take them "
                     f"through KungFu collectives: {said}. It uses kungfu.DistributedGradientTape, a kungfu "
                     "optimizer wrapper (SynchronousSGDOptimizer, ...) or kungfu.all_reduce on the gradients, and "
                     "is distributed as it is: call it without kungfu.rewrite, or give kungfu.rewrite the plain step "
                     "(tf.GradientTape and a Keras optimizer).")


def _collectives_called(node, library, seen):
    """The types of the KungFu collectives in the functions node calls, through nested calls."""
    found = set()
    for value in node.attr.values():
        names = [value.func.name] if value.HasField("func") else [f.name for f in value.list.func]
        for name in names:
            if name in seen or name not in library:
                continue
            seen.add(name)
            for inner in library[name].node_def:
                if inner.op in conv.KUNGFU_COLLECTIVE_OPS:
                    found.add(inner.op)
                found |= _collectives_called(inner, library, seen)
    return found


_FIX = ("kungfu.rewrite needs a step that computes gradients with tf.GradientTape and applies them to the "
        "trainable variables, one gradient per variable (opt.apply_gradients(zip(grads, variables)))")


def _check_one_per_variable(what, found, updated, trainable, local):
    problems, owners, scaled = [], {}, {}  # scaled: data op -> variables whose gradient updates also use it
    for ph, (floats, ints) in found.items():
        name = conv.variable_name(trainable[ph])
        ops = ", ".join(f"{w.type} '{w.name}'" for w in updated[ph])
        if not floats:
            problems.append(f"{name} is updated ({ops}) from no gradient")
        elif ph in local:
            for w, reached, has_gradient in local[ph]:
                if has_gradient:
                    scaled.setdefault(reached, []).append(name)
                else:
                    problems.append(
                        f"{name} is also updated ({w.type} '{w.name}') from this worker's data ('{reached}') "
                        "without a gradient, which the rewrite cannot average: the workers' copies would drift "
                        "apart")
        elif len(floats) > 1:
            problems.append(f"{name} is updated from {len(floats)} gradient tensors: "
                            f"{', '.join(sorted(t.name for t in floats))}")
        if len(ints) > 1:
            problems.append(f"{name} is updated from {len(ints)} index tensors: "
                            f"{', '.join(sorted(t.name for t in ints))}")
        for t in floats:
            owners.setdefault(t.name, []).append(name)
    problems += [f"gradient {t} feeds the updates of {len(names)} variables: {', '.join(sorted(names))}"
                 for t, names in sorted(owners.items()) if len(names) > 1]
    problems += [f"the updates of {', '.join(sorted(set(names)))} depend on this worker's data ('{reached}') besides "
                 "their gradients (e.g. a gradient divided by a count of this worker's batch, or scaled by its "
                 "loss), which the rewrite cannot average: the workers' copies would drift apart. Fold the factor "
                 "into the loss, or make it the same on every worker (kungfu.all_reduce the count)"
                 for reached, names in sorted(scaled.items())]
    if problems:
        raise ValueError(f"{what}: found {len(owners)} gradient(s) for {len(updated)} updated trainable "
                         "variable(s):\n"
                         + "".join(f"  - {p}\n" for p in problems)
                         + f"{_FIX}; update other variables only if they are created with trainable=False.")


def _nothing_found(what, ops, boundary, updated, trainable):
    if not boundary:
        found = "found no gradients (no tf.GradientTape backward pass in its graph)"
    else:
        found = f"found {len(boundary)} tensor(s) leaving a tf.GradientTape backward pass"
    if updated:
        found += f" and {len(updated)} updated trainable variable(s)"
    else:
        found += (f" but no update of any of its {len(trainable)} captured trainable variable(s)" if boundary
                  else " and no update of a trainable variable")
    calls = sorted({f"{op.type} '{op.name}'" for op in ops if op.type in conv.CALL_OPS})
    hint = ""
    if calls:
        hint = (f" The step calls {', '.join(calls[:5])}{' ...' if len(calls) > 5 else ''}: gradients and updates "
                "inside tf.while_loop, tf.cond or a nested tf.function live in the function library, where "
                "kungfu.rewrite does not look; compute and apply the gradients at the top level of the step "
                "(Keras's LossScaleOptimizer and gradient_accumulation_steps apply them inside a tf.cond; "
                "kungfu.optimizers.SynchronousSGDOptimizer supports both).")
    return f"{what}: {found}. {_FIX}.{hint}"
