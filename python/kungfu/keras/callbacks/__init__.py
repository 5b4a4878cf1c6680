"""Keras callbacks for distributed model.fit.

    callbacks = [kungfu.keras.callbacks.BroadcastGlobalVariablesCallback(root=0),
                 kungfu.keras.callbacks.MetricAverageCallback()]
    model.fit(x, y, callbacks=callbacks, verbose=1 if kungfu.rank() == 0 else 0)
"""

from .broadcast_global_variables import BroadcastGlobalVariablesCallback
from .lr_schedule import LearningRateScheduleCallback
from .lr_warmup import LearningRateWarmupCallback
from .metric_average import MetricAverageCallback
from .monitor import MonitorCallback
from .policy import PolicyCallback

__all__ = ["BroadcastGlobalVariablesCallback", "LearningRateScheduleCallback", "LearningRateWarmupCallback",
           "MetricAverageCallback", "MonitorCallback", "PolicyCallback"]
