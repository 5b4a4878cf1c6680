"""kungfu.policies is pure Python: importing it (as the repository's policies/ package, which is what
is installed as kungfu.policies) loads neither TensorFlow nor the kungfu library."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHECK = f"""
import sys
sys.path.insert(0, {REPO!r})
import policies
names = [m for m in ("tensorflow", "keras", "kungfu") if m in sys.modules]
assert not names, "importing policies loaded " + ", ".join(names)
print(sorted(policies.__all__))
"""


def test_importing_policies_loads_no_tensorflow():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for name in ("gns_batch_size", "scheduled", "strategy_switch", "lr_scaling", "early_stop", "BasePolicy"):
        assert repr(name) in out.stdout
