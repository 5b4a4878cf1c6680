"""The training API on one process (a cluster of size 1): argument errors, the strategy switch,
Keras integration (compile, fit, save and load), DistributedGradientTape, broadcast_variables and the
gradient buckets. The Keras callbacks are in test_callbacks.py; multi-worker behaviour is in
test_training_mp.py.
"""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import kungfu
import kungfu.keras
from kungfu import optimizers
from kungfu.keras import callbacks
from kungfu.optimizers import _reduce
from small_model import model_and_data

pytestmark = pytest.mark.usefixtures("kungfu_library")


@pytest.fixture(autouse=True, scope="module")
def cluster_of_one():
    kungfu.init()


def test_wrapper_is_the_base_optimizer_with_its_config():
    base = keras.optimizers.Adam(learning_rate=0.003, beta_1=0.8)
    opt = optimizers.SynchronousSGDOptimizer(base)
    assert isinstance(opt, keras.optimizers.Adam) and isinstance(opt, optimizers.DistributedMixin)
    assert opt is not base
    assert opt.get_config() == base.get_config()
    assert opt.strategy == "ssgd"
    assert optimizers.SynchronousAveragingOptimizer(keras.optimizers.SGD(), alpha=0.5).strategy == "sma"
    assert optimizers.SynchronousAveragingOptimizer(keras.optimizers.SGD(), alpha=0.5).sma_alpha == 0.5
    assert optimizers.PairAveragingOptimizer(keras.optimizers.SGD()).strategy == "pair_averaging"


@pytest.mark.parametrize("call, error, words", [
    (lambda: optimizers.SynchronousSGDOptimizer(object()), TypeError, "Keras optimizer"),
    (lambda: optimizers.SynchronousSGDOptimizer("adam"), TypeError, "Keras optimizer"),
    (lambda: optimizers.SynchronousSGDOptimizer(optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD())),
     ValueError, "already"),
    (lambda: optimizers.DistributedOptimizer(keras.optimizers.SGD(), strategy="allreduce"), ValueError,
     r"^DistributedOptimizer\(strategy=...\): unknown strategy 'allreduce'; choose .*pair_averaging"),
    (lambda: optimizers.SynchronousAveragingOptimizer(keras.optimizers.SGD(), alpha=0), ValueError, "alpha"),
    (lambda: optimizers.SynchronousAveragingOptimizer(keras.optimizers.SGD(), alpha=1.5), ValueError, "alpha"),
    (lambda: optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(), fusion_bytes=-1), ValueError, "fusion_bytes"),
    (lambda: kungfu.DistributedGradientTape(object()), TypeError, "GradientTape"),
    (lambda: kungfu.broadcast_variables([tf.Variable(1.0), tf.constant(2.0)]), TypeError,
     "item 1 is a .*, not a variable"),
])
def test_bad_arguments_say_what_is_wrong(call, error, words):
    with pytest.raises(error, match=words):
        call()


