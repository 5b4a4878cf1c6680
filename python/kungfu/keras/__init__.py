"""Keras integration: callbacks for model.fit (kungfu.keras.callbacks), PolicyCallback, and load_model,
which resumes distributed training from a saved model."""

from . import callbacks
from ._load import load_model
from .callbacks import PolicyCallback

__all__ = ["callbacks", "PolicyCallback", "load_model"]
