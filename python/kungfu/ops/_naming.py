"""How a collective gets its key across workers, and the token that lets collectives run together.

Keys. The engine matches a collective on one worker with the same collective on the others by key
(and by how many times each worker has started that key). A key is the `name` the caller passes,
or else derived deterministically:
  - eagerly: "eager/<op>" for each op type ("eager/all_reduce", ...); inside key_scope(s),
    "eager/s/<op>" (the distributed optimizers run each strategy's collectives in its own, so workers on
    different strategies never pair up). The engine's count of calls per key tells the calls apart, so
    the nth unnamed eager all_reduce on one worker meets the nth on the others, and a loop of them adds
    nothing to what the engine remembers per key. TF's name scopes are left out on purpose: Keras's hold
    per-process automatic names ("dense_1"), which differ between workers as soon as one builds a
    model more;
  - inside tf.function: "<function>/<unique name>", the tf.function's graph name (its Python name)
    and the op's unique name in that graph, e.g. "train_step/all_reduce_2" or, in a loop body,
    "train_step/while/all_reduce". Control-flow bodies (while, cond, switch_case) are graphs with
    uid-suffixed names that depend on trace order, so the key uses the enclosing function's name
    and the body's unique name, which already carries the loop's or cond's name scope.
Derived keys agree across workers only while every worker runs the same collectives in the same
program order: rank-dependent Python control flow (an extra eager collective on rank 0, a
collective traced only on some ranks) shifts the eager calls' counts or the graph's unique names:
later calls meet the wrong calls elsewhere (failing when their shapes differ) and the last waits until
the timeout. Pass `name=` to such collectives.

Tokens. Every collective op takes a resource input, the token (see kf_ops/collective_ops.cc). TF's
automatic control dependencies order stateful ops that share a resource tensor and run stateful
ops with no resource input one after another. Each call in a graph gets a fresh token tensor, a
VarHandleOp of its own in that graph, through a StopGradient (the ops never read the resource, so it is
never created; see token() for the StopGradient), so
independent collectives are in flight together, and each still runs because it is stateful, even
when its output is unused. Only these small handle ops run one after another. Being the graph's own,
the token captures nothing: a function can be traced again with its first collective (a Python
branch), or saved with tf.saved_model.save, where a captured variable would be refused ("Creating
variables on a non-first call", "untracked resource"). Eagerly, ops run one at a time anyway, and
every call takes one hidden variable's handle.

XLA. The ops have no XLA kernels, so a collective traced in a function that XLA compiles
(jit_compile=True, which Keras's model.compile picks by itself when a GPU is visible) is refused at
trace time with the fix, rather than by a long tf2xla error at the first step.

TF internals relied on (checked by tests/test_ops_naming.py, which fails clearly if an upgrade changes them):
the class names of control-flow FuncGraphs, FuncGraph.outer_graph, Graph.unique_name,
control_flow_util.GraphOrParentsInXlaContext (the check is skipped without it), and, to order calls of
functions holding collectives (end of this file), auto_control_deps.register_acd_resource_resolver,
Graph._get_function and its result's .graph; AutoGraph's mark on the functions it calls as they are
(no_autograph); for eager collectives (ops()), pywrap_tfe.TFE_ContextSetRunEagerOpAsFunction and
context.context()._handle; and, for the eager collectives that skip TF's dispatch (eager_unobserved(),
_direct.py), pywrap_tfe.TFE_Py_TapeSetIsEmpty, context.context().op_callbacks and
context.context().executing_eagerly(). The C way of those eager collectives (python/kungfu/ops/_eager.cc) also
calls three C++ functions of TF's Python bindings, EagerTensor_CheckExact, EagerTensor_Handle and
EagerTensorFromHandle (tensorflow/python/eager/pywrap_tensor.h); tests/test_ops_eager.py checks them.
"""

import collections
import contextlib
import os
import re
import threading
import weakref

import tensorflow as tf

from .. import _lib

try:
    from tensorflow.python.ops.control_flow_util import GraphOrParentsInXlaContext as _in_xla