def test_a_used_optimizer_hands_its_state_to_the_wrapper():
    # One epoch with plain Adam, then the same optimizer wrapped and the model compiled again: the second
    # epoch must be the one an uninterrupted run takes (Adam's step count and moments carried over).
    def fresh():
        model, x, y = model_and_data()
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        return model, x, y

    want, x, y = fresh()
    want.fit(x, y, epochs=2, batch_size=16, shuffle=False, verbose=0)
    model, x, y = fresh()
    model.fit(x, y, epochs=1, batch_size=16, shuffle=False, verbose=0)
    used = model.optimizer
    model.compile(optimizer=optimizers.SynchronousSGDOptimizer(used), loss="mse")
    model.fit(x, y, epochs=1, batch_size=16, shuffle=False, verbose=0)
    assert isinstance(model.optimizer, optimizers.DistributedMixin) and int(model.optimizer.iterations) == 8
    for a, b in zip(model.get_weights(), want.get_weights()):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_a_checkpoint_restored_into_an_unbuilt_optimizer_reaches_the_wrapper(tmp_path):
    # Horovod's order: tf.train.Checkpoint(model=, optimizer=opt).restore(...) with opt not built yet (the
    # restore waits for opt's variables), then opt wrapped. The wrapper used to start from step 0 and zero
    # moments, silently.
    model, x, y = model_and_data()
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.fit(x, y, epochs=1, batch_size=16, shuffle=False, verbose=0)
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(str(tmp_path / "ckpt"))
    model.fit(x, y, epochs=1, batch_size=16, shuffle=False, verbose=0)  # the run to match

    again, _, _ = model_and_data()
    opt = keras.optimizers.Adam(0.01)
    tf.train.Checkpoint(model=again, optimizer=opt).restore(path)
    again.compile(optimizer=optimizers.SynchronousSGDOptimizer(opt), loss="mse")
    again.fit(x, y, epochs=1, batch_size=16, shuffle=False, verbose=0)
    assert int(again.optimizer.iterations) == int(model.optimizer.iterations) == 8
    for a, b in zip(again.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_a_used_optimizer_keeps_its_state_only_for_its_model():
    model, _, _ = model_and_data()
    opt = keras.optimizers.SGD(momentum=0.9)
    opt.build(model.trainable_variables)
    other = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    wrapped = optimizers.SynchronousSGDOptimizer(opt)
    with pytest.raises(ValueError, match="keeps its state only for the model it was used with"):
        wrapped.build(other.trainable_variables)


def test_load_model_resumes_with_a_distributed_optimizer(tmp_path):
    model, x, y = model_and_data()
    model.compile(optimizer=optimizers.SynchronousSGDOptimizer(keras.optimizers.Adam(0.01)), loss="mse",
                  metrics=["mae"])
    model.fit(x, y, epochs=1, batch_size=16, shuffle=False, verbose=0)
    path = os.path.join(tmp_path, "model.keras")
    model.save(path)
    loaded = kungfu.keras.load_model(path, strategy="sma", alpha=0.5)
    assert isinstance(loaded.optimizer, keras.optimizers.Adam)
    assert isinstance(loaded.optimizer, optimizers.DistributedMixin)
    assert (loaded.optimizer.strategy, loaded.optimizer.sma_alpha) == ("sma", 0.5)
    assert int(loaded.optimizer.iterations) == 4
    assert loaded.evaluate(x, y, verbose=0) == model.evaluate(x, y, verbose=0)  # loss and metric kept
    loaded.optimizer.strategy = "ssgd"
    loaded.fit(x, y, epochs=1, batch_size=16, shuffle=False, verbose=0)
    model.fit(x, y, epochs=1, batch_size=16, shuffle=False, verbose=0)
    for a, b in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    plain = kungfu.keras.load_model(path, compile=False)
    assert getattr(plain, "optimizer", None) is None  # not compiled, nothing wrapped


def test_strategy_switch_eagerly_and_in_a_function():
    opt = optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD())
    opt.strategy = "sma"
    assert opt.strategy == "sma" and int(opt.strategy_variable.numpy()) == optimizers.STRATEGIES.index("sma")
    tf.function(lambda: opt.set_strategy("pair_averaging"))()
    assert opt.strategy == "pair_averaging"
    with pytest.raises(ValueError, match="unknown strategy"):
        opt.strategy = "async"
    assert opt.strategy == "pair_averaging"


def test_strategy_from_an_index_or_a_tensor_computed_in_the_step():
    opt = optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD())
    opt.set_strategy(1)  # an index, as ctx.set_strategy takes
    assert opt.strategy == "sma"
    opt.set_strategy(np.int64(2))
    assert opt.strategy == "pair_averaging"
    for bad in (3, -1, True, 1.5):
        with pytest.raises(ValueError, match="unknown strategy"):
            opt.set_strategy(bad)
    step = tf.function(lambda t: opt.set_strategy(t))
    step(tf.constant("pair_averaging"))
    assert opt.strategy == "pair_averaging"
    step(tf.constant(0, tf.int64))
    assert opt.strategy == "ssgd"
    for bad in (tf.constant("async"), tf.constant(3)):
        with pytest.raises(tf.errors.InvalidArgumentError, match="unknown strategy"):
            step(bad)
    assert opt.strategy == "ssgd"
    with pytest.raises(TypeError, match="tf.string name or an integer index"):
        step(tf.constant(1.0))
    with pytest.raises(ValueError, match="must be a scalar"):
        step(tf.constant(["x", "sma"]))
    opt.strategy_variable.assign(5)  # by hand, past every strategy
    assert opt.strategy is None
    opt.strategy = "sma"  # the way out (Keras reads the property before the assignment)
    assert opt.strategy == "sma"


@pytest.mark.parametrize("strategy", optimizers.STRATEGIES)
def test_fit_on_one_worker_equals_the_plain_optimizer(strategy):
    weights = []
    for wrap in (False, True):
        model, x, y = model_and_data()
        opt = keras.optimizers.Adam(0.01)
        if wrap:
            opt = optimizers.DistributedOptimizer(opt, strategy=strategy)
        model.compile(optimizer=opt, loss="mse")
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                  callbacks=[callbacks.BroadcastGlobalVariablesCallback(), callbacks.MetricAverageCallback()]
                  if wrap else [])
        weights.append(model.get_weights())
    for a, b in zip(*weights):
        np.testing.assert_array_equal(a, b)


