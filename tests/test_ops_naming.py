"""Collective keys: the derived names, and the TF internals the derivation relies on.

If a TensorFlow upgrade renames the control-flow graph classes or changes how unique names are
scoped inside loop and cond bodies, test_keys_do_not_depend_on_trace_order fails here first, with
the keys it saw; see kungfu/ops/_naming.py.
"""

import pytest
import tensorflow as tf


import kungfu
from kungfu import _lib
from kungfu.ops import _naming

pytestmark = pytest.mark.usefixtures("kungfu_library")  # fails, naming the fix, when it is not built

KF_OPS = {"KfAllReduce", "KfGroupAllReduce", "KfBroadcast", "KfAllGather", "KfBarrier", "KfConsensus"}


@pytest.fixture(scope="module", autouse=True)
def initialized():
    kungfu.init()


def keys_of(concrete):
    """Every collective key in a concrete function, its loop and cond bodies included, sorted."""
    graph_def = concrete.graph.as_graph_def()
    keys = []
    for nodes in [graph_def.node] + [fn.node_def for fn in graph_def.library.function]:
        by_name = {n.name: n for n in nodes}
        for n in nodes:
            if n.op in KF_OPS:
                data_inputs = [i for i in n.input if not i.startswith("^")]
                const = by_name[data_inputs[-2].split(":")[0]]  # the key: second-to-last input, a Const
                keys.append(const.attr["value"].tensor.string_val[0].decode())
    return sorted(keys)


def test_eager_keys_are_one_per_op_type():
    """Unnamed eager calls of one op type share a key; the engine counts its calls, so the nth call here
    meets the nth on the other workers, and a long loop of them adds no key per call."""
    assert _naming.collective_key("all_reduce", None) == "eager/all_reduce"
    assert _naming.collective_key("all_reduce", None) == "eager/all_reduce"
    assert _naming.collective_key("barrier", None) == "eager/barrier"
    assert _naming.collective_key("all_reduce", "grads/w") == "grads/w"
    first = _naming.key_tensor("all_reduce", None, eager=True)
    assert first.numpy() == b"eager/all_reduce"
    assert _naming.key_tensor("all_reduce", None, eager=True) is first  # made once, not per call


def test_eager_keys_in_a_key_scope_stand_apart_and_ignore_tf_name_scopes():
    """The optimizers' strategies have eager keys of their own (key_scope), so a worker on SMA never pairs
    with one on S-SGD; TF's name scopes stay out of eager keys, since Keras's hold per-process names."""
    with _naming.key_scope("sma"):
        assert _naming.collective_key("all_reduce", None) == "eager/sma/all_reduce"
        with _naming.key_scope("inner"):
            assert _naming.collective_key("all_reduce", None) == "eager/sma/inner/all_reduce"
        assert _naming.collective_key("all_reduce", "given") == "given"
    with tf.name_scope("sequential_1"):  # e.g. a Keras layer call
        assert _naming.collective_key("all_reduce", None) == "eager/all_reduce"


def test_function_keys():
    @tf.function
    def train_step(x):
        a = kungfu.all_reduce(x)
        b = kungfu.all_reduce(x, name="loss")
        with tf.name_scope("metrics"):
            c = kungfu.all_reduce(x)
        kungfu.barrier()
        return a + b + c + kungfu.all_gather(x)

    keys = keys_of(train_step.get_concrete_function(tf.TensorSpec([2])))
    assert keys == ["loss", "train_step/all_gather", "train_step/all_reduce", "train_step/barrier",
                    "train_step/metrics/all_reduce"]