except ImportError:  # a TF without it: the raw XLA error stands (tests/test_ops_naming.py fails)
    _in_xla = None
try:
    from tensorflow.python import pywrap_tfe as _pywrap_tfe
    from tensorflow.python.eager import context as _eager_context
    _set_op_as_function = _pywrap_tfe.TFE_ContextSetRunEagerOpAsFunction
except (ImportError, AttributeError):  # a TF without them: eager ops run as TF runs them (the test fails)
    _set_op_as_function = None
try:  # for the eager collectives around TF's dispatch (_direct.py): nothing may watch the ops they skip
    _tape_set_is_empty = _pywrap_tfe.TFE_Py_TapeSetIsEmpty  # no GradientTape, no ForwardAccumulator
    if not isinstance(getattr(_eager_context.Context, "op_callbacks", None), property):
        raise AttributeError("op_callbacks")
    if not callable(getattr(_eager_context.Context, "executing_eagerly", None)):
        raise AttributeError("executing_eagerly")
except (NameError, AttributeError):  # a TF without them: every eager all_reduce runs the op (the test fails)
    _tape_set_is_empty = None

# Graphs TF builds for control-flow bodies; their names carry a process-wide uid.
CONTROL_FLOW_GRAPHS = frozenset({"WhileCondFuncGraph", "WhileBodyFuncGraph", "CondBranchFuncGraph"})

_lock = threading.Lock()
_key_scopes = threading.local()  # .scope: the key scopes entered on this thread, joined by "/"
_numbered_keys = weakref.WeakKeyDictionary()  # tf.function graph -> Counter of numbered() keys
_explicit_names = weakref.WeakKeyDictionary()  # tf.function graph -> {explicit name: [_arms of each use]}
_op_by_op_views = {}  # generated op module -> its _OpByOp view (one module per loaded library)
_OP_BY_OP = os.environ.get("KUNGFU_EAGER_OP_BY_OP", "1").strip() != "0"  # see ops()
_token_variable = None  # eager calls' token, created on first use
_eager_keys = {}  # key -> the key as an eager string tensor
_MAX_EAGER_KEYS = 4096  # past this many distinct names the cache starts over
_AUTOGRAPH_MARK = "autograph_info__"  # tensorflow/python/autograph/impl/api.py: autograph_artifact()


def no_autograph(func):
    """Returns func, marked so that AutoGraph calls it as it is inside a tf.function instead of converting
    it: what tf.autograph.experimental.do_not_convert does, without the wrapper that function returns,
    which enters a context on every call (about a sixth of an eager 4 KiB all_reduce's time on one worker).
    Our wrappers call no user code, so the context is not needed. The mark is AutoGraph's own: the
    attribute do_not_convert's wrapper carries; a TF whose wrapper has none gets the wrapper
    (tests/test_ops_naming.py fails then)."""
    wrapper = tf.autograph.experimental.do_not_convert(func)
    if not hasattr(wrapper, _AUTOGRAPH_MARK):
        return wrapper
    setattr(func, _AUTOGRAPH_MARK, getattr(wrapper, _AUTOGRAPH_MARK))
    return func


def function_graph(graph):
    """The tf.function graph that graph belongs to, skipping control-flow body graphs."""
    while type(graph).__name__ in CONTROL_FLOW_GRAPHS and getattr(graph, "outer_graph", None) is not None:
        graph = graph.outer_graph
    return graph


def collective_key(op, name, eager=None):
    """The key of one collective call of type op ("all_reduce", ...); name is the caller's or None.
    eager: tf.executing_eagerly(), if the caller has it already."""
    if eager is None:
        eager = tf.executing_eagerly()
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"{op}: name must be a non-empty string, got {name!r}")
    if eager:
        return name if name is not None else _derived_eager_key(op)
    graph = tf.compat.v1.get_default_graph()
    refuse_xla(graph, op)
    if name is not None:
        _claim(graph, name, op)
        return name
    return f"{function_graph(graph).name}/{graph.unique_name(op)}"


