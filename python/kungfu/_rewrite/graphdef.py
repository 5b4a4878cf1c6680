"""Editing a traced GraphDef: cutting it in two around the gradients, so that new ops can go in between.

The rewritten function imports the traced graph in two parts (rebind.py), with the passes' ops built
between them:
  first:  every node the gradient tensors depend on, through data or control edges (the forward and the
          backward pass);
  second: every other node (the optimizer's updates, the outputs). Its inputs from the first part are
          *links*, bound at import: the gradient tensors to the passes' new tensors, the rest to the
          first part's imported tensors.
The first part cannot depend on the second (it holds every ancestor of what it holds), so importing the
first, building the passes' ops, then importing the second creates every op after its inputs.

Edits both parts need: the placeholders of the arguments and captures are removed (import binds their
uses; left in, they would be dangling Placeholder ops, which XLA and graph pruning reject), and the
colocation attributes ("_class": ["loc:@node"]) are stripped, since they name nodes of the other part
or removed placeholders.

A control input of the second part on a node of the first is bound through one of that node's outputs;
a node with no outputs gets a Const that runs after it (name + AFTER) to stand for it.
"""

import dataclasses

import tensorflow as tf

AFTER = "/_kungfu_after"


@dataclasses.dataclass
class Split:
    first: tf.compat.v1.GraphDef
    second: tf.compat.v1.GraphDef
    first_links: dict  # reference in first ('x:0' or '^x') -> the removed placeholder tensor it names ('x:0')
    second_links: dict  # reference in second -> the tensor it names ('n:k'), in first or a removed placeholder


def parse_input(ref):
    """(node, output index, is control) of a NodeDef input: 'n', 'n:2' or '^n'."""
    if ref.startswith("^"):
        return ref[1:], 0, True
    node, _, index = ref.partition(":")
    return node, int(index or 0), False


def ancestors(graph_def, node_names):
    """The names of node_names and of every node they depend on, through data or control inputs."""
    by_name = {n.name: n for n in graph_def.node}
    seen, stack = set(), list(node_names)
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        stack.extend(parse_input(ref)[0] for ref in by_name[name].input)
    return seen


def split(graph_def, roots, removed, has_outputs):
    """Cuts graph_def into the ancestors of the nodes `roots` and the rest; see the module doc.

    removed: names of the placeholder nodes to drop; has_outputs(name): whether that node has outputs.
    """
    first_names = ancestors(graph_def, roots)
    first, second = _empty_like(graph_def), _empty_like(graph_def)
    first_links, second_links, stand_ins = {}, {}, {}
    for node in graph_def.node:
        if node.name in removed:
            continue
        in_first = node.name in first_names
        copy = (first if in_first else second).node.add()
        copy.CopyFrom(node)
        copy.ClearField("input")
        if "_class" in copy.attr:
            del copy.attr["_class"]
        for ref in node.input:
            src, index, control = parse_input(ref)
            if not in_first and control and src in first_names and not has_outputs(src):
                stand_ins.setdefault(src, src + AFTER)
                ref = "^" + stand_ins[src]
                src = stand_ins[src]
            copy.input.append(ref)
            if src in removed:
                (first_links if in_first else second_links)[_key(ref)] = f"{src}:{index}"
            elif not in_first and (src in first_names or src in stand_ins.values()):
                second_links[_key(ref)] = f"{src}:{index}"
    for src, name in stand_ins.items():
        first.node.append(_const_after(name, src))
    return Split(first, second, first_links, second_links)


def _key(ref):
    """An input reference as import_graph_def's input_map takes it: 'n:k' or '^n'."""
    src, index, control = parse_input(ref)
    return ref if control else f"{src}:{index}"


def _empty_like(graph_def):
    out = tf.compat.v1.GraphDef()
    out.versions.CopyFrom(graph_def.versions)
    out.library.CopyFrom(graph_def.library)  # importing a function twice is a no-op
    return out


def _const_after(name, after):
    node = tf.compat.v1.NodeDef(name=name, op="Const", input=["^" + after])
    node.attr["dtype"].type = tf.int32.as_datatype_enum
    node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(0, tf.int32))
    return node
