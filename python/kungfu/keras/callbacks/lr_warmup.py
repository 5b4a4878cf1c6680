"""LearningRateWarmupCallback: a linear learning-rate warm-up over the first epochs (Goyal et al., 2017)."""

import keras

from ... import _lib
from . import _lr


class LearningRateWarmupCallback(keras.callbacks.Callback):
    """Raises the learning rate linearly, batch by batch, from start_lr to initial_lr over the first
    warmup_epochs epochs; from then on it leaves the rate alone (to a schedule, a policy or nobody).

    The usual large-batch recipe: scale the single-worker rate by the number of workers
    (initial_lr = lr · size()) and warm up to it from the single-worker rate, start_lr's default
    initial_lr / size(). Every worker computes the same rate from the same epoch and batch, so no
    collective is needed.

    Args:
        initial_lr: the rate reached at the end of the warm-up.
        warmup_epochs: its length in epochs (a float is fine). Default 5.
        steps_per_epoch: batches per epoch; default what model.fit knows (it raises ValueError when it
            cannot know, e.g. for an endless dataset without steps_per_epoch).
        start_lr: the rate of the first batch; default initial_lr / size().
        verbose: 1 prints the rate at each epoch's start during the warm-up, on rank 0.
        momentum_correction: keyword only; False or None (the default). True (Horovod's default) raises
            ValueError: a Keras 3 optimizer reads its momentum as a constant when its step is traced, so
            the momentum cannot be corrected as the rate changes.

    Batch b of epoch e (both from 0) has the rate at position p = e + b / steps_per_epoch epochs:
    start_lr + (initial_lr - start_lr) · min(p / warmup_epochs, 1). The first batch has start_lr exactly,
    and initial_lr comes with the first batch after the warm-up. Horovod's callback of the same name takes
    the position after the batch, p = e + (b + 1) / steps_per_epoch: its first batch already has one step
    more than start_lr and its last warm-up batch has initial_lr. So each warm-up batch here has the rate
    Horovod gives the batch before it, one step (initial_lr - start_lr) / (warmup_epochs · steps_per_epoch)
    lower; from the end of the warm-up on the two agree.

    The warm-up happens once: a later fit leaves the rate alone once it is over, and a fit that starts
    past it (initial_epoch, a resumed run) never touches the rate. A fit that stops within it and a later
    one go on where it stopped, whether the later one passes initial_epoch or counts its epochs from 0
    again (fit called in a loop, one epoch at a time). The optimizer's learning rate must be a number (a
    variable), not a LearningRateSchedule: that raises ValueError when training begins.
    """

    def __init__(self, initial_lr, warmup_epochs=5, steps_per_epoch=None, start_lr=None, verbose=0, *,
                 momentum_correction=None):
        super().__init__()
        _lr.refuse_momentum_correction("LearningRateWarmupCallback", momentum_correction)
        self.initial_lr = _positive("initial_lr", initial_lr)
        self.warmup_epochs = _positive("warmup_epochs", warmup_epochs)
        self.steps_per_epoch = None if steps_per_epoch is None else int(_positive("steps_per_epoch",
                                                                                  steps_per_epoch))
        self.start_lr = None if start_lr is None else _positive("start_lr", start_lr)
        self.verbose = verbose
        self._epoch = 0
        self._offset = 0.0  # epochs added to this fit's own position (it restarted its count mid-warm-up)
        self._next = None  # the position of the batch after the last one ramped, in epochs
        self._new_fit = False
        self._steps = None
        self._first_lr = None
        self._ramping = False  # a batch of the warm-up has had its rate set
        self._finished = False  # the warm-up is over: the rate is left alone from then on

    def on_train_begin(self, logs=None):
        _lib.require_init("LearningRateWarmupCallback")
        self._new_fit = True
        self._steps = self.steps_per_epoch or (self.params or {}).get("steps")
        if not self._steps:
            raise ValueError("LearningRateWarmupCallback: model.fit does not know the number of batches per epoch "
                             "(an endless dataset?); pass steps_per_epoch")
        self._first_lr = self.start_lr if self.start_lr is not None else self.initial_lr / _lib.size()
        _lr.require_number_rate("LearningRateWarmupCallback", self.model)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        if self._new_fit:  # this fit's first epoch: does it count from before where the warm-up got to?
            self._new_fit = False
            behind = self._ramping and not self._finished and epoch < self._next
            self._offset = self._next - epoch if behind else 0.0
        if self.verbose and not self._finished and epoch + self._offset < self.warmup_epochs and _lib.rank() == 0:
            print(f"LearningRateWarmupCallback: epoch {epoch + 1}, learning rate "
                  f"{self._rate_at(epoch + self._offset):.6g}")

    def on_train_batch_begin(self, batch, logs=None):
        if self._finished:
            return  # also in a later fit: the rate may have moved since (ReduceLROnPlateau, a policy)
        at = self._epoch + self._offset + batch / self._steps
        if at >= self.warmup_epochs - _EPS:  # this fit starts past the warm-up (initial_epoch, a resumed run)
            if self._ramping:  # one that an earlier fit left unfinished: end it where it should have
                self.model.optimizer.learning_rate = self.initial_lr
            self._finished = True
            return
        self._ramping = True
        self.model.optimizer.learning_rate = self._rate_at(at)
        self._next = at + 1 / self._steps

    def on_epoch_end(self, epoch, logs=None):
        # A warm-up that ends with this epoch reaches initial_lr now, not at the next batch's start, which
        # comes after the next epoch's on_epoch_begin, where a schedule (LearningRateScheduler) may have set
        # the rate it wants from then on. (Not in on_train_batch_end: overriding that would make Keras run
        # every step synchronously. One that ends mid-epoch ends at the next batch's start.)
        if self._ramping and not self._finished and self._next >= self.warmup_epochs - _EPS:
            self.model.optimizer.learning_rate = self.initial_lr
            self._finished = True

    def rate(self, epoch, batch):
        """The rate of batch `batch` of epoch `epoch` (both from 0, counted from the warm-up's start);
        initial_lr once the warm-up is over."""
        return self._rate_at(epoch + batch / self._steps)

    def _rate_at(self, epochs):
        done = min(epochs / self.warmup_epochs, 1.0)
        return self._first_lr + (self.initial_lr - self._first_lr) * done


_EPS = 1e-9  # epochs: positions computed as sums of 1 / steps_per_epoch may miss the end by rounding


def _positive(name, value):
    return _lr.positive("LearningRateWarmupCallback", name, value)