def test_gradient_keys_are_the_forward_keys_with_grad_eagerly_and_in_a_function():
    """A gradient's collectives are keyed by the forward one's key + "/grad" (+ "/dims" for all_gather's
    first dimensions) both ways, so a worker taking the gradient eagerly meets one taking it in a graph."""
    w = tf.Variable([1.0, 2.0])

    def grad():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(kungfu.all_reduce(w * w, name="gk")) + tf.reduce_sum(kungfu.all_gather(w))
        return tape.gradient(loss, w)

    step = tf.function(grad)
    keys = keys_of(step.get_concrete_function())
    assert keys == ["gk", "gk/grad", "grad/all_gather", "grad/all_gather/grad", "grad/all_gather/grad/dims"], keys
    _lib.collective_stats(reset=True)
    grad()
    assert {"gk", "gk/grad"} <= set(_lib.collective_stats(reset=True)), "eager gradient keys"


def _with_control_flow():

    @tf.function
    def step_fn(x):
        def body(i, x):
            return i + 1, kungfu.all_reduce(x)

        _, y = tf.while_loop(lambda i, x: i < 2, body, [0, x])
        z = tf.cond(tf.reduce_sum(x) > 0, lambda: kungfu.broadcast(x), lambda: kungfu.broadcast(-x))
        return y + z

    return step_fn


def test_keys_do_not_depend_on_trace_order():
    first = keys_of(_with_control_flow().get_concrete_function(tf.TensorSpec([2])))
    # Trace other control flow in between: it advances TF's process-wide graph uids.
    for _ in range(3):
        _with_control_flow().get_concrete_function(tf.TensorSpec([5]))
    second = keys_of(_with_control_flow().get_concrete_function(tf.TensorSpec([2])))
    assert first == second
    assert first == ["step_fn/cond/broadcast", "step_fn/cond/broadcast", "step_fn/while/all_reduce"], (
        "derived keys changed; has TF renamed its control-flow graph classes "
        f"({sorted(_naming.CONTROL_FLOW_GRAPHS)}) or their name scoping?")


def test_control_flow_graph_classes_exist():
    seen = set()

    @tf.function
    def f(x):
        def body(i):
            seen.add(type(tf.compat.v1.get_default_graph()).__name__)
            return i + 1

        def branch():
            seen.add(type(tf.compat.v1.get_default_graph()).__name__)
            return x

        tf.while_loop(lambda i: i < 2, body, [0])
        return tf.cond(x > 0, branch, branch)

    f.get_concrete_function(tf.TensorSpec([]))
    assert seen <= _naming.CONTROL_FLOW_GRAPHS, f"TF's control-flow graphs are now {seen}"
    assert {"WhileBodyFuncGraph", "CondBranchFuncGraph"} <= seen


def test_nested_function_keys_use_inner_function_name():
    @tf.function
    def inner(x):
        return kungfu.all_reduce(x)

    @tf.function
    def outer(x):
        return inner(x) + kungfu.all_reduce(x)

    assert keys_of(outer.get_concrete_function(tf.TensorSpec([2]))) == ["inner/all_reduce", "outer/all_reduce"]


def test_xla_compiled_functions_are_refused_with_the_fix():
    assert _naming._in_xla is not None, (
        "tensorflow.python.ops.control_flow_util.GraphOrParentsInXlaContext is gone: kungfu/ops/_naming.py "
        "can no longer refuse collectives in XLA-compiled functions with a clear message")

    @tf.function(jit_compile=True)
    def compiled(x):
        return tf.cond(x[0] > 0, lambda: kungfu.all_reduce(x), lambda: x)

    with pytest.raises(ValueError, match=r"tf.function 'compiled'.*jit_compile=False"):
        compiled.get_concrete_function(tf.TensorSpec([2]))

    @tf.function(jit_compile=True)
    def named(x):
        return kungfu.broadcast(x, name="weights")

    with pytest.raises(ValueError, match=r"broadcast in tf.function 'named'.*no XLA kernels"):
        named.get_concrete_function(tf.TensorSpec([2]))

    @tf.function
    def plain(x):
        return tf.cond(x[0] > 0, lambda: kungfu.all_reduce(x), lambda: x)

    assert keys_of(plain.get_concrete_function(tf.TensorSpec([2]))) == ["plain/cond/all_reduce"]

    @tf.function(jit_compile=True)
    def saves(x):
        return kungfu.ops.save_variable(x, name="model")

    with pytest.raises(ValueError, match=r"save_variable in tf.function 'saves'.*no XLA kernels"):
        saves.get_concrete_function(tf.TensorSpec([2]))


