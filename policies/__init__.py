"""kungfu.policies: adaptation policies that change training while it runs, and their API.

    import kungfu.policies as kp
    policies = [kp.gns_batch_size(min_batch=64, max_batch=1024, lr_rule="sqrt")]
    model.fit(ds.as_dataset(), callbacks=[kungfu.keras.PolicyCallback(policies, dataset=ds)], ...)

A policy (BasePolicy) reads a Context and acts through it; see base.py and context.py. This package is
pure Python: it imports no TensorFlow, so a policy is tested with a hand-made Context. The runners that
call policies during training are kungfu.PolicyRunner (custom loops) and kungfu.keras.PolicyCallback
(model.fit); kungfu.rewrite(fn, policies=[...]) compiles the built-in ones into the training step.
See docs/policies.md.
"""

from .base import BasePolicy
from .context import STRATEGIES
from .context import Context
from .context import PyMath
from .context import State
from .early_stop import EarlyStopOnPlateau
from .early_stop import early_stop
from .gns_batch_size import GNSBatchSizePolicy
from .gns_batch_size import gns_batch_size
from .lr_scaling import LRScalingPolicy
from .lr_scaling import lr_scaling
from .lr_scaling import scaled_learning_rate
from .scheduled import ScheduledPolicy
from .scheduled import scheduled
from .strategy_switch import StrategySwitchPolicy
from .strategy_switch import strategy_switch

__all__ = [
    "BasePolicy", "Context", "PyMath", "State", "STRATEGIES",
    # the built-in policies: builders (the documented entry points) and their classes
    "gns_batch_size", "scheduled", "strategy_switch", "lr_scaling", "early_stop", "scaled_learning_rate",
    "GNSBatchSizePolicy", "ScheduledPolicy", "StrategySwitchPolicy", "LRScalingPolicy", "EarlyStopOnPlateau",
]
