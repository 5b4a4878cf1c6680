"""Controls: the training state a policy reads and changes, bound to the objects that hold it.

    batch size      the adaptive dataset's batch_size_variable (kungfu.data.AdaptiveDataset)
    learning rate   the optimizer's learning-rate variable (any Keras 3 optimizer with a float rate)
    strategy        the kungfu distributed optimizer's strategy_variable
    metrics         a kungfu.monitor.Monitors (from the optimizer, a rewritten step, or given)

Each is a TF variable that the training step reads, so a change takes effect at the next step with no
retrace, and the graph context (graph.py) assigns the same variables in the step itself. A decision
the bound objects cannot carry out (set_batch_size with no adaptive dataset, set_strategy on a plain
optimizer) raises PolicyError naming what to pass.
"""

import math

from .. import _lib
from .. import monitor as _monitor
from ..errors import PolicyError


def is_distributed(optimizer):
    from ..optimizers._wrapper import DistributedMixin

    return isinstance(optimizer, DistributedMixin)


def _lr_variable(optimizer):
    """The optimizer's learning-rate variable, or None when it has a schedule or a callable. A
    LossScaleOptimizer's is its inner optimizer's: that is the rate its steps use."""
    import keras

    while isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    lr = getattr(optimizer, "_learning_rate", None)
    return lr if isinstance(lr, keras.Variable) else None


def resolve_monitors(monitors, optimizer):
    """The Monitors a runner reads: monitors (a Monitors, a wrapped optimizer, a kungfu.rewrite step or
    a name), else the optimizer's when it has any, else None (the metrics then hold only the logs)."""
    if isinstance(monitors, _monitor.Monitors):
        return monitors
    if monitors is not None:
        return _monitor.monitors_of(monitors)
    if optimizer is not None and getattr(getattr(optimizer, "_kungfu", None), "monitors", None) is not None:
        return optimizer._kungfu.monitors
    return None


class Controls:
    """The objects a runner reads readings from and applies decisions to; who: the runner, for messages."""

    def __init__(self, who, optimizer=None, dataset=None, monitors=None, batch_size=None):
        self.who = who
        self.optimizer = optimizer
        self.dataset = dataset
        self.monitors = resolve_monitors(monitors, optimizer)
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                       or batch_size < 1):
            raise ValueError(f"{who}: batch_size must be the global batch size, an int >= 1, got {batch_size!r}")
        if batch_size is not None and dataset is not None:
            raise ValueError(f"{who}: pass batch_size= or dataset=, not both (the dataset knows its batch size)")
        self.fixed_batch_size = batch_size
        if dataset is not None and not hasattr(dataset, "batch_size_variable"):
            raise TypeError(f"{who}: dataset must be a kungfu.data.AdaptiveDataset, got {type(dataset).__name__}")

    # ---- readings -----------------------------------------------------------------------------

    def batch_size(self):
        if self.dataset is not None:
            return int(self.dataset.batch_size)
        return self.fixed_batch_size

    def learning_rate(self):
        if self.optimizer is None:
            return None
        var = _lr_variable(self.optimizer)
        return float(var.numpy()) if var is not None else float(self.optimizer.learning_rate)

    def strategy(self):
        if self.optimizer is not None and is_distributed(self.optimizer):
            return self.optimizer.strategy
        return None

    def metrics(self):
        """The monitors' latest values (those monitored), as floats."""
        if self.monitors is None:
            return {}
        return {k: v for k, v in self.monitors.values().items() if v is not None}

    # ---- actions ------------------------------------------------------------------------------

    def apply(self, changes):
        """Carries out the agreed changes (a dict from Context.changes); raises PolicyError if it cannot."""
        if "batch_size" in changes:
            self.batch_size_target().set_batch_size(int(changes["batch_size"]))
        if "learning_rate" in changes:
            lr = float(changes["learning_rate"])
            if not (math.isfinite(lr) and lr > 0):
                raise PolicyError(f"{self.who}: learning rate {lr!r} is not a finite number > 0")
            self.learning_rate_variable().assign(lr)
        if "strategy" in changes:
            self.strategy_target().set_strategy(changes["strategy"])

    def batch_size_target(self):
        if self.dataset is None:
            raise PolicyError(f"{self.who}: a policy set the batch size, but there is no adaptive dataset to "
                              "change: pass dataset=kungfu.data.AdaptiveDataset(...) and train on it")
        return self.dataset

    def learning_rate_variable(self):
        if self.optimizer is None:
            raise PolicyError(f"{self.who}: a policy set the learning rate, but no optimizer was given: "
                              "pass optimizer=")
        var = _lr_variable(self.optimizer)
        if var is None:
            raise PolicyError(f"{self.who}: a policy set the learning rate, but {self.optimizer.name}'s learning "
                              "rate is a schedule or a callable; create the optimizer with a float learning_rate")
        return var

    def strategy_target(self):
        if self.who == "kungfu.rewrite":
            raise PolicyError("kungfu.rewrite: a policy set the strategy, but a rewritten step runs S-SGD only; to "
                              "switch strategies, train with kungfu.optimizers.DistributedOptimizer(opt, "
                              "policies=[...]) instead of kungfu.rewrite")
        if self.optimizer is None or not is_distributed(self.optimizer):
            got = "no optimizer was given" if self.optimizer is None else f"{self.optimizer.name} is a plain optimizer"
            raise PolicyError(f"{self.who}: a policy set the strategy, but {got}; wrap it with "
                              "kungfu.optimizers.DistributedOptimizer(...) and pass it as optimizer=")
        return self.optimizer

    def cluster_size(self):
        return _lib.size()
