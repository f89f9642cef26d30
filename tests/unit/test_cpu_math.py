"""CPU ranks flush denormal floats to zero (devices.flush_denormals): measured in a fresh interpreter, before and after,
and with torch's intra-op threads started before the call."""
import json
import subprocess
import sys

import pytest

CHECK = """
import json, torch
from pretrain_bench.core.devices import denormals_flushed, flush_denormals
torch.set_num_threads(2)
before = denormals_flushed()  # starts the intra-op threads
denormal = torch.tensor([1e-39])
print(json.dumps({"before": before, "returned": flush_denormals(), "after": denormals_flushed(),
                  "product": (denormal * 3.0).item(), "normal": (torch.tensor([1e-30]) * 3.0).item()}))
"""


def test_flush_denormals_makes_denormal_arithmetic_zero_and_leaves_normal_numbers_alone():
    out = json.loads(subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, check=True).stdout)
    assert out["before"] is False and out["returned"] is True and out["after"] is True
    assert out["product"] == 0.0 and out["normal"] == pytest.approx(3e-30, rel=1e-6)
