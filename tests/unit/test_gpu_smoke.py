"""`make gpu-smoke` on a machine without CUDA: a clear skip, exit 0, the reason in its JSON."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_smoke_skips_with_the_reason_without_cuda(tmp_path):
    out = tmp_path / "gpu-smoke.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_smoke.py"), str(out), "--work",
                           str(tmp_path / "work")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "gpu-smoke: skipped: no CUDA device visible" in proc.stdout
    assert "torch.cuda.is_available() is False" in json.loads(out.read_text())["skipped"]
    assert not (tmp_path / "work").exists(), "nothing is built when there is no GPU"