@keras.saving.register_keras_serializable(package="KungfuTests")
class RegisteredAdam(keras.optimizers.Adam):
    pass


@pytest.mark.parametrize("base", [keras.optimizers.Adam, RegisteredAdam])
@pytest.mark.parametrize("wrap", [optimizers.SynchronousSGDOptimizer, optimizers.PairAveragingOptimizer])
def test_saved_model_loads_with_the_base_optimizer(base, wrap, tmp_path):
    """Also a custom optimizer registered with Keras: its wrapper is saved under the registered name
    ("KungfuTests>RegisteredAdam"), which once was lost and load_model could not find the class."""
    model, x, y = model_and_data()
    model.compile(optimizer=wrap(base(0.01)), loss="mse")
    model.fit(x, y, epochs=1, verbose=0)
    path = os.path.join(tmp_path, "model.keras")
    model.save(path)
    for load in (keras.models.load_model, kungfu.keras.load_model):
        loaded = load(path)
        kind = type(loaded.optimizer)
        if load is kungfu.keras.load_model:  # the base, wrapped again
            assert kind.__mro__[1] is optimizers.DistributedMixin
            kind = kind.__mro__[2]
        assert kind is base
        assert int(loaded.optimizer.iterations) == int(model.optimizer.iterations)
        np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    assert keras.saving.get_registered_object(keras.saving.get_registered_name(base)) in (base, None)


def test_distributed_gradient_tape_keeps_structure_and_values():
    v = {"a": tf.Variable([1.0, 2.0]), "b": tf.Variable(3.0)}

    def grads(wrap):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(v["a"] ** 2) + v["b"] * 4.0
        if wrap:
            tape = kungfu.DistributedGradientTape(tape)
        return tape.gradient(loss, v)

    got, want = grads(True), grads(False)
    assert set(got) == {"a", "b"}
    np.testing.assert_array_equal(got["a"], want["a"])
    np.testing.assert_array_equal(got["b"], want["b"])
    with kungfu.DistributedGradientTape(tf.GradientTape()) as tape:  # the context-manager form
        loss = v["b"] * 2.0
    assert float(tape.gradient(loss, v["b"])) == 2.0
    assert isinstance(tape, tf.GradientTape)  # code that checks for a tape takes it


def test_distributed_gradient_tape_is_the_wrapped_tape():
    """Watching, pausing, persistence and jacobian act on the one recording, through either object."""
    x = tf.constant([1.0, 2.0])
    plain = tf.GradientTape(persistent=True)
    tape = kungfu.DistributedGradientTape(plain)
    with tape:
        tape.watch(x)
        y = x * x
        with tape.stop_recording():
            ignored = x * 10.0
    np.testing.assert_array_equal(tape.gradient(y, x), [2.0, 4.0])
    np.testing.assert_array_equal(tape.gradient(y, x), [2.0, 4.0])  # persistent: a second call works
    assert tape.gradient(ignored, x) is None
    np.testing.assert_array_equal(tape.jacobian(y, x), [[2.0, 0.0], [0.0, 4.0]])
    assert plain.watched_variables() == tape.watched_variables() == ()
    v = tf.Variable(1.0)
    with tf.GradientTape() as plain:  # wrapped inside the block, which then ends on the plain tape
        tape = kungfu.DistributedGradientTape(plain)
        y = v * 3.0
    assert float(tape.gradient(y, v)) == 3.0
    with pytest.raises(ValueError, match="already a kungfu.DistributedGradientTape"):
        kungfu.DistributedGradientTape(tape)


def test_broadcast_variables_keeps_values_on_one_worker():
    variables = [tf.Variable([[1.0, 2.0]]), tf.Variable(7, dtype=tf.int64), tf.Variable(tf.zeros([0]))]
    kungfu.broadcast_variables(variables)
    tf.function(lambda: kungfu.broadcast_variables(variables))()
    assert variables[0].numpy().tolist() == [[1.0, 2.0]] and int(variables[1].numpy()) == 7


def test_buckets_walk_from_the_last_gradient_and_respect_the_size():
    tensors = [tf.zeros([256]), tf.zeros([256]), tf.zeros([1024]), tf.zeros([16])]  # 1 KiB, 1 KiB, 4 KiB, 64 B
    assert _reduce.buckets(tensors, 2048) == [[3], [2], [1, 0]]  # a tensor above the size is a bucket alone
    assert _reduce.buckets(tensors, 0) == [[3], [2], [1], [0]]
    assert _reduce.buckets(tensors, 1 << 20) == [[3, 2, 1, 0]]
    assert _reduce.buckets([], 1024) == []