def test_one_explicit_name_twice_in_a_function_control_flow_included():
    ar = kungfu.all_reduce

    def traces(fn):
        try:
            tf.function(fn).get_concrete_function(tf.TensorSpec([2]))
            return True
        except ValueError as e:
            assert "already used by another collective" in str(e)
            return False

    def nested_arms(x):
        inner = lambda: tf.cond(x[1] > 0, lambda: ar(x, name="k"), lambda: ar(x, name="k"))  # noqa: E731
        return tf.cond(x[0] > 0, inner, lambda: ar(x, name="k"))

    def loop_and_outside(x):
        return tf.while_loop(lambda i, y: i < 2, lambda i, y: (i + 1, ar(y, name="k")), [0, x])[1] + ar(x, name="k")

    # Refused: both may run in one call, and would meet the other workers' in either order.
    assert not traces(lambda x: ar(x, name="k") + tf.cond(x[0] > 0, lambda: ar(x, name="k"), lambda: x))
    assert not traces(lambda x: tf.cond(x[0] > 0, lambda: ar(x, name="k"), lambda: x) +
                      tf.cond(x[1] > 0, lambda: ar(x, name="k"), lambda: x))
    assert not traces(loop_and_outside)
    # Allowed: the branches of one cond or switch_case, of which only one runs.
    assert traces(lambda x: tf.cond(x[0] > 0, lambda: ar(x, name="k"), lambda: ar(x * 2, name="k")))
    assert traces(lambda x: tf.switch_case(tf.cast(x[0], tf.int32),
                                           [lambda: ar(x, name="k"), lambda: ar(x, name="k"), lambda: x]))
    assert traces(nested_arms)


def test_calls_of_functions_holding_collectives_are_ordered():
    """The TF internals that order such calls (kungfu/ops/_naming.py, end): the resolver is registered, it
    finds the called FuncGraph, and the second call of a function that reads a captured variable then
    waits for the first."""
    assert _naming._register is not None, "auto_control_deps.register_acd_resource_resolver is gone"
    w = tf.Variable(1.0)

    @tf.function
    def inner(x):
        return kungfu.all_reduce(x * w, name="ordered")

    @tf.function
    def outer(x):
        return inner(x), inner(x + 1)

    graph = outer.get_concrete_function(tf.TensorSpec([2])).graph
    calls = [op for op in graph.get_operations() if op.type in _naming._CALL_OPS]
    assert len(calls) == 2
    assert any(getattr(g, _naming._HOLDS, False) for g in _naming._called_graphs(calls[0])), (
        "Graph._get_function(name).graph no longer finds the called FuncGraph")
    assert calls[0] in calls[1].control_inputs, "the second call does not wait for the first"

    @tf.function
    def inner_pure(x):  # no captured variable: TF itself chains these calls, but not with a cond's
        return kungfu.all_reduce(x, name="ordered_pure")

    @tf.function
    def with_cond(x):
        first = inner_pure(x)
        middle = tf.cond(x[0] > 0, lambda: inner_pure(x + 1), lambda: x)
        return first, middle, inner_pure(x + 2)

    graph = with_cond.get_concrete_function(tf.TensorSpec([2])).graph
    ops = [op for op in graph.get_operations() if op.type in _naming._CALL_OPS or op.type in ("If", "StatelessIf")]
    assert [op.type for op in ops][1] in ("If", "StatelessIf") and len(ops) == 3, [op.type for op in ops]
    assert ops[0] in ops[1].control_inputs and ops[1] in ops[2].control_inputs, (
        "a tf.cond holding a call with collectives is not ordered with the calls around it")


