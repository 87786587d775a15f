"""Wall-clock bounds of the tests (hang guards around subprocesses, servers, model loads), scaled where everything
runs slower: EDGELLM_TEST_TIME_SCALE, which .ci/arm sets for qemu emulation (~20x slower than the host, JIT
compilation included). Bounds that are part of what a test checks are not scaled."""
from __future__ import annotations

import os

TIME_SCALE = max(1.0, float(os.environ.get("EDGELLM_TEST_TIME_SCALE", "1") or 1))


def scaled(seconds: float) -> float:
    """A hang guard of `seconds` on the host, times TIME_SCALE."""
    return seconds * TIME_SCALE
