"""Keras integration: callbacks for model.fit (kungfu.keras.callbacks)."""

from . import callbacks

__all__ = ["callbacks"]