def _branchy():
    def branchy(x):
        if x > 0:  # AutoGraph makes this a tf.cond; called as it is, a symbolic tensor's bool is refused
            return x
        return -x

    return branchy


def test_no_autograph_marks_the_function_itself_and_autograph_calls_it_as_it_is():
    converted, original = _branchy(), _branchy()
    marked = _naming.no_autograph(original)
    assert marked is original and getattr(kungfu.all_reduce, "__wrapped__", None) is None, (
        "tf.autograph.experimental.do_not_convert's wrapper no longer carries AutoGraph's mark "
        f"{_naming._AUTOGRAPH_MARK!r}: every eager collective pays for the wrapper (see _naming.no_autograph)")

    @tf.function
    def uses_converted(x):
        return converted(x)

    @tf.function
    def uses_marked(x):
        return marked(x)

    assert float(uses_converted(tf.constant(-2.0))) == 2.0
    with pytest.raises(TypeError, match="bool"):  # OperatorNotAllowedInGraphError: not converted
        uses_marked(tf.constant(-2.0))


def _error_of(fn):
    with pytest.raises(tf.errors.OpError) as caught:
        fn()
    return str(caught.value)


def test_eager_collectives_run_op_by_op_and_leave_tf_as_it_was():
    """An eager collective turns TF's run_eager_op_as_function off for its own dispatch only (_naming.ops). TF
    marks an error of an op it ran as a one-op function with the function's node, "__wrapped__<Op>": the
    kernel's own error shows which path ran it, and an ordinary op's error after it that TF's setting is back."""
    assert _naming._set_op_as_function is not None, (
        "tensorflow.python.pywrap_tfe.TFE_ContextSetRunEagerOpAsFunction is gone: eager collectives run as "
        "one-op functions again, slower (kungfu/ops/_naming.py, ops())")

    def reshape_error():
        return _error_of(lambda: tf.reshape(tf.ones([4]), [3]))

    assert "__wrapped__Reshape" in reshape_error(), (
        "TF no longer runs eager ops as one-op functions by default: _naming.ops() may have nothing left to do")
    x = tf.ones([3])
    token = _naming.token(True)
    empty_key = tf.constant("")  # refused by the kernel itself: "the collective key must not be empty"

    def refused(module):
        return _error_of(lambda: module.kf_all_reduce(x, empty_key, token, reduce_op="sum", blocking=True))

    by_op = refused(_naming.ops(True))
    assert "must not be empty" in by_op and "__wrapped__" not in by_op, by_op
    assert "__wrapped__Reshape" in reshape_error(), "the eager collective left run_eager_op_as_function off"
    as_function = refused(_lib.op_module())
    assert "__wrapped__KfAllReduce" in as_function, as_function  # TF's own path, for contrast
    assert float(kungfu.all_reduce(tf.constant([2.0]), name="op_by_op")[0]) == 2.0


def test_eager_all_reduce_knows_when_tf_watches():
    """An eager all_reduce goes around TF's op dispatch only while it runs eagerly and no tape and no op
    callback would see the op (_naming.eager_unobserved(), kungfu/ops/_direct.py); it asks TF through
    private APIs."""
    assert _naming._tape_set_is_empty is not None, (
        "tensorflow.python.pywrap_tfe.TFE_Py_TapeSetIsEmpty, Context.op_callbacks or Context.executing_eagerly "
        "is gone: every eager all_reduce and barrier runs the TF op again, slower (kungfu/ops/_naming.py, "
        "eager_unobserved())")
    assert _naming.eager_unobserved()
    with tf.GradientTape():
        assert not _naming.eager_unobserved()
    assert _naming.eager_unobserved()
    seen = []
    tf.function(lambda: seen.append(_naming.eager_unobserved()))()  # traced: a graph, not eager
    assert seen == [False]
