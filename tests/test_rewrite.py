"""kungfu.rewrite: the S-SGD graph rewrite of a training step (python/kungfu/_rewrite, docs/rewrite.md).

In this process (a cluster of one, kungfu.init() with no launcher): which collectives the rewritten
graph holds, bit-exact results against the original step, the errors, one rewrite per input signature,
the pass extension point, and the TF/Keras conventions the rewrite relies on. Across processes (kfrun,
np 2 and 4, one launch each running every check of tests/rewrite_worker.py): N workers on shards end
with the weights of one process on the combined batch, and the rewrite matches the hand-written
all-reduce step.
"""

import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import kungfu
from conftest import REPO
from kungfu._rewrite import _conventions as conv
from kungfu._rewrite import core, find
from kungfu._rewrite.ssgd import ssgd
from mp import assert_checks_passed, launch

pytestmark = pytest.mark.usefixtures("kungfu_library")  # fails, naming the fix, when it is not built

KF_OPS = {"KfAllReduce", "KfGroupAllReduce", "KfAllGather", "KfBroadcast", "KfBarrier", "KfConsensus"}


@pytest.fixture(scope="module", autouse=True)
def initialized():
    kungfu.init()


def model_and_optimizer(kind, optimizer="sgd", **opt_args):
    keras.utils.set_random_seed(3)
    if kind == "mlp":
        layers = [keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)]
    elif kind == "bn":  # state written in the forward pass (moving statistics, the dropout seed)
        layers = [keras.Input((6,)), keras.layers.Dense(8), keras.layers.BatchNormalization(),
                  keras.layers.Dropout(0.2), keras.layers.Dense(3)]
    elif kind == "shared":  # a layer called twice: the tape sums its two partial gradients (convention 7)
        inputs, dense = keras.Input((6,)), keras.layers.Dense(6, activation="tanh")
        return keras.Model(inputs, keras.layers.Dense(3)(dense(dense(inputs)))), make_optimizer(optimizer, **opt_args)
    else:  # tf.gather on the embedding: an IndexedSlices gradient
        layers = [keras.Input((5,), dtype="int32"), keras.layers.Embedding(20, 4), keras.layers.Flatten(),
                  keras.layers.Dense(3)]
    return keras.Sequential(layers), make_optimizer(optimizer, **opt_args)


def make_optimizer(name, **opt_args):
    if name == "adam":
        return keras.optimizers.Adam(0.01, **opt_args)
    if name == "nadam":  # its u_product is a trainable variable updated without a gradient
        return keras.optimizers.Nadam(0.01, **opt_args)
    return keras.optimizers.SGD(0.1, **opt_args)


def train_step(model, opt):
    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return {"loss": loss, "grad_norm": tf.linalg.global_norm(grads)}

    return train_step


def batch(kind, rows=8, seed=0):
    rng = np.random.default_rng(seed)
    if kind == "embedding":
        x = rng.integers(0, 20, (rows, 5), np.int32)
    else:
        x = rng.normal(size=(rows, 6)).astype(np.float32)
    return tf.constant(x), tf.constant(rng.normal(size=(rows, 3)).astype(np.float32))


def kf_ops(concrete):
    return sorted(op.type for op in concrete.graph.get_operations() if op.type in KF_OPS)


def test_rewritten_graph_all_reduces_dense_gradients():
    step = kungfu.rewrite(train_step(*model_and_optimizer("mlp")))
    x, y = batch("mlp")
    assert kf_ops(step.get_concrete_function(x, y)) == ["KfGroupAllReduce"]  # 4 gradients, one bucket
    report = step.report(x, y)
    assert [c.op for c in report.inserted] == ["group_all_reduce"]
    assert report.inserted[0].key == "kungfu.rewrite/train_step/ssgd/0"
    assert len(report.inserted[0].variables) == 4 and [k for _, k in report.gradients] == ["dense"] * 4


