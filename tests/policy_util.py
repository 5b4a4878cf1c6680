"""What the one-process policy tests share (test_policy_runner.py, test_policy_compiled.py,
test_policy_callback.py): two small policies and a small model with its training step."""

import keras
import numpy as np
import tensorflow as tf

from kungfu.policies import BasePolicy


class HalveLrOnce(BasePolicy):
    """Compilable: halves the learning rate once, at the first call at or after step `at`; stops at `stop_at`."""

    compilable = True

    def __init__(self, at=4, stop_at=None, interval=2):
        self.at, self.stop_at, self.interval = at, stop_at, interval

    def after_step(self, ctx):
        s = ctx.state(self, done=0.0)
        hit = ctx.math.all(ctx.step >= self.at, s.done < 1)
        ctx.set_learning_rate(ctx.learning_rate * 0.5, when=hit)
        s.update(when=hit, done=1.0)
        if self.stop_at is not None:
            ctx.stop(when=ctx.step >= self.stop_at)


class Recorder(BasePolicy):
    """Records the hooks it sees, with step and epoch."""

    def __init__(self):
        self.calls = []

    def _note(self, ctx):
        self.calls.append((ctx.hook, ctx.step, ctx.epoch))

    before_train = before_epoch = before_step = after_step = after_epoch = after_train = _note


def model_and_data(seed=1):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    rng = np.random.RandomState(seed)
    return model, rng.normal(size=(16, 4)).astype(np.float32), rng.normal(size=(16, 3)).astype(np.float32)


def step_fn(model, opt):
    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return train_step
