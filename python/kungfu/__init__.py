"""KungFu for TensorFlow 2: adaptive distributed training.

    import kungfu
    kungfu.init()                       # joins the cluster the launcher (kfrun) describes
    y = kungfu.all_reduce(x, op="mean")

Importing kungfu is cheap: it neither imports TensorFlow nor loads the library nor starts a thread.
init() loads the library and starts the engine; the collectives (all_reduce, group_all_reduce,
broadcast, all_gather, barrier, consensus) import TensorFlow on first access. Errors are in
kungfu.errors. See docs/api.md.
"""

from . import errors
from ._lib import finalize
from ._lib import init
from ._lib import local_rank
from ._lib import local_size
from ._lib import rank
from ._lib import size

_COLLECTIVES = ("all_reduce", "group_all_reduce", "broadcast", "all_gather", "barrier", "consensus")

__all__ = ["init", "finalize", "rank", "size", "local_rank", "local_size", "errors", *_COLLECTIVES]


def __getattr__(name):
    # PEP 562: the collectives need TensorFlow, so they are imported on first use.
    if name in _COLLECTIVES:
        from . import ops

        return getattr(ops, name)
    raise AttributeError(f"module 'kungfu' has no attribute {name!r}")
