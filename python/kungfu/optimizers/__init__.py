"""Distributed optimizers: wrap any Keras 3 optimizer to train on every worker.

    opt = kungfu.optimizers.SynchronousSGDOptimizer(keras.optimizers.Adam(1e-3))
    model.compile(optimizer=opt, loss=...)     # model.fit as usual, or opt.apply_gradients(...)

SynchronousSGDOptimizer (all-reduced gradients), SynchronousAveragingOptimizer (synchronous model
averaging) and PairAveragingOptimizer (asynchronous pair averaging) are the same wrapper started with
different strategies; opt.strategy = "ssgd" | "sma" | "pair_averaging" switches between them at any
step without retracing. See docs/training.md. monitor=["gns", "variance", "snr"] adds in-graph
training monitors, read with kungfu.monitor.latest() (docs/monitoring.md).
"""

from ._factory import DistributedOptimizer
from ._factory import PairAveragingOptimizer
from ._factory import SynchronousAveragingOptimizer
from ._factory import SynchronousSGDOptimizer
from ._wrapper import STRATEGIES
from ._wrapper import DistributedMixin

__all__ = ["DistributedOptimizer", "SynchronousSGDOptimizer", "SynchronousAveragingOptimizer",
           "PairAveragingOptimizer", "DistributedMixin", "STRATEGIES"]