def _derived_eager_key(op):
    scope = getattr(_key_scopes, "scope", "")
    return f"eager/{scope}/{op}" if scope else f"eager/{op}"


def eager_key_bytes(op, name):
    """collective_key(op, name, True) encoded, for the eager collectives' short way (_direct.short()), or
    None for a name that collective_key would refuse (the long way raises its error then)."""
    if name is None:
        return _derived_eager_key(op).encode()
    if type(name) is str and name:
        return name.encode()
    return None


@contextlib.contextmanager
def key_scope(name):
    """Derived eager keys inside it are "eager/<name>/<op>", apart from the others (nested: names joined
    by "/"). Fixed names only: a name that differs between workers gives keys that do."""
    outer = getattr(_key_scopes, "scope", "")
    _key_scopes.scope = f"{outer}/{name}" if outer else name
    try:
        yield
    finally:
        _key_scopes.scope = outer


def refuse_xla(graph, op):
    """Raises ValueError, with the fix, when graph is compiled by XLA; op names the caller."""
    if _in_xla is not None and _in_xla(graph):
        raise ValueError(
            f"{op} in tf.function {function_graph(graph).name!r}: the function is compiled by XLA "
            "(jit_compile=True), and KungFu's collectives have no XLA kernels. For model.fit, pass "
            "model.compile(..., jit_compile=False): Keras turns XLA on by itself when a GPU is visible. "
            "For your own tf.function, leave jit_compile out or set it to False.")


def call_inputs(op, name):
    """What every collective op takes besides its data: (key, token, eager), where eager is also the
    ops' `blocking` attr. Eagerly the caller waits for the result anyway, so the kernel waits on the
    calling thread and drives the engine there, saving a thread wake-up each way
    (Engine::RunAndWait); in a graph it must stay False, as an executor thread must never block.
    tf.executing_eagerly() is asked once here: an eager collective pays for each Python call."""
    eager = tf.executing_eagerly()
    return key_tensor(op, name, eager), token(eager), eager


def eager_unobserved():
    """Whether an op run now would run eagerly (tf.executing_eagerly()) and be seen by nothing but its
    caller: no GradientTape or ForwardAccumulator is recording on this thread (TF's own
    record.could_possibly_record), and no op callback (tf.debugging.experimental.enable_dump_debug_info,
    check_numerics) is registered. Only then may an eager collective skip TensorFlow's op dispatch
    (_direct.py): a tape must record the op for its gradient, a callback must see it. Asked before every
    eager collective, so it looks at the eager context once."""
    if _tape_set_is_empty is None:
        return False
    context = _eager_context.context()
    return context.executing_eagerly() and _tape_set_is_empty() and not context.op_callbacks


def ops(eager):
    """The generated op wrappers (kf_all_reduce, ...) for a call that call_inputs() found eager or not.

    Eagerly, a view of them that runs each op through TensorFlow's op-by-op eager path. TF 2.21 runs
    every eager op as a one-op function: Python makes its context with run_eager_op_as_function on and
    offers no switch, and each call then goes through the function runtime (looking up the op's cached
    function kernel alone took a tenth of an eager 4 KiB all_reduce's CPU time on 2 workers). The C API
    keeps the op-by-op path, which is the default of contexts it makes, and a setter for the flag. Each
    eager collective turns the flag off just for its own dispatch and back on after it (the two calls cost
    under 1 us): about 10-15 us less CPU per call on the 2-core VM, where blocks of back-to-back eager
    4 KiB all_reduces, with and without, took 34-51 against 47-73 us a call on one worker and 98-109
    against 93-133 us on two (benchmarks/results/allreduce_history.md). Another thread's eager op
    dispatched in that window also runs op by op, the path every context made through TF's C API takes
    by default: its result is the same, only its speed and its error's wording differ (no
    "{{function_node __wrapped__<Op>...}}" prefix, as for the collectives now). KUNGFU_EAGER_OP_BY_OP=0
    keeps TF's default. In a graph the ops are only built, so nothing changes there."""
    module = _lib.op_module()
    if not eager or _set_op_as_function is None or not _OP_BY_OP:
        return module
    view = _op_by_op_views.get(module)
    if view is None:
        view = _op_by_op_views.setdefault(module, _OpByOp(module))
    return view