def test_sparse_gradient_is_all_gathered():
    step = kungfu.rewrite(train_step(*model_and_optimizer("embedding")))
    x, y = batch("embedding")
    assert kf_ops(step.get_concrete_function(x, y)) == ["KfAllGather", "KfAllGather", "KfGroupAllReduce"]
    assert sorted(k for _, k in step.report(x, y).gradients) == ["dense", "dense", "sparse"]


def test_fusion_bytes_sets_the_buckets():
    x, y = batch("mlp")
    one_each = kungfu.rewrite(train_step(*model_and_optimizer("mlp")), fusion_bytes=0)
    assert kf_ops(one_each.get_concrete_function(x, y)) == ["KfGroupAllReduce"] * 4
    # Backward-pass order: the last layer's bias (12 bytes) is below 16, so its kernel joins its bucket;
    # the first layer's bias (32 bytes) and kernel each fill one.
    small = kungfu.rewrite(train_step(*model_and_optimizer("mlp")), fusion_bytes=16)
    assert [len(c.variables) for c in small.report(x, y).inserted] == [2, 1, 1]


def ancestors(op):
    seen, stack = set(), [op]
    while stack:
        op = stack.pop()
        if op.name not in seen:
            seen.add(op.name)
            stack.extend([t.op for t in op.inputs] + list(op.control_inputs))
    return seen


def test_collectives_can_start_during_the_backward_pass():
    """With one bucket per gradient, the last layer's collective does not wait for the first layer's
    gradient: it may run while the backward pass goes on."""
    step = kungfu.rewrite(train_step(*model_and_optimizer("mlp")), fusion_bytes=0)
    graph = step.get_concrete_function(*batch("mlp")).graph
    collectives = [op for op in graph.get_operations() if op.type == "KfGroupAllReduce"]
    assert len(collectives) == 4
    first, last = collectives[0], collectives[-1]  # in backward-pass order: last layer's bias, first layer's kernel
    assert last.inputs[0].op.name not in ancestors(first)


@pytest.mark.parametrize("kind,optimizer,opt_args,rewrite_args", [
    ("mlp", "sgd", {}, {}), ("mlp", "adam", {}, {}), ("embedding", "sgd", {}, {}), ("embedding", "adam", {}, {}),
    ("bn", "sgd", {"momentum": 0.9}, {}), ("mlp", "adam", {"global_clipnorm": 0.5}, {}), ("shared", "adam", {}, {}),
    ("mlp", "nadam", {}, {}), ("mlp", "sgd", {}, {"compression": "fp16"})])  # nothing sent: nothing rounded
def test_bit_exact_with_one_worker(kind, optimizer, opt_args, rewrite_args):
    original_model, original_opt = model_and_optimizer(kind, optimizer, **opt_args)
    model, opt = model_and_optimizer(kind, optimizer, **opt_args)
    original, rewritten = train_step(original_model, original_opt), kungfu.rewrite(train_step(model, opt),
                                                                                  **rewrite_args)
    for s in range(4):
        x, y = batch(kind, seed=s)
        want, got = original(x, y), rewritten(x, y)
        assert set(got) == {"loss", "grad_norm"}
        for k in want:
            assert got[k].numpy() == want[k].numpy(), (k, s)
    for w, g in zip(original_model.variables, model.variables):
        np.testing.assert_array_equal(g.numpy(), w.numpy(), err_msg=w.path)


def test_one_rewrite_per_input_signature():
    step = kungfu.rewrite(train_step(*model_and_optimizer("mlp")))
    step(*batch("mlp", rows=8))
    step(*batch("mlp", rows=8, seed=1))
    assert step.rewrite_count == 1
    step(*batch("mlp", rows=5))  # a new shape: the traced graph bakes in shape-specific constants
    assert step.rewrite_count == 2
    assert kf_ops(step.get_concrete_function(*batch("mlp", rows=5))) == ["KfGroupAllReduce"]


