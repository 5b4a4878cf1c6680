"""kungfu.errors: the hierarchy and the mapping from engine and TF status codes. No library needed."""

import pytest

from kungfu import errors


@pytest.mark.parametrize("code,cls,recoverable", [
    (3, errors.MismatchError, False),
    (4, errors.CollectiveTimeout, True),
    (9, errors.NotInitializedError, False),
    (10, errors.ClusterChangedError, True),
    (14, errors.PeerError, True),
    (13, errors.EngineError, False),
    (7, errors.EngineError, False),
])
def test_from_code(code, cls, recoverable):
    e = errors.from_code(code, "allreduce 'w': peer 127.0.0.1:10001 (rank 1) closed the connection")
    assert type(e) is cls
    assert isinstance(e, errors.KungFuError)
    assert e.code == code
    assert "rank 1" in str(e)
    assert errors.is_recoverable(e) is recoverable


def test_hierarchy():
    assert issubclass(errors.CollectiveTimeout, errors.PeerError)
    assert issubclass(errors.NotInitializedError, RuntimeError)
    assert issubclass(errors.MismatchError, ValueError)
    assert not errors.is_recoverable(ValueError("x"))


def test_from_tf_error():
    import tensorflow as tf
    e = tf.errors.UnavailableError(None, None, "allreduce 'g': peer 127.0.0.1:10002 (rank 2) closed the connection")
    k = errors.from_tf_error(e)
    assert isinstance(k, errors.PeerError)
    assert "rank 2" in str(k)
    assert errors.is_recoverable(e)
    assert isinstance(errors.from_tf_error(tf.errors.InvalidArgumentError(None, None, "m")), errors.MismatchError)
    assert isinstance(errors.from_tf_error(tf.errors.DeadlineExceededError(None, None, "t")), errors.CollectiveTimeout)


@pytest.mark.parametrize("raised, cls", [
    (TimeoutError("timed out waiting for rank 0"), errors.CollectiveTimeout),
    (ConnectionError("rank 0 refused the registration"), errors.PeerError),
    (OSError("cannot bind 127.0.0.1:20001"), errors.EngineError),
])
def test_init_wraps_rendezvous_failures(monkeypatch, raised, cls):
    from kungfu import _env, _lib

    def fail():
        raise raised

    was_initialized = _lib.initialized()  # other tests of this process may have called init()
    _lib.finalize()
    monkeypatch.setattr(_env, "resolve_cluster", fail)
    try:
        with pytest.raises(cls, match="rendezvous"):
            _lib.init()
        assert not _lib.initialized()
    finally:
        monkeypatch.undo()
        if was_initialized:
            _lib.init()
