"""What the learning-rate callbacks share: argument checks, the refusal of Horovod's momentum correction, and
the check that the optimizer's learning rate is a number they can set."""

import numbers

import numpy as np


def positive(who, name, value):
    """value, a number > 0, else ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise ValueError(f"{who}: {name} must be a number > 0, got {value!r}")
    return value


def non_negative(who, name, value):
    """value, a number >= 0, else ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value >= 0:
        raise ValueError(f"{who}: {name} must be a number >= 0, got {value!r}")
    return value


def refuse_momentum_correction(who, value):
    """Accepts momentum_correction=False or None (not asked for); anything else raises ValueError saying why it
    cannot be done. Horovod's callbacks default to True: they scale the optimizer's momentum by new_lr / old_lr
    for the batch where the rate changes (Goyal et al.), by assigning the optimizer's momentum attribute. A
    Keras 3 optimizer reads its momentum as a Python number when its update step is traced, so an assignment
    between batches would change nothing in the compiled step (or force a retrace at every change)."""
    if value is None or (isinstance(value, (bool, np.bool_)) and not value):
        return
    raise ValueError(f"{who}: momentum_correction={value!r} (Horovod's default) cannot be done with Keras 3 "
                     "optimizers: they read their momentum as a constant when the training step is traced, so a "
                     "callback cannot scale it by new_lr / old_lr for the batch where the rate changes. Pass "
                     "momentum_correction=False: the rate still changes, without the momentum's one-batch "
                     "correction")


def require_number_rate(who, model):
    """ValueError unless the model's optimizer has a learning rate that can be set to a number (not a
    LearningRateSchedule, which Keras refuses to overwrite)."""
    try:
        optimizer = model.optimizer
        optimizer.learning_rate = float(optimizer.learning_rate)  # no change; a schedule refuses it
    except (TypeError, ValueError) as e:
        raise ValueError(f"{who}: the optimizer's learning rate must be a number, not a LearningRateSchedule "
                         f"({e})") from e
