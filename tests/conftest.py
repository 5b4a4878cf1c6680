"""Shared test setup: make the package importable and find the built library.

Tests run against an installed kungfu (`pip install --no-build-isolation .`) or, when none is
installed, against the source tree (python/), exported in PYTHONPATH so that the processes tests
start see the same package. The library is what kungfu._lib.library_path() names: KUNGFU_LIBRARY if
set, else python/kungfu/_kungfu.so. Tests that need it fail, saying how to build it, when it is
missing (never skip: a skipped test hides a broken build); the rest run regardless.
"""

import importlib.util
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

if importlib.util.find_spec("kungfu") is None:
    sys.path.insert(0, os.path.join(REPO, "python"))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in [os.path.join(REPO, "python"), os.environ.get("PYTHONPATH")] if p)


def library_missing_reason():
    """Why the kungfu library cannot be loaded, or None when it is there."""
    from kungfu import _lib

    path = _lib.library_path()
    if os.path.exists(path):
        return None
    return (f"kungfu library not built ({path} missing): run `pip install --no-build-isolation .` "
            "or set KUNGFU_LIBRARY to a built _kungfu.so")


def require_library():
    """Fails the calling test when the library is not built."""
    reason = library_missing_reason()
    if reason:
        pytest.fail(reason)


@pytest.fixture(scope="session")
def kungfu_library():
    """Fails the test when the library is not built; else returns its path."""
    require_library()
    from kungfu import _lib

    return _lib.library_path()


def pytest_collection_modifyitems(items):
    """tf.test.TestCase carries a method named test_session that is not a test; pytest would report
    it as skipped in every TestCase, so it is dropped from the collection."""
    items[:] = [item for item in items if item.name != "test_session"]
