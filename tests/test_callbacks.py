"""kungfu.keras.callbacks on one process (a cluster of size 1): the learning-rate warm-up and schedule
callbacks against Horovod's arithmetic, their arguments, and the metric average with one worker.
Multi-worker behaviour is in test_training_mp.py.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kungfu
import kungfu.keras
from kungfu import optimizers
from kungfu.keras import callbacks
from small_model import model_and_data

pytestmark = pytest.mark.usefixtures("kungfu_library")


@pytest.fixture(autouse=True, scope="module")
def cluster_of_one():
    kungfu.init()


def test_metric_average_callback_leaves_one_worker_logs_alone():
    logs = {"loss": 0.5, "accuracy": np.float32(0.25), "note": "text"}
    callbacks.MetricAverageCallback().on_epoch_end(0, logs)
    assert logs == {"loss": 0.5, "accuracy": np.float32(0.25), "note": "text"}


class _RecordRate(keras.callbacks.Callback):
    """The learning rate each batch trains with (read after the callbacks before it have set it)."""

    def __init__(self):
        super().__init__()
        self.rates = []

    def on_train_batch_begin(self, batch, logs=None):
        self.rates.append(float(self.model.optimizer.learning_rate.numpy()))


def test_warmup_callback_ramps_the_rate_batch_by_batch_then_leaves_it():
    model, x, y = model_and_data()  # 64 samples, batch 16: 4 batches an epoch
    model.compile(optimizer=optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.5)), loss="mse")
    record = _RecordRate()
    warmup = callbacks.LearningRateWarmupCallback(0.4, warmup_epochs=1.5, start_lr=0.1)
    model.fit(x, y, batch_size=16, epochs=3, callbacks=[warmup, record], verbose=0)
    ramp = [0.1 + 0.3 * min(i / 6, 1) for i in range(7)]  # 1.5 epochs = 6 batches, then initial_lr
    assert record.rates == pytest.approx(ramp + [0.4] * 5)
    assert warmup.rate(0, 0) == pytest.approx(0.1) and warmup.rate(9, 0) == pytest.approx(0.4)


def test_warmup_callback_hands_over_to_a_schedule_when_it_ends():
    """Horovod's recipe: warm up, then a schedule from the next epoch. The schedule's rate for the first
    epoch after the warm-up, set in on_epoch_begin, must stand (the warm-up ends at its last batch's end)."""
    model, x, y = model_and_data()  # 4 batches an epoch
    model.compile(optimizer=optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.5)), loss="mse")
    warmup = callbacks.LearningRateWarmupCallback(0.4, warmup_epochs=2, start_lr=0.1)
    schedule = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.02 if epoch >= 2 else lr)
    record = _RecordRate()
    model.fit(x, y, batch_size=16, epochs=4, callbacks=[warmup, schedule, record], verbose=0)
    ramp = [0.1 + 0.3 * i / 8 for i in range(8)]
    assert record.rates == pytest.approx(ramp + [0.02] * 8)
    assert "on_train_batch_end" not in vars(callbacks.LearningRateWarmupCallback)  # Keras's async dispatch stays


def test_warmup_callback_happens_once_and_not_when_fit_starts_past_it():
    model, x, y = model_and_data()
    model.compile(optimizer=optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.5)), loss="mse")
    warmup = callbacks.LearningRateWarmupCallback(0.4, warmup_epochs=1, start_lr=0.1)
    model.fit(x, y, batch_size=16, epochs=2, callbacks=[warmup], verbose=0)
    model.optimizer.learning_rate = 0.05  # as ReduceLROnPlateau would
    record = _RecordRate()
    model.fit(x, y, batch_size=16, epochs=4, initial_epoch=2, callbacks=[warmup, record], verbose=0)
    assert record.rates == pytest.approx([0.05] * 8)
    fresh, record = callbacks.LearningRateWarmupCallback(0.4, warmup_epochs=1), _RecordRate()
    model.fit(x, y, batch_size=16, epochs=3, initial_epoch=2, callbacks=[fresh, record], verbose=0)
    assert record.rates == pytest.approx([0.05] * 4)  # a resumed run past the warm-up keeps its rate


def test_warmup_callback_goes_on_across_fits_that_count_epochs_from_zero():
    """fit(epochs=1) in a loop with one callback warms up as one fit of as many epochs would; a fit with
    initial_epoch where the last one stopped goes on from there too."""
    model, x, y = model_and_data()  # 4 batches an epoch
    model.compile(optimizer=optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.5)), loss="mse")
    warmup, record = callbacks.LearningRateWarmupCallback(0.4, warmup_epochs=2, start_lr=0.1), _RecordRate()
    for _ in range(3):
        model.fit(x, y, batch_size=16, epochs=1, callbacks=[warmup, record], verbose=0)
    assert record.rates == pytest.approx([0.1 + 0.3 * min(i / 8, 1) for i in range(12)])
    warmup, record = callbacks.LearningRateWarmupCallback(0.4, warmup_epochs=2, start_lr=0.1), _RecordRate()
    model.fit(x, y, batch_size=16, epochs=1, callbacks=[warmup, record], verbose=0)
    model.fit(x, y, batch_size=16, epochs=3, initial_epoch=1, callbacks=[warmup, record], verbose=0)
    assert record.rates == pytest.approx([0.1 + 0.3 * min(i / 8, 1) for i in range(12)])