class _OpByOp:
    """A generated op module's functions, each run with run_eager_op_as_function off (see ops())."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):  # first use of each op; then the instance attribute set here is found
        module = self._module
        getattr(module, name)  # AttributeError now for an op the module lacks

        def run(*args, **kwargs):
            fn = getattr(module, name)  # looked up per call, so that what replaces it there (a test's spy) runs
            handle = _eager_context.context()._handle
            _set_op_as_function(handle, False)
            try:
                return fn(*args, **kwargs)
            finally:
                _set_op_as_function(handle, True)  # TF's setting for every context Python makes

        run.__name__ = name
        setattr(self, name, run)
        return run


def key_tensor(op, name, eager=None):
    """collective_key(op, name) as the ops' `key` input: a scalar string tensor."""
    if eager is None:
        eager = tf.executing_eagerly()
    key = collective_key(op, name, eager)
    if not eager:
        return key
    # Eagerly, a tensor (not a str) keeps the op on TF's fast path: about 100 us less per call. Making
    # the tensor costs about 50 us itself, so they are kept: keys, derived ones included, recur every step.
    t = _eager_keys.get(key)  # one dict read is atomic; the lock guards the check-and-clear below
    if t is None:
        t = tf.constant(key)
        with _lock:
            if len(_eager_keys) >= _MAX_EAGER_KEYS:
                _eager_keys.clear()
            _eager_keys[key] = t
    return t


# The branch graphs of one tf.cond or tf.switch_case are named "<scope>_true_<uid>", "<scope>_false_<uid>",
# "<scope>_branch<i>_<uid>", after the cond's own (unique) name scope.
_BRANCH_SUFFIX = re.compile(r"_(?:true|false|branch\d+)_\d+$")


def _arms(graph):
    """Where graph lies inside its tf.function: for each control-flow body from the outermost down, (which
    control-flow op, which body). Bodies of one cond share the first and are exclusive: only one runs."""
    path = []
    while type(graph).__name__ in CONTROL_FLOW_GRAPHS and getattr(graph, "outer_graph", None) is not None:
        name = graph.name
        if type(graph).__name__ == "CondBranchFuncGraph":
            path.append((id(graph.outer_graph), _BRANCH_SUFFIX.sub("", name), name))
        else:  # a while loop's condition and body both run, one after the other, with the rest in flight
            path.append((id(graph.outer_graph), name, name))
        graph = graph.outer_graph
    return tuple(reversed(path))


def _exclusive(a, b):
    """Whether collectives at arms a and b can never run in one call: they part in two bodies of one cond."""
    for x, y in zip(a, b):
        if x == y:
            continue
        return x[:2] == y[:2]
    return False  # one lies inside the other


def numbered(graph, key):
    """key, the first time it is asked for in graph's tf.function; then key + "/2", "/3", ... (trace order)."""
    with _lock:
        counts = _numbered_keys.setdefault(function_graph(graph), collections.Counter())
        counts[key] += 1
        n = counts[key]
    return key if n == 1 else f"{key}/{n}"


def _claim(graph, name, op):
    # Collectives of one tf.function are in flight together, control-flow bodies included, and two with one
    # key would be matched across workers in whatever order they happen to start; the exclusive branches
    # of one cond may share a name.
    arms = _arms(graph)
    with _lock:
        claims = _explicit_names.setdefault(function_graph(graph), {})
        for other in claims.get(name, ()):
            if not _exclusive(arms, other):
                raise ValueError(
                    f"{op}: name {name!r} is already used by another collective in this tf.function (control-flow "
                    "bodies included); collectives that run together need distinct names (only the branches of "
                    "one tf.cond or tf.switch_case may share one)")
        claims.setdefault(name, []).append(arms)


