"""A small Keras model and data, shared by single-process test modules (not in conftest.py: tests/policies
has a conftest of its own, and a whole-suite run imports only one module named conftest)."""

import keras
import numpy as np


def model_and_data(seed=3):
    """A regression model (5 -> 8 -> 2) and 64 rows of random data, the same for a seed."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)])
    rng = np.random.RandomState(seed)
    return model, rng.normal(size=(64, 5)).astype(np.float32), rng.normal(size=(64, 2)).astype(np.float32)
