"""Policies across real worker processes started by kfrun; see tests/policy_worker.py.

A policy's strategy, learning-rate and batch-size changes take effect on every worker at the same step;
workers never diverge, even when their policies see different local values; a policy that raises on
one worker raises PolicyError on every worker, with no hang.
"""

import os

import pytest

from conftest import REPO
from mp import assert_checks_passed, launch

pytestmark = pytest.mark.usefixtures("kungfu_library")

WORKER = os.path.join(REPO, "tests", "policy_worker.py")
CHECKS = ["strategy_and_learning_rate_change_at_the_same_step",
          "local_decisions_follow_rank_0_and_local_metrics_are_averaged",
          "workers_logging_different_metrics_get_a_policy_error",
          "a_policy_raising_on_one_worker_raises_on_every_worker",
          "batch_size_change_lands_at_the_same_step_in_fit",
          "compiled_gns_policy_decides_as_the_python_hook",
          "policies_compiled_into_the_optimizer_act_at_the_same_step",
          "compiled_policies_meet_when_keras_names_the_optimizers_differently",
          "a_resumed_run_goes_on_from_its_step_and_epoch"]


@pytest.mark.parametrize("np_", [2, 4])
def test_policies_agree_across_workers(np_, tmp_path):
    code, out = launch(np_, [WORKER], tmp_path, timeout=60, budget=300)
    assert_checks_passed(code, out, CHECKS, np_)
