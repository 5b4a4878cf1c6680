"""Where the distributed optimizer meets Keras's own optimizers: a LossScaleOptimizer put around it (refused,
with the fix), the optimizer whose gradient accumulation it follows, and a used optimizer's state handed to
its wrapper when that is built."""

import sys

import tensorflow as tf


def refuse_loss_scale_outside(optimizer):
    """Raises ValueError when a keras LossScaleOptimizer is applying `optimizer` as its inner optimizer
    (model.compile puts one around it under the "mixed_float16" policy). Its overflow check reads each
    worker's own gradients, so a step that overflows on one worker only would skip the exchange there
    while the others wait for it until the deadline. Found among the calling frames: the check runs when
    apply() is traced, or on each eager call, and costs a few frame reads."""
    import keras

    frame = sys._getframe(2)  # the caller of apply()
    for _ in range(8):
        if frame is None:
            return
        owner = frame.f_locals.get("self")
        if isinstance(owner, keras.optimizers.LossScaleOptimizer) and owner.inner_optimizer is optimizer:
            with tf.init_scope():  # the strategy variable, read eagerly: this runs as the step is traced
                strategy = optimizer.strategy
            raise ValueError(
                f"the kungfu distributed optimizer (strategy {strategy!r}) over {type(optimizer).__name__} "
                f"{optimizer.name!r} runs inside a keras LossScaleOptimizer (put around it by hand, or by "
                "model.compile under the 'mixed_float16' policy), whose overflow check would see each worker's "
                "own gradients: a step that overflows on one worker only would be skipped there and wait for it "
                "on the others. Wrap the other way round, so that the check sees the averaged gradients: "
                "kungfu.optimizers.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(opt), "
                f"strategy={strategy!r}) (docs/training.md, \"Mixed precision\")")
        frame = frame.f_back


def accumulating(optimizer):
    """(N, the optimizer that accumulates) when `optimizer` updates every N steps (Keras's own
    gradient_accumulation_steps=N), else (None, None). A LossScaleOptimizer takes no such argument (Keras
    refuses it); the optimizer it wraps may: LossScaleOptimizer(SGD(gradient_accumulation_steps=N)) is how
    mixed precision accumulates, and then that inner optimizer counts the micro-steps and holds the
    accumulators."""
    import keras

    if optimizer.gradient_accumulation_steps:
        return optimizer.gradient_accumulation_steps, optimizer
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        inner = optimizer.inner_optimizer
        if inner.gradient_accumulation_steps:
            return inner.gradient_accumulation_steps, inner
    return None, None


def copy_state(source, wrapped):
    """Assigns a used optimizer's variables (step count, learning rate, slots) to the wrapper's, just
    built over the same model variables: both lists come in the order the base class creates them."""
    target = list(wrapped.variables)
    if len(source) < len(target) and all(v.name in _OWN_VARIABLES for v in source):
        # Keras 3's legacy .h5 loader builds the optimizer over no variables (model._trainable_variables, a
        # model's own, is empty), fails to set the saved slots, warns, and leaves it built with just these.
        raise ValueError(f"{wrapped.name}: the optimizer it wraps has only its step count and learning rate: no "
                         "optimizer state came back from the saved file, as when Keras 3 loads a legacy .h5 file "
                         "(e.g. Horovod's ModelCheckpoint('checkpoint-{epoch}.h5')), whose optimizer weights it "
                         "cannot restore (the model keras.models.load_model returns fails in fit too, 'Unknown "
                         "variable'). Save with the .keras format (model.save('m.keras'), "
                         "ModelCheckpoint('checkpoint-{epoch}.keras')) to resume with the optimizer's state; or, to "
                         "go on from the .h5 weights with a fresh optimizer, load it with compile=False and compile "
                         "it with a new DistributedOptimizer")
    if len(source) != len(target):
        raise ValueError(f"{wrapped.name}: the optimizer it wraps had {len(source)} variables, and it has "
                         f"{len(target)} over this model's; a used optimizer keeps its state only for the model "
                         "it was used with")
    for a, b in zip(source, target):
        if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
            raise ValueError(f"{wrapped.name}: the wrapped optimizer's variable {a.path} ({a.dtype}{list(a.shape)}) "
                             f"does not fit {b.path} ({b.dtype}{list(b.shape)}); a used optimizer keeps its state "
                             "only for the model it was used with")
    with tf.init_scope():  # once, eagerly, even when the first step's trace builds the optimizer
        for a, b in zip(source, target):
            b.assign(a.value)


_OWN_VARIABLES = ("iteration", "learning_rate")  # Keras 3's names of every optimizer's own, slot-less variables