def test_reduce_retracing_is_kept():
    """A step made with reduce_retracing=True is rewritten twice for many batch sizes (the second time
    with a None batch dimension), as the original is traced, and rewrite_count counts those rewrites."""
    model, opt = model_and_optimizer("mlp")
    original = train_step(model, opt)
    step = kungfu.rewrite(tf.function(original.python_function, reduce_retracing=True))
    for rows in (8, 7, 6, 5):
        step(*batch("mlp", rows=rows))
    assert step.rewrite_count == 2
    concrete = step.get_concrete_function(*batch("mlp", rows=3))
    assert concrete.inputs[0].shape.as_list() == [None, 6] and kf_ops(concrete) == ["KfGroupAllReduce"]
    assert step.rewrite_count == 2 and len(step.report(*batch("mlp", rows=3)).gradients) == 4


def test_integer_step_counter_is_left_alone():
    """TensorFlow makes an integer tf.Variable trainable by default; no gradient can reach it."""
    model, opt = model_and_optimizer("mlp")
    counter = tf.Variable(0, dtype=tf.int64)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        counter.assign_add(1)

    rewritten = kungfu.rewrite(step)
    rewritten(*batch("mlp"))
    assert int(counter.numpy()) == 1 and len(rewritten.report(*batch("mlp")).gradients) == 4


def test_update_before_a_later_gradient_raises():
    """A GAN-style step: update D, then compute G's gradient through the updated D. One cut cannot
    average D's gradient before D's update and keep that update before G's forward pass: without this
    check D would be updated with its local gradient, silently."""
    d, d_opt = model_and_optimizer("mlp")
    g, g_opt = model_and_optimizer("mlp")

    @tf.function
    def gan_step(x, y):
        with tf.GradientTape() as tape:
            d_loss = tf.reduce_mean(tf.square(d(x) - y))
        d_opt.apply_gradients(zip(tape.gradient(d_loss, d.trainable_variables), d.trainable_variables))
        with tf.GradientTape() as tape:
            g_loss = tf.reduce_mean(tf.square(g(x) + d(x) - y))
        g_opt.apply_gradients(zip(tape.gradient(g_loss, g.trainable_variables), g.trainable_variables))

    kernel = conv.variable_name(d.trainable_variables[0])
    with pytest.raises(ValueError, match=rf"(?s)kungfu.rewrite\(gan_step\): some updates come before later gradients.*"
                                         rf"  - {kernel} is updated \(.*DistributedGradientTape"):
        kungfu.rewrite(gan_step)(*batch("mlp"))


def test_plain_python_function_and_no_outputs():
    model, opt = model_and_optimizer("mlp")
    before = [v.numpy() for v in model.trainable_variables]

    def step(x, y):  # not a tf.function, returns nothing
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    assert kungfu.rewrite(step)(*batch("mlp")) is None
    assert all(not np.array_equal(b, v.numpy()) for b, v in zip(before, model.trainable_variables))


def test_gradient_count_differing_from_updates_raises():
    model, opt = model_and_optimizer("mlp")
    scale = tf.Variable(1.0, name="scale")  # trainable, updated without a gradient

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        scale.assign_add(1.0)
        return loss

    with pytest.raises(ValueError, match=r"kungfu.rewrite\(step\): found 4 gradient\(s\) for 5 updated trainable "
                                         r"variable\(s\):\n  - scale is updated \(AssignAddVariableOp"):
        kungfu.rewrite(step)(*batch("mlp"))