def test_root_rank_is_horovods_spelling_of_root():
    v = tf.Variable([1.0, 2.0])
    kungfu.broadcast_variables([v], root_rank=0)
    kungfu.broadcast_variables([v], root=0, root_rank=0)
    assert v.numpy().tolist() == [1.0, 2.0]
    assert kungfu.broadcast_object({"a": 1}, root_rank=0) == {"a": 1}
    assert callbacks.BroadcastGlobalVariablesCallback(root_rank=0).root == 0
    assert kungfu.broadcast(tf.constant([3.0]), root_rank=0).numpy().tolist() == [3.0]
    assert tf.function(lambda: kungfu.broadcast(tf.constant([4]), root=0, root_rank=0))().numpy().tolist() == [4]
    for call in (lambda: kungfu.broadcast_variables([v], root=1, root_rank=0),
                 lambda: kungfu.broadcast(tf.constant([1.0]), root=1, root_rank=0),
                 lambda: kungfu.broadcast_object(1, root=0, root_rank=1),
                 lambda: callbacks.BroadcastGlobalVariablesCallback(root=0, root_rank=1)):
        with pytest.raises(ValueError, match="root_rank="):
            call()
    with pytest.raises(ValueError, match="root must be a rank"):
        kungfu.broadcast_object(1, root_rank=3)  # checked as root= is
    with pytest.raises(ValueError, match="root must be a rank"):
        kungfu.broadcast(tf.constant([1.0]), root_rank=3)


def test_load_model_of_a_legacy_h5_file_says_it_kept_no_optimizer_state(tmp_path):
    """Horovod's examples save ModelCheckpoint('checkpoint-{epoch}.h5'); Keras 3 loads such a file with an
    optimizer built over no variables (no slots), which cannot resume: the error names the .keras fix."""
    model, x, y = model_and_data()
    adam = optimizers.SynchronousSGDOptimizer(keras.optimizers.Adam(0.01))
    model.compile(optimizer=adam, loss="mean_squared_error")  # ("mse" does not load from .h5 in Keras 3.15)
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)
    path = os.path.join(tmp_path, "checkpoint-1.h5")
    model.save(path)
    with pytest.raises(ValueError, match=r"no optimizer state.*legacy \.h5.*\.keras"):
        kungfu.keras.load_model(path)
    model, x, y = model_and_data()  # an optimizer with no slots comes back whole, and resumes
    model.compile(optimizer=optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.01)),
                  loss="mean_squared_error")
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)
    model.save(path)
    loaded = kungfu.keras.load_model(path)
    loaded.fit(x, y, epochs=1, batch_size=16, verbose=0)
    assert int(loaded.optimizer.iterations) == 8


@pytest.mark.parametrize("make", [
    lambda: optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.1), compression="fp8"),
    lambda: kungfu.DistributedGradientTape(tf.GradientTape(), compression=16),
    lambda: kungfu.rewrite(lambda: None, compression="half"),
])
def test_an_unknown_compression_is_refused(make):
    with pytest.raises(ValueError, match="compression must be one of none, fp16"):
        make()


def test_a_wrapper_class_made_from_its_config_says_how_to_wrap():
    opt = optimizers.SynchronousSGDOptimizer(keras.optimizers.Adam(0.01))
    clone = type(opt).from_config(opt.get_config())
    with pytest.raises(ValueError, match="made without DistributedOptimizer"):
        clone.apply_gradients([(tf.constant([1.0]), keras.Variable([1.0]))])


def test_loss_scale_optimizer_must_be_inside():
    """Under mixed_float16, model.compile wraps a distributed optimizer in a LossScaleOptimizer, whose
    overflow check would read each worker's own gradients: the first step says how to wrap instead.
    The other way round trains."""
    policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model, x, y = model_and_data()
        model.compile(optimizer=optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)  # Keras put it outside
        with pytest.raises(ValueError, match=r"Wrap the other way round.*LossScaleOptimizer\(opt\)"):
            model.fit(x, y, batch_size=16, epochs=1, verbose=0)
        model, x, y = model_and_data()  # the fix offered keeps the strategy
        model.compile(optimizer=optimizers.SynchronousAveragingOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
        with pytest.raises(ValueError, match=r"LossScaleOptimizer\(opt\), strategy='sma'\)"):
            model.fit(x, y, batch_size=16, epochs=1, verbose=0)
        model, x, y = model_and_data()
        opt = optimizers.SynchronousSGDOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01)))
        model.compile(optimizer=opt, loss="mse")
        assert model.optimizer is opt  # already a LossScaleOptimizer: Keras adds none
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
        assert int(opt.iterations) > 0
    finally:
        keras.mixed_precision.set_global_policy(policy)


