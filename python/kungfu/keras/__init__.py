"""Keras integration: callbacks for model.fit (kungfu.keras.callbacks), PolicyCallback, load_model,
which resumes distributed training from a saved model, and SyncBatchNormalization."""

from . import callbacks
from ._layers import SyncBatchNormalization
from ._load import load_model
from .callbacks import PolicyCallback

__all__ = ["callbacks", "PolicyCallback", "load_model", "SyncBatchNormalization"]
