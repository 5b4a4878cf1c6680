"""Input pipelines for adaptive training: the global batch size may change between any two steps.

    ds = kungfu.data.AdaptiveDataset((x, y), global_batch_size=128, shuffle=True, seed=0)
    model.fit(ds.as_dataset(), epochs=3, shuffle=False, callbacks=[ds.keras_callback()])
    ds.set_batch_size(256)      # between steps, from a callback, a policy, or inside a tf.function

See docs/data.md. The modules: _plan (how an epoch is cut into batches and shards; no TensorFlow),
_dataset (AdaptiveDataset, the tf.data side), _keras (EpochCallback, for model.fit).
"""

from ._dataset import AdaptiveDataset

__all__ = ["AdaptiveDataset", "EpochCallback"]


def __getattr__(name):  # EpochCallback imports keras, which a custom loop may not need
    if name == "EpochCallback":
        from ._keras import EpochCallback

        return EpochCallback
    raise AttributeError(f"module 'kungfu.data' has no attribute {name!r}")


def __dir__():
    return sorted(set(__all__) | {name for name in globals() if not name.startswith("_")})
