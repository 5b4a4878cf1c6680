"""Keras integration: callbacks for model.fit (kungfu.keras.callbacks), and PolicyCallback."""

from . import callbacks
from .callbacks import PolicyCallback

__all__ = ["callbacks", "PolicyCallback"]