def test_an_update_from_local_data_beside_the_gradient_step_raises():
    v = tf.Variable(tf.ones((3, 1)), name="v")
    opt = keras.optimizers.AdamW(0.1, weight_decay=0.01)  # its decay is an update without a gradient: fine

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((x @ v - y) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, [v]), [v]))
        v.assign_add(0.01 * tf.reduce_mean(x) * tf.ones_like(v))  # each worker's own x: no average
        return loss

    with pytest.raises(ValueError, match=r"v is also updated \(AssignAddVariableOp '[^']+'\) from this worker's data \('x'\) "
                                         r"without a gradient"):
        kungfu.rewrite(step)(tf.ones((4, 3)), tf.ones((4, 1)))

    @tf.function
    def decayed(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((x @ v - y) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, [v]), [v]))
        v.assign(v * 0.99)  # from the variable alone: the same on every worker
        return loss

    assert kf_ops(kungfu.rewrite(decayed).get_concrete_function(tf.ones((4, 3)), tf.ones((4, 1))))


def test_a_gradient_scaled_by_local_data_raises():
    v = tf.Variable(tf.ones((3, 1)), name="v")
    opt = keras.optimizers.SGD(0.1)

    def step_of(count):
        @tf.function
        def step(x, y, mask, lr):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(mask * (x @ v - y) ** 2)
            grads = [g / count(mask) * lr for g in tape.gradient(loss, [v])]  # lr: a scalar argument, shared
            opt.apply_gradients(zip(grads, [v]))
            return loss

        return step

    args = tf.ones((4, 3)), tf.ones((4, 1)), tf.ones((4, 1)), tf.constant(1.0)
    # This worker's count of real rows: the averaged gradient divided by a count each worker has its own.
    with pytest.raises(ValueError, match=r"the updates of v depend on this worker's data \('mask'\) besides their "
                                         r"gradients .*\(kungfu.all_reduce the count\)"):
        kungfu.rewrite(step_of(tf.reduce_sum))(*args)
    # The count made the same everywhere: its collective is not the gradients' (no "already averages").
    shared = kungfu.rewrite(step_of(lambda m: kungfu.all_reduce(tf.reduce_sum(m), op="mean", name="count")))
    assert kf_ops(shared.get_concrete_function(*args)) == ["KfAllReduce", "KfGroupAllReduce"]


def test_a_nested_forward_function_has_its_gradients_found():
    model, opt = model_and_optimizer("mlp")
    forward = tf.function(lambda x: model(x))

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(forward(x) - y))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    x, y = batch("mlp")
    sites = find.find_gradients(step.get_concrete_function(x, y), "step")
    # Each variable's gradient is an output of the backward call, not the activations' gradient it takes.
    graph = step.get_concrete_function(x, y).graph
    assert sorted(s.name for s in sites) == sorted(v.path for v in model.trainable_variables)
    assert all(conv.is_backward_call(graph.get_tensor_by_name(s.values).op) for s in sites), sites
    assert kf_ops(kungfu.rewrite(step).get_concrete_function(x, y)) == ["KfGroupAllReduce"]


def test_one_gradient_applied_to_two_variables_raises():
    a, b = tf.Variable(tf.ones([3]), name="a"), tf.Variable(tf.ones([3]), name="b")
    opt = keras.optimizers.SGD(0.1)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(a * x)
        (g,) = tape.gradient(loss, [a])
        opt.apply_gradients([(g, a), (g, b)])

    with pytest.raises(ValueError, match=r"(?s)found 1 gradient\(s\) for 2 .*feeds the updates of 2 variables: a, b"):
        kungfu.rewrite(step)(tf.ones([3]))


def test_function_without_gradients_raises():
    model, _ = model_and_optimizer("mlp")

    @tf.function
    def evaluate(x, y):
        return tf.reduce_mean(tf.square(model(x) - y))

    with pytest.raises(ValueError, match=r"kungfu.rewrite\(evaluate\): found no gradients .*tf.GradientTape"):
        kungfu.rewrite(evaluate)(*batch("mlp"))


