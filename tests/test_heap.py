"""edgellm.heap: a forward pass's freed buffers stay in the heap and the next pass reuses them (no fresh pages)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Two rounds of the buffers of a 512-row FFN (8 x 16 MiB, written, then freed); prints the minor page faults of the
# second round. In a fresh interpreter: the heap settings are process-wide.
PROBE = r"""
import resource, sys
import numpy as np
from edgellm import heap
if sys.argv[1] == "keep":
    assert heap.keep_freed_buffers()
def one_pass():
    bufs = [np.ones((512, 8192), np.float32) for _ in range(8)]
    del bufs
one_pass()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
one_pass()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


def _second_pass_faults(mode: str) -> int:
    r = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return int(r.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings (Linux)")
def test_second_pass_reuses_the_first_pass_buffers():
    kept = _second_pass_faults("keep")
    assert kept < 200, kept  # 32,768 pages written: reused, not faulted in afresh
    # glibc's defaults trim the freed top and map large blocks afresh: the probe does see the difference
    assert _second_pass_faults("default") > 10 * max(kept, 100)