def test_warmup_callback_starts_from_the_rate_over_size():
    model, x, y = model_and_data()
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    warmup = callbacks.LearningRateWarmupCallback(0.2, warmup_epochs=1)
    model.fit(x, y, batch_size=32, epochs=1, callbacks=[warmup], verbose=0)
    assert warmup.rate(0, 0) == pytest.approx(0.2 / kungfu.size())


@pytest.mark.parametrize("call, words", [
    (lambda: callbacks.LearningRateWarmupCallback(0), "initial_lr must be a number > 0"),
    (lambda: callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=-1), "warmup_epochs must be"),
    (lambda: callbacks.LearningRateWarmupCallback(0.1, steps_per_epoch="4"), "steps_per_epoch must be"),
])
def test_warmup_callback_bad_arguments(call, words):
    with pytest.raises(ValueError, match=words):
        call()


# The two rate callbacks, made with their defaults and any keyword arguments a test adds.
RATE_CALLBACKS = [
    lambda **kw: callbacks.LearningRateWarmupCallback(0.1, **kw),
    lambda **kw: callbacks.LearningRateScheduleCallback(0.1, 1., **kw),
]


@pytest.mark.parametrize("make", RATE_CALLBACKS)
def test_rate_callbacks_refuse_a_learning_rate_schedule(make):
    model, x, y = model_and_data()
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.9)
    model.compile(optimizer=keras.optimizers.SGD(schedule), loss="mse")
    with pytest.raises(ValueError, match="must be a number, not a LearningRateSchedule"):
        model.fit(x, y, batch_size=16, epochs=1, callbacks=[make()], verbose=0)


def test_warmup_callback_refuses_an_unknown_epoch_length():
    model, x, y = model_and_data()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    unknown_length = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda a, b: True).batch(16)
    with pytest.raises(ValueError, match="pass steps_per_epoch"):
        model.fit(unknown_length, epochs=1, callbacks=[callbacks.LearningRateWarmupCallback(0.1)], verbose=0)
    model.fit(unknown_length, epochs=1, verbose=0,
              callbacks=[callbacks.LearningRateWarmupCallback(0.1, steps_per_epoch=4)])


def _horovod_schedule(initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True, steps=4):
    """Horovod's LearningRateScheduleCallbackImpl (horovod/_keras/callbacks.py) without momentum correction: the
    rate it sets at the start of batch `batch` of epoch `epoch`, or None where it sets none."""
    if not callable(multiplier):  # Horovod: a constant multiplier makes it a staircase
        staircase, constant = True, multiplier
        multiplier = lambda epoch: constant  # noqa: E731

    def rate(epoch, batch):
        if epoch < start_epoch or end_epoch is not None and epoch >= end_epoch:
            return None
        if staircase:
            return initial_lr * multiplier(epoch) if batch == 0 else None
        return initial_lr * multiplier(epoch + batch / steps)

    return rate


def _horovod_warmup(initial_lr, warmup_epochs, size, steps=4):
    """Horovod's LearningRateWarmupCallback on `size` workers: a schedule of the position after the batch."""
    def multiplier(epoch):
        epoch += 1. / steps
        return 1. / size * (epoch * (size - 1) / warmup_epochs + 1)

    return _horovod_schedule(initial_lr, multiplier, 0, warmup_epochs, staircase=False, steps=steps)


def _horovod_rates(schedules, epochs, lr, steps=4):
    """The rate of every batch under Horovod's callbacks, called in list order at each batch's start."""
    rates = []
    for epoch in range(epochs):
        for batch in range(steps):
            for schedule in schedules:
                r = schedule(epoch, batch)
                lr = lr if r is None else r
            rates.append(lr)
    return rates


