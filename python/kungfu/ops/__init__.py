"""Collective operations on tensors (they import TensorFlow; `import kungfu` alone does not)."""

from .collective import all_gather
from .collective import all_reduce
from .collective import barrier
from .collective import broadcast
from .collective import consensus
from .collective import NORM_DTYPES
from .collective import group_all_reduce
from .collective import group_all_reduce_with_norms
from .objects import all_gather_object
from .objects import broadcast_object
from .p2p import request_variable
from .p2p import save_variable

__all__ = ["all_reduce", "group_all_reduce", "group_all_reduce_with_norms", "broadcast", "all_gather", "barrier",
           "consensus", "broadcast_object", "all_gather_object", "save_variable", "request_variable"]
