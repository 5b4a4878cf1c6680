"""LearningRateScheduleCallback: initial_lr times a multiplier of the epoch, over a range of epochs (Horovod's)."""

import math
import numbers

import keras

from ... import _lib
from . import _lr

_WHO = "LearningRateScheduleCallback"


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets the learning rate to initial_lr · multiplier(epoch) in the epochs from start_epoch up to, not
    including, end_epoch; outside them it leaves the rate alone. Horovod's
    hvd.callbacks.LearningRateScheduleCallback, with its arguments in its order, so that a chain of them
    after a LearningRateWarmupCallback (Horovod's keras_imagenet_resnet50 example) ports as it is:

        callbacks = [LearningRateWarmupCallback(lr, warmup_epochs=5),
                     LearningRateScheduleCallback(lr, multiplier=1., start_epoch=5, end_epoch=30),
                     LearningRateScheduleCallback(lr, multiplier=1e-1, start_epoch=30, end_epoch=60),
                     LearningRateScheduleCallback(lr, multiplier=1e-2, start_epoch=60)]

    Args:
        initial_lr: the rate the multiplier scales (a number > 0).
        multiplier: a number >= 0, or a function of the epoch returning one.
        start_epoch: the first epoch it sets the rate in (fit's epoch numbers, from 0). Default 0.
        end_epoch: the epoch it stops at (not set in it); None: never stops.
        staircase: True (the default): the rate is set once per epoch, at its start, with the integer
            epoch. False: at every batch's start, with the fractional epoch epoch + batch / steps_per_epoch
            (a smooth schedule). A constant multiplier is always a staircase, as in Horovod.
        momentum_correction: False or None (the default). True (Horovod's default) raises ValueError: a
            Keras 3 optimizer reads its momentum as a constant when its step is traced, so the momentum
            cannot be corrected as the rate changes.
        steps_per_epoch: batches per epoch, for staircase=False; default what model.fit knows (it raises
            ValueError when it cannot know, e.g. for an endless dataset without steps_per_epoch).
        verbose: 1 prints the rate at the start of each epoch it sets, on rank 0.

    Whether an epoch is in [start_epoch, end_epoch) is decided by its integer number, also with
    staircase=False (as Horovod's). Every worker computes the same rate from the same epoch and batch, so no
    collective is needed. The staircase rate is set in on_epoch_begin, where Horovod's sets it at the epoch's
    first batch: every batch has the same rate as under Horovod, but a callback after this one in the list
    that also sets the rate at the epoch's start (keras.callbacks.LearningRateScheduler) has the last word.
    Only on_epoch_begin and (for staircase=False) on_train_batch_begin act, so Keras keeps its asynchronous
    batch dispatch. With steps_per_execution=k, batch hooks run once per execution: a smooth schedule then
    moves once every k batches. The optimizer's learning rate must be a number (a variable), not a
    LearningRateSchedule: that raises ValueError when training begins.
    """

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=None, steps_per_epoch=None, verbose=0):
        super().__init__()
        _lr.refuse_momentum_correction(_WHO, momentum_correction)
        self.initial_lr = _lr.positive(_WHO, "initial_lr", initial_lr)
        if callable(multiplier):
            self.multiplier = multiplier
            self.staircase = bool(staircase)
        else:
            if isinstance(multiplier, bool) or not isinstance(multiplier, numbers.Real) or not multiplier >= 0:
                raise ValueError(f"{_WHO}: multiplier must be a number >= 0 or a function of the epoch, got "
                                 f"{multiplier!r}")
            constant = multiplier
            self.multiplier = lambda epoch: constant
            self.staircase = True  # as Horovod: a constant has nothing to interpolate
        self.start_epoch = _lr.non_negative(_WHO, "start_epoch", start_epoch)
        if end_epoch is not None and (isinstance(end_epoch, bool) or not isinstance(end_epoch, numbers.Real)
                                      or not end_epoch > start_epoch):
            raise ValueError(f"{_WHO}: end_epoch must be None or a number > start_epoch ({start_epoch!r}), "
                             f"got {end_epoch!r}")
        self.end_epoch = end_epoch
        self.steps_per_epoch = (None if steps_per_epoch is None
                                else int(_lr.positive(_WHO, "steps_per_epoch", steps_per_epoch)))
        self.verbose = verbose
        self._epoch = 0
        self._steps = None

    def on_train_begin(self, logs=None):
        _lib.require_init(_WHO)
        _lr.require_number_rate(_WHO, self.model)
        self._steps = self.steps_per_epoch or (self.params or {}).get("steps")
        if not self.staircase and not self._steps:
            raise ValueError(f"{_WHO}: model.fit does not know the number of batches per epoch (an endless "
                             "dataset?); pass steps_per_epoch, or use staircase=True")

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        if not self._within(epoch) or not (self.staircase or self.verbose):
            return
        rate = self._rate_at(epoch)
        if self.staircase:
            self.model.optimizer.learning_rate = rate
        # (staircase=False: batch 0's start sets this rate, as Horovod's does.)
        if self.verbose and _lib.rank() == 0:
            print(f"{_WHO}: epoch {epoch + 1}, learning rate {rate:.6g}")

    def on_train_batch_begin(self, batch, logs=None):
        if self.staircase or not self._within(self._epoch):
            return
        self.model.optimizer.learning_rate = self._rate_at(self._epoch + batch / self._steps)

    def rate(self, epoch, batch=0):
        """The rate it sets for batch `batch` of epoch `epoch` (both from 0), None outside its epochs. A
        staircase's is that of the epoch's start, whatever the batch; staircase=False needs the epoch
        length, known once fit has begun (or from steps_per_epoch)."""
        if not self._within(epoch):
            return None
        if self.staircase:
            return self._rate_at(epoch)
        steps = self._steps or self.steps_per_epoch
        if not steps:
            raise ValueError(f"{_WHO}.rate: the number of batches per epoch is not known yet; pass "
                             "steps_per_epoch, or call it once fit has begun")
        return self._rate_at(epoch + batch / steps)

    def _within(self, epoch):
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _rate_at(self, epoch):
        m = self.multiplier(epoch)
        try:
            value = self.initial_lr * float(m)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{_WHO}: multiplier({epoch!r}) returned {m!r}, not a number") from e
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{_WHO}: multiplier({epoch!r}) returned {m!r}, which makes the rate {value!r}; "
                             "it must be a finite number >= 0")
        return value