def test_schedule_callback_chained_after_the_warmup_as_horovods_resnet_example():
    """keras_imagenet_resnet50.py's chain: warm-up, then 1x until epoch 3, 0.1x until 4, 0.01x after. Past the
    warm-up every batch has Horovod's rate; in it each batch has the rate Horovod gives the batch before."""
    model, x, y = model_and_data()  # 4 batches an epoch
    model.compile(optimizer=optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.5)), loss="mse")
    record = _RecordRate()
    chain = [callbacks.LearningRateWarmupCallback(0.4, warmup_epochs=2, start_lr=0.1),
             callbacks.LearningRateScheduleCallback(0.4, multiplier=1., start_epoch=2, end_epoch=3),
             callbacks.LearningRateScheduleCallback(0.4, multiplier=1e-1, start_epoch=3, end_epoch=4),
             callbacks.LearningRateScheduleCallback(0.4, multiplier=1e-2, start_epoch=4)]
    model.fit(x, y, batch_size=16, epochs=6, callbacks=chain + [record], verbose=0)
    horovod = _horovod_rates([_horovod_warmup(0.4, 2, size=4), _horovod_schedule(0.4, 1., 2, 3),
                              _horovod_schedule(0.4, 1e-1, 3, 4), _horovod_schedule(0.4, 1e-2, 4)], 6, 0.5)
    assert record.rates[8:] == pytest.approx(horovod[8:]) == [0.4] * 4 + [0.04] * 4 + [0.004] * 8
    assert record.rates[:8] == pytest.approx([0.1] + horovod[:7])  # one batch behind Horovod's warm-up
    assert horovod[7] == pytest.approx(0.4) and record.rates[7] < 0.4
    staircase = vars(callbacks.LearningRateScheduleCallback)
    assert "on_train_batch_end" not in staircase and "on_batch_end" not in staircase  # Keras's async dispatch stays


@pytest.mark.parametrize("multiplier, staircase", [
    (lambda epoch: 0.5 ** epoch, False),
    (lambda epoch: 0.5 ** epoch, True),
    (0.25, False),  # a constant: a staircase, as Horovod's
])
def test_schedule_callback_sets_horovods_rate_within_its_epochs(multiplier, staircase):
    model, x, y = model_and_data()  # 4 batches an epoch
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    record = _RecordRate()
    schedule = callbacks.LearningRateScheduleCallback(0.2, multiplier, start_epoch=1, end_epoch=3,
                                                      staircase=staircase, momentum_correction=False)
    model.fit(x, y, batch_size=16, epochs=4, callbacks=[schedule, record], verbose=0)
    want = _horovod_rates([_horovod_schedule(0.2, multiplier, 1, 3, staircase)], 4, 0.5)
    assert record.rates == pytest.approx(want)
    assert want[:4] == [0.5] * 4 and want[12:] == [want[11]] * 4  # untouched before, left as it was after
    assert schedule.rate(0, 0) is None and schedule.rate(3, 0) is None
    assert schedule.rate(2, 2) == pytest.approx(_horovod_schedule(0.2, multiplier, 1, 3, staircase)(2, 0 if
                                                schedule.staircase else 2))


@pytest.mark.parametrize("call, words", [
    (lambda: callbacks.LearningRateScheduleCallback(0, 1.), "initial_lr must be a number > 0"),
    (lambda: callbacks.LearningRateScheduleCallback(0.1, "x"), "multiplier must be"),
    (lambda: callbacks.LearningRateScheduleCallback(0.1, 1., start_epoch=-1), "start_epoch must be"),
    (lambda: callbacks.LearningRateScheduleCallback(0.1, 1., start_epoch=3, end_epoch=3), "end_epoch must be"),
    (lambda: callbacks.LearningRateScheduleCallback(0.1, 1., steps_per_epoch=0), "steps_per_epoch must be"),
])
def test_schedule_callback_bad_arguments(call, words):
    with pytest.raises(ValueError, match=words):
        call()


def test_schedule_callback_refuses_an_unknown_epoch_length_when_smooth():
    model, x, y = model_and_data()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    unknown_length = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda a, b: True).batch(16)
    with pytest.raises(ValueError, match="pass steps_per_epoch"):
        model.fit(unknown_length, epochs=1, verbose=0,
                  callbacks=[callbacks.LearningRateScheduleCallback(0.1, lambda e: 1., staircase=False)])
    model.fit(unknown_length, epochs=1, verbose=0,  # a staircase needs no epoch length
              callbacks=[callbacks.LearningRateScheduleCallback(0.1, lambda e: 1.)])
    assert float(model.optimizer.learning_rate) == pytest.approx(0.1)


@pytest.mark.parametrize("make", RATE_CALLBACKS)
def test_momentum_correction_is_refused_only_when_asked_for(make):
    with pytest.raises(ValueError, match="momentum_correction=True .*Keras 3 optimizers.*momentum_correction=False"):
        make(momentum_correction=True)
    make(momentum_correction=False)
    make(momentum_correction=None)
    make()


def test_warmup_callback_keeps_its_positional_order():
    warmup = callbacks.LearningRateWarmupCallback(0.4, 2, 4, 0.1, 1)
    assert (warmup.warmup_epochs, warmup.steps_per_epoch, warmup.start_lr, warmup.verbose) == (2, 4, 0.1, 1)
    with pytest.raises(TypeError):
        callbacks.LearningRateWarmupCallback(0.4, 2, 4, 0.1, 1, False)  # momentum_correction is keyword-only