def test_gradients_inside_a_loop_raise_naming_the_loop():
    model, opt = model_and_optimizer("mlp")

    @tf.function
    def steps(x, y):
        for _ in tf.range(2):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x) - y))
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    with pytest.raises(ValueError, match=r"The step calls While .*compute and apply the gradients at the top level"):
        kungfu.rewrite(steps)(*batch("mlp"))


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"strategy must be one of ssgd; got 'sma'"):
        kungfu.rewrite(lambda: None, strategy="sma")
    with pytest.raises(ValueError, match=r"fusion_bytes must be an int >= 0"):
        kungfu.rewrite(lambda: None, fusion_bytes=-1)
    with pytest.raises(TypeError, match=r"fn must be a tf.function"):
        kungfu.rewrite(3)
    with pytest.raises(TypeError, match=r"fn is a rewritten step already"):
        kungfu.rewrite(kungfu.rewrite(lambda: None))


def test_a_pass_can_add_ops_before_the_reduction():
    """The extension point (kungfu/_rewrite/passes.py): a monitor pass sees the local gradients, adds a
    stateful op that nothing consumes (it still runs), and hands them on to the S-SGD pass."""
    norm = tf.Variable(0.0, trainable=False)

    def monitor(grads, ctx):
        norm.assign(tf.linalg.global_norm([g.values for g in grads]))
        return grads

    original_model, original_opt = model_and_optimizer("mlp")
    model, opt = model_and_optimizer("mlp")
    step = core.Rewritten(train_step(model, opt), (monitor, ssgd), {"fusion_bytes": None})
    x, y = batch("mlp")
    want, got = train_step(original_model, original_opt)(x, y), step(x, y)
    assert norm.numpy() == want["grad_norm"].numpy() == got["grad_norm"].numpy()
    for w, g in zip(original_model.variables, model.variables):
        np.testing.assert_array_equal(g.numpy(), w.numpy())


def test_a_pass_must_return_one_gradient_each():
    step = core.Rewritten(train_step(*model_and_optimizer("mlp")), (lambda grads, ctx: grads[1:],), {})
    with pytest.raises(ValueError, match=r"pass <lambda> must return a list of 4 Gradients, got list of 3"):
        step(*batch("mlp"))


