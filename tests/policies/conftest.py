"""The policy tests import the repository's policies/ directly (`import policies`): it is the source of
kungfu.policies, and importing it this way loads no TensorFlow and no kungfu library, which
test_no_tensorflow.py checks. The helpers beside the tests (fake_runs.py, symbolic.py) are imported as
top-level modules, pytest putting this directory on sys.path."""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
