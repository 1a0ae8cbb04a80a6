"""scripts/gpu_check.sh without a GPU: its section limits fit one run on the GPU machine with
time for a rerun, and its dry run (tests collected, the benchmarks on a tiny model on CPU)
passes, so the first run on a GPU is not stopped by the script itself."""

import os
import re
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"
TOTAL_LIMIT_S = 420  # one run, leaving a 15-minute window room for a rerun


def test_section_limits_add_up_to_one_window():
    text = SCRIPT.read_text()
    limits = [int(n) for n in re.findall(r"^run (\d+) ", text, re.MULTILINE)]
    [kill_after] = [int(n) for n in re.findall(r"--kill-after=(\d+)", text)]
    assert limits and sum(limits) + kill_after * len(limits) <= TOTAL_LIMIT_S, limits


def test_cpu_dry_run_passes(tmp_path):
    result = subprocess.run(["bash", str(SCRIPT), "--cpu-dry-run"], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OUT": str(tmp_path)})
    assert result.returncode == 0 and "ALL CHECKS PASSED" in result.stdout, result.stdout[-4000:]
    assert "decode step at batch" in result.stdout and "output tok/s" in result.stdout