def test_tf_conventions_hold():
    """What kungfu/_rewrite/_conventions.py assumes about TF and Keras graphs. If this fails after an
    upgrade, the message names the assumption; update _conventions.py (and find.py) to match."""
    model, opt = model_and_optimizer("embedding")
    x, y = batch("embedding")
    cf = train_step(model, opt).get_concrete_function(x, y)
    ops = cf.graph.get_operations()
    assert any(conv.in_gradient_scope(op.name) for op in ops), \
        "1: tf.GradientTape no longer builds the backward pass under a 'gradient_tape' name scope"
    args, captures = conv.split_inputs(cf)
    assert [t.name for t in args] == ["x:0", "y:0"], "5: a ConcreteFunction's inputs no longer start with its arguments"
    if hasattr(cf.graph, "captures"):  # TF's own pairing of captured tensors and their placeholders
        assert [(id(e), i.name) for e, i in cf.graph.captures] == [(id(e), i.name) for e, i in
                                                                    zip(cf.captured_inputs, captures)], \
            "5: a ConcreteFunction's capture placeholders are no longer in the order of captured_inputs"
    handles = {i.op.name for e, i in zip(cf.captured_inputs, captures)
               if any(e is v.handle for v in cf.trainable_variables)}
    writes = {op.type for op in ops if op.inputs and op.inputs[0].op.name in handles and "Read" not in op.type
              and "Shape" not in op.type and "Gather" not in op.type}
    assert writes and all(conv.is_variable_write(t) for t in writes), \
        f"2: Keras now updates trainable variables with {sorted(writes)}, which conv.is_variable_write does not know"
    shapes = [op.type for op in ops
              if conv.in_gradient_scope(op.name) and re.search(r"/embedding[^/]*/Shape$", op.name)]
    assert shapes and set(shapes) <= conv.SHAPE_OPS, \
        f"4: the dense shape of an embedding's IndexedSlices gradient now comes from {shapes}, not a SHAPE_OPS op"
    shared_model, shared_opt = model_and_optimizer("shared")
    shared = train_step(shared_model, shared_opt).get_concrete_function(*batch("mlp"))
    sums = [op for op in shared.graph.get_operations() if op.type == "AddN" and not conv.in_gradient_scope(op.name)
            and all(conv.in_gradient_scope(t.op.name) for t in op.inputs)]
    assert len(sums) == 2, "7: the tape no longer sums a twice-used layer's gradients with an AddN outside its scope"
    emb = keras.layers.Embedding(20, 4)
    ids = tf.constant([[1, 2], [3, 4]])
    emb(ids)

    @tf.function
    def shared_embedding(ids):  # looked up twice (IndexedSlices parts); then also tied (a dense part too)
        with tf.GradientTape(persistent=True) as tape:
            h = tf.reduce_sum(emb(ids)) + tf.reduce_sum(emb(ids + 1))
            tied = h + tf.reduce_sum(tf.matmul(emb(ids)[0], emb.embeddings, transpose_b=True))
        return tape.gradient(h, emb.embeddings), tape.gradient(tied, emb.embeddings)

    joins, backward = [], set()
    for op in shared_embedding.get_concrete_function(ids).graph.get_operations():
        if conv.in_gradient_scope(op.name):
            backward.add(op.name)
        elif summed := conv.gradient_sum_ops(op, backward):
            backward.update(o.name for o in summed)
            joins.append((op.type, len(summed) > 1))
    assert ("ConcatV2", False) in joins and ("AddN", True) in joins, \
        f"7: the tape no longer joins an embedding's IndexedSlices gradients as it did (found {joins})"
    forward = tf.function(lambda x: model(x))

    @tf.function
    def nested(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(forward(x))
        return tape.gradient(loss, model.trainable_variables)

    calls = [op for op in nested.get_concrete_function(x).graph.get_operations() if conv.is_backward_call(op)]
    assert len(calls) == 1 and not conv.in_gradient_scope(calls[0].name), \
        "9: the backward pass of a nested tf.function is no longer one call of a '__backward_' function"
    seen = []

    def body(x, y):
        seen.extend(t.name for t in conv.traced_arguments())
        return tf.constant(0)

    tf.function(body, autograph=False).get_concrete_function(x, y=y)
    assert seen == ["x:0", "y:0"], f"6: a traced function's graph inputs at the start of its body are {seen}"
    assert conv.reduce_retracing(tf.function(body, reduce_retracing=True)) and not conv.reduce_retracing(
        tf.function(body)), "8: a tf.function no longer keeps its reduce_retracing in _reduce_retracing"


WORKER = os.path.join(REPO, "tests", "rewrite_worker.py")
CHECKS = ["ssgd_mlp_sgd_matches_combined_batch", "ssgd_mlp_adam_matches_combined_batch",
          "ssgd_embedding_sgd_matches_combined_batch", "ssgd_embedding_adam_matches_combined_batch",
          "ssgd_embedding_looked_up_twice_matches_combined_batch", "ssgd_tied_embedding_matches_combined_batch",
          "ssgd_one_collective_per_gradient_matches_combined_batch", "ssgd_nested_forward_function_matches_combined_batch",
          "rewrite_equals_hand_written_all_reduce",
          "sparse_rows_differ_across_workers", "rewrite_equals_synchronous_sgd_optimizer",
          "tape_jacobians_stay_local", "rewrite_refuses_a_step_with_distributed_gradient_tape",
          "rewrite_refuses_a_step_with_synchronous_sgd_optimizer"]


@pytest.mark.parametrize("np_", [2, 4])
def test_ssgd_across_workers(np_, tmp_path):
    code, out = launch(np_, [WORKER], tmp_path, timeout=60, budget=300)
    assert_checks_passed(code, out, CHECKS, np_)
