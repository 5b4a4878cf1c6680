"""Gradient compression on the wire, for the S-SGD paths (optimizer wrappers, DistributedGradientTape,
kungfu.rewrite): compression="fp16" all-reduces float32 and float64 gradients as float16, half or a
quarter of the bytes, and casts the means back. The engine adds float16 in float32 and rounds each
partial sum (docs/api.md), so the mean loses only float16's precision (about 3 decimal digits) within
its range: the sum over the workers must fit it (|sum| <= 65504: the division comes last), and values
below float16's smallest normal (6.1e-5) keep fewer digits, those below about 3e-8 none (docs/training.md).
Sparse (IndexedSlices) gradients, monitor values and model averaging are not compressed. "none" (the
default) sends gradients as they are.
"""

import tensorflow as tf

COMPRESSIONS = ("none", "fp16")
_WIDE = (tf.float32, tf.float64)  # what fp16 narrows


def check(compression, who):
    """The compression's name ("none" for None); ValueError, naming who, for anything else."""
    if compression is None:
        return "none"
    if not isinstance(compression, str) or compression.lower() not in COMPRESSIONS:
        raise ValueError(f"{who}: compression must be one of {', '.join(COMPRESSIONS)} (or None), "
                         f"got {compression!r}")
    return compression.lower()


def wire_dtype(dtype, compression):
    """The dtype a tensor of dtype travels as."""
    return tf.float16 if compression == "fp16" and dtype in _WIDE else dtype


def compress(tensors, compression):
    """The tensors as they go on the wire."""
    out = []
    for t in tensors:
        wire = wire_dtype(t.dtype, compression)
        out.append(t if wire == t.dtype else tf.cast(t, wire))
    return out


def decompress(reduced, originals):
    """The reduced tensors back in the dtypes of the originals."""
    return [r if r.dtype == o.dtype else tf.cast(r, o.dtype) for r, o in zip(reduced, originals)]
