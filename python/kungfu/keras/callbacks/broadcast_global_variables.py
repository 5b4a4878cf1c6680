"""BroadcastGlobalVariablesCallback: every worker starts training from root's model and optimizer."""

import keras

from ... import _lib
from ... import _variables


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """At the start of the first fit(), sets every worker's model variables (trainable and not) and
    optimizer variables (slots, iteration count) to root's.

    Workers then start identical even when each built its model from a different random seed, or
    when root restored a checkpoint the others do not have. Only on_train_begin is overridden, so
    Keras keeps its asynchronous batch dispatch.
    """

    def __init__(self, root=0):
        super().__init__()
        self.root = root
        self._done = False

    def on_train_begin(self, logs=None):
        if self._done:
            return
        _lib.require_init("BroadcastGlobalVariablesCallback")
        model = self.model
        variables = list(model.variables)
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None:
            if not optimizer.built:
                optimizer.build(model.trainable_variables)
            variables += list(optimizer.variables)
        _variables.broadcast_variables(variables, root=self.root, name="kungfu/broadcast_global_variables")
        self._done = True
