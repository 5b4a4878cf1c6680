"""PolicyCallback on one process: the learning rate it sets and the stop it makes in model.fit, across
several fits, and for policies compiled into the optimizer. The runner itself: test_policy_runner.py.
"""

import keras
import pytest

import kungfu
from kungfu import optimizers
from kungfu.policies import BasePolicy
from policy_util import HalveLrOnce, Recorder, model_and_data

pytestmark = pytest.mark.usefixtures("kungfu_library")


@pytest.fixture(autouse=True, scope="module")
def cluster_of_one():
    kungfu.init()


def test_policy_callback_changes_the_learning_rate_and_stops_fit():
    model, x, y = model_and_data()
    opt = optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.1))
    model.compile(optimizer=opt, loss="mse")
    cb = kungfu.keras.PolicyCallback([HalveLrOnce(at=3, stop_at=7, interval=1)])
    steps = []

    class Count(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            steps.append(float(self.model.optimizer.learning_rate.numpy()))

    model.fit(x, y, batch_size=4, epochs=5, verbose=0, callbacks=[Count(), cb])
    # Count runs before the policy: step 3's rate is read before the policy halves it after step 3.
    assert steps == pytest.approx([0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.05])  # 4 steps an epoch; stopped after 7
    assert cb.runner.step == 7 and cb.runner.stopped


class StopAt(BasePolicy):
    def __init__(self, step):
        self.step = step

    def after_step(self, ctx):
        if ctx.step == self.step:
            ctx.stop()


def test_policy_callback_given_to_later_fits_goes_on_counting_and_forgets_the_stop():
    import kungfu.policies as kp

    model, x, y = model_and_data()
    opt = optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.1))
    model.compile(optimizer=opt, loss="mse")
    recorder = Recorder()
    cb = kungfu.keras.PolicyCallback([recorder, kp.scheduled({0: {"learning_rate": 0.1}, 2: {"learning_rate": 0.01}},
                                                             by="epoch"), StopAt(6)])
    model.fit(x, y, batch_size=4, epochs=5, verbose=0, callbacks=[cb])  # stopped after step 6, in epoch 1
    assert cb.runner.step == 6 and cb.runner.epoch == 2
    for _ in range(2):  # a fit(epochs=1) loop: Keras numbers each fit's epoch 0
        model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[cb])
    epochs = [epoch for hook, step, epoch in recorder.calls if hook == "before_epoch"]
    assert epochs == [0, 1, 2, 3]
    assert cb.runner.step == 14  # later fits run whole epochs: the stop of the first is forgotten
    assert float(opt.learning_rate.numpy()) == pytest.approx(0.01)  # epoch 2's entry, not entry 0 again
    model.fit(x, y, batch_size=4, initial_epoch=4, epochs=5, verbose=0, callbacks=[cb])  # numbered by Keras
    assert [e for h, s, e in recorder.calls if h == "before_epoch"][-1] == 4
    model.fit(x, y, batch_size=4, initial_epoch=1, epochs=2, verbose=0, callbacks=[cb])  # taken as given
    assert [e for h, s, e in recorder.calls if h == "before_epoch"][-1] == 1


def test_policy_callback_given_to_another_model_controls_that_model_and_starts_over():
    """A callbacks list reused across models (k-fold): each fit's model's optimizer is the one changed, the
    counts start from its steps, and the policies' memory (HalveLrOnce's "done") is cleared."""
    cb = kungfu.keras.PolicyCallback([HalveLrOnce(at=2, interval=1)])
    opts = []
    for fold in range(2):
        model, x, y = model_and_data(seed=fold)
        opts.append(optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.1)))
        model.compile(optimizer=opts[-1], loss="mse")
        model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[cb])
        assert cb.runner.controls.optimizer is opts[-1] and cb.runner.step == 4
    assert [float(o.learning_rate.numpy()) for o in opts] == pytest.approx([0.05, 0.05])


def test_policy_callback_counts_from_a_used_optimizer_wrapped_by_hand():
    """DistributedOptimizer(model.optimizer) of a restored model is built (its state copied) only at the
    first step, after the callback starts counting: the count still starts at the restored step."""
    import kungfu.policies as kp

    model, x, y = model_and_data()
    model.compile(optimizer=keras.optimizers.SGD(0.3), loss="mse")
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)  # 4 steps of a plain optimizer, as a restored one has
    model.compile(optimizer=optimizers.DistributedOptimizer(model.optimizer), loss="mse")
    cb = kungfu.keras.PolicyCallback([kp.scheduled({0: {"learning_rate": 0.1}, 6: {"learning_rate": 0.01}})])
    lrs = []

    class Count(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            lrs.append(float(self.model.optimizer.learning_rate.numpy()))

    model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[cb, Count()])
    assert cb.runner.history[0][:3] == (4, 0, "before_train")  # resumed at step 4, caught up there
    assert lrs == pytest.approx([0.1, 0.1, 0.01, 0.01])  # steps 5, 6, then entry 6's from step 7
    assert cb.runner.step == int(model.optimizer.iterations.numpy()) == 8


def test_policy_callback_stops_fit_for_a_policy_compiled_into_the_optimizer():
    model, x, y = model_and_data()
    opt = optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.1),
                                             policies=[HalveLrOnce(at=99, stop_at=3, interval=1)])
    model.compile(optimizer=opt, loss="mse")
    cb = kungfu.keras.PolicyCallback([])
    model.fit(x, y, batch_size=4, epochs=5, verbose=0, callbacks=[cb])
    assert cb.runner.step == 3 and opt.policy_stopped
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[cb])  # a new fit starts unstopped
    assert cb.runner.step == 4 and opt.policy_stopped  # and the policy, still past step 3, stops it again
    assert not optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.1)).policy_stopped


def test_policy_callback_refuses_several_steps_per_execution():
    model, x, y = model_and_data()
    model.compile(optimizer=optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.1)), loss="mse",
                  steps_per_execution=4)
    with pytest.raises(ValueError, match="steps_per_execution=1"):
        model.fit(x, y, batch_size=4, epochs=1, verbose=0,
                  callbacks=[kungfu.keras.PolicyCallback([HalveLrOnce(at=3, interval=1)])])
