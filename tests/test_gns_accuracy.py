"""Accuracy of the gradient noise scale across processes (issue 4): on synthetic gradients with a known
true gradient norm and noise covariance trace, the estimates of the wrapper's monitors, computed in the
real distributed path under kfrun, are within 10% of the truth once the EMA has settled. Two local
batch sizes per launch, on 2 and 4 workers. The worker: tests/gns_accuracy_worker.py.
"""

import os

import pytest

from conftest import REPO
from mp import assert_checks_passed, launch

pytestmark = pytest.mark.usefixtures("kungfu_library")

WORKER = os.path.join(REPO, "tests", "gns_accuracy_worker.py")


@pytest.mark.parametrize("np_, b_small", [(2, (4, 32)), (4, (8, 16))])
def test_estimates_within_10_percent_of_the_truth(np_, b_small, tmp_path):
    code, out = launch(np_, [WORKER, *map(str, b_small)], tmp_path, timeout=60, budget=120)
    assert_checks_passed(code, out, [f"accurate_b{b}" for b in b_small], np_)
    reports = [line for line in out.splitlines() if "gns accuracy" in line]
    assert len(reports) == np_ * len(b_small), out[-4000:]