def token(eager=None):
    """A fresh ordering token for one collective call."""
    if not (tf.executing_eagerly() if eager is None else eager):
        _mark_holding(tf.compat.v1.get_default_graph())
        with tf.device("CPU:0"):
            handle = tf.raw_ops.VarHandleOp(dtype=tf.int32, shape=[], shared_name="kungfu_token")
            # Not differentiable, so that walks for variables along differentiable ops (tf.custom_gradient's
            # around a collective, which has a gradient) stop here instead of taking it for a variable.
            return tf.raw_ops.StopGradient(input=handle)
    global _token_variable
    variable = _token_variable  # set once; the lock is for the first call only
    if variable is None:
        with _lock:
            if _token_variable is None:
                with tf.init_scope(), tf.device("CPU:0"):
                    _token_variable = tf.Variable(0, trainable=False, name="kungfu_token", dtype=tf.int32)
            variable = _token_variable
    return variable.handle


# Calls of functions that hold collectives. A tf.function called from another one is a call op, which
# TensorFlow's automatic control dependencies order after the previous stateful op only when it takes no
# resource input; one that reads a captured variable takes that variable, and two calls of it would then
# run together, their collectives (one key) meeting the other workers' in either order. So every call of
# a function that holds a collective (directly or through its own calls), and every tf.cond, tf.while_loop
# or tf.switch_case whose branches, body or condition hold one, also "writes" one sentinel tensor of the
# calling graph: they run one after another, in program order. Functions holding
# collectives are marked when a collective's token is made in them (token()), and a function calling one
# is marked when this resolver sees the call, before the caller's own calls are resolved.
_HOLDS = "_kungfu_holds_collectives"
_SENTINEL = "_kungfu_call_order"  # the calling graph's sentinel tensor (an attribute: a dict keyed by the
#                                   graph, holding a tensor of that graph, would keep every graph alive)
_CALL_OPS = frozenset({"StatefulPartitionedCall", "PartitionedCall"})
# Control flow runs functions too (its branches, bodies and conditions), by these attributes.
_FUNCTION_ATTRS = {"If": ("then_branch", "else_branch"), "StatelessIf": ("then_branch", "else_branch"),
                   "While": ("cond", "body"), "StatelessWhile": ("cond", "body"),
                   "Case": ("branches",), "StatelessCase": ("branches",)}


def _mark_holding(graph):
    for g in (graph, function_graph(graph)):
        try:
            setattr(g, _HOLDS, True)
        except AttributeError:  # a graph that takes no attributes: only calls from it are left unordered
            pass


def _called_graphs(op):
    """The FuncGraphs that op runs: a call's function, or a control-flow op's branches, bodies and
    condition; those TF does not keep are left out."""
    if op.type in _CALL_OPS:
        names = [op.get_attr("f").name]
    elif op.type in _FUNCTION_ATTRS:
        names = []
        for attr in _FUNCTION_ATTRS[op.type]:
            value = op.get_attr(attr)
            names += [f.name for f in value] if isinstance(value, list) else [value.name]
    else:
        return []
    graphs = []
    for name in names:
        try:
            graph = getattr(op.graph._get_function(name), "graph", None)
        except (AttributeError, ValueError, KeyError):
            graph = None
        if graph is not None:
            graphs.append(graph)
    return graphs


def _order_calls(op, reads, writes):
    """An auto-control-dependency resource resolver (see above): True when it added the sentinel."""
    if op.type not in _CALL_OPS and op.type not in _FUNCTION_ATTRS:
        return False
    if not any(getattr(g, _HOLDS, False) for g in _called_graphs(op)):
        return False
    _mark_holding(op.graph)
    sentinel = getattr(op.graph, _SENTINEL, None)
    if sentinel is None:
        with op.graph.as_default(), tf.control_dependencies(None):
            sentinel = tf.constant(0, name="kungfu_call_order")
        setattr(op.graph, _SENTINEL, sentinel)
    if sentinel in writes:
        return False
    writes.add(sentinel)
    return True


try:
    from tensorflow.python.framework.auto_control_deps import register_acd_resource_resolver as _register
except ImportError:  # a TF without it (tests/test_ops_naming.py fails): nested calls stay unordered
    _register = None
if _register is not None:
    _register(_order_calls)