def test_accumulation_is_read_where_keras_lets_it_be():
    """gradient_accumulation_steps is the optimizer's own, or for a LossScaleOptimizer (which refuses the
    argument) its inner optimizer's: the wrapper exchanges once per update in both cases
    (tests/training_worker.py counts the collectives)."""
    from kungfu.optimizers import _keras

    plain = optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.1, gradient_accumulation_steps=3))
    assert _keras.accumulating(plain) == (3, plain)
    scaled = optimizers.SynchronousSGDOptimizer(
        keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1, gradient_accumulation_steps=2)))
    assert _keras.accumulating(scaled) == (2, scaled.inner_optimizer)
    assert _keras.accumulating(optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.1))) == (None, None)


class _HalvingSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """A schedule no one registered with Keras: its config alone cannot rebuild it."""

    def __call__(self, step):
        return 0.1 / (1.0 + tf.cast(step, tf.float32))

    def get_config(self):
        return {}


def test_wrapping_keeps_what_a_config_cannot_carry():
    """A custom schedule, a callable rate, AdamW's weight-decay exclusions and a LossScaleOptimizer's
    inner schedule all reach the wrapper as the user made them."""
    schedule = _HalvingSchedule()
    opt = optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(schedule))
    assert opt._learning_rate is schedule
    def step_rate():
        return 0.25

    assert optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(step_rate))._learning_rate is step_rate

    adamw = keras.optimizers.AdamW(0.1, weight_decay=0.5)
    kept = keras.Variable(np.ones(2, np.float32), name="kept_bias")
    adamw.exclude_from_weight_decay(var_list=[kept], var_names=["bias"])
    wrapped = optimizers.SynchronousSGDOptimizer(adamw)
    decayed = keras.Variable(np.ones(2, np.float32), name="decayed_kernel")
    wrapped.apply_gradients([(tf.zeros(2), kept), (tf.zeros(2), decayed)])
    np.testing.assert_allclose(kept.numpy(), [1.0, 1.0])  # excluded: a zero gradient leaves it alone
    assert (decayed.numpy() < 1.0).all()

    lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(schedule))
    wrapped = optimizers.SynchronousSGDOptimizer(lso)
    assert isinstance(wrapped, keras.optimizers.LossScaleOptimizer)
    assert wrapped.inner_optimizer._learning_rate is schedule


class _ScaledSGD(keras.optimizers.SGD):
    """A user's optimizer whose get_config() leaves out its own __init__ argument."""

    def __init__(self, scale=1.0, **kwargs):
        super().__init__(**kwargs)
        self.scale = scale


class _RequiredScaleSGD(_ScaledSGD):
    def __init__(self, scale, **kwargs):
        super().__init__(scale, **kwargs)


def test_a_setting_the_config_leaves_out_is_refused_not_lost():
    with pytest.raises(ValueError, match=r"does not carry scale=0.0 \(rebuilt: 1.0\)"):
        optimizers.SynchronousSGDOptimizer(_ScaledSGD(scale=0.0))
    with pytest.raises(TypeError, match="must return every __init__ argument"):
        optimizers.SynchronousSGDOptimizer(_RequiredScaleSGD(0.5))


def test_a_multi_optimizer_keeps_its_selector_and_the_callers_optimizers():
    """A MultiOptimizer's callable selector and its optimizers (with their exclude_from_weight_decay
    choices) are handed over as they are; its config would serialize them."""
    decayed = keras.optimizers.AdamW(0.1, weight_decay=0.5)
    decayed.exclude_from_weight_decay(var_names=["bias"])
    plain = keras.optimizers.SGD(0.1)
    opt = optimizers.SynchronousSGDOptimizer(keras.optimizers.MultiOptimizer(
        lambda v: decayed if "bias" in v.path else plain))
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, bias_initializer="ones")])
    model.compile(optimizer=opt, loss="mse")
    model.fit(np.zeros((4, 3)), np.ones((4, 2)), verbose=0)  # the bias's gradient is 0: only decay would move it
    np.testing.assert_array_equal(model.layers[0].bias.numpy(), [1.0, 1.0])
