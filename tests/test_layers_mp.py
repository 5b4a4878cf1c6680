"""kungfu.keras.SyncBatchNormalization across real worker processes started by kfrun; see
tests/layers_worker.py. On 1, 2 and 4 workers it must equal BatchNormalization in one process on the
global batch: outputs, gradients, moving statistics, masks, channels first, model.fit, save and load.
"""

import os

import pytest

from conftest import REPO
from mp import assert_checks_passed, launch

pytestmark = pytest.mark.usefixtures("kungfu_library")

WORKER = os.path.join(REPO, "tests", "layers_worker.py")
CHECKS = ["outputs_statistics_and_gradients_equal_the_global_batch",
          "a_large_mean_keeps_the_accuracy_of_batch_normalization",
          "masked_steps_and_channels_first_equal_the_global_batch",
          "fit_equals_one_process_and_the_model_saves", "synchronized_true_is_refused"]


@pytest.mark.parametrize("np_", [1, 2, 4])
def test_sync_batch_normalization_equals_the_global_batch(np_, tmp_path):
    code, out = launch(np_, [WORKER], tmp_path, timeout=60, budget=300)
    assert_checks_passed(code, out, CHECKS, np_)
