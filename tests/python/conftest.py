"""Shared fixtures for the Python suite: where the built binaries are, and a CLI runner."""
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def bin_dir() -> Path:
    return Path(os.environ.get("DELTASYNC_BIN", REPO / "build" / "bin"))


@pytest.fixture(scope="session")
def deltasync_bin() -> Path:
    path = bin_dir()
    if not (path / "deltasync").exists():
        pytest.fail(f"deltasync CLI not built: {path / 'deltasync'} is missing (run scripts/test or set DELTASYNC_BIN)")
    return path


@pytest.fixture(scope="session")
def run_cli(deltasync_bin):
    """run_cli(*args, check=True, env=None) -> CompletedProcess with text stdout/stderr."""

    def run(*args, check=True, env=None, timeout=300):
        full_env = dict(os.environ)
        if env:
            full_env.update(env)
        proc = subprocess.run([str(deltasync_bin / "deltasync"), *map(str, args)], capture_output=True, text=True,
                              env=full_env, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"deltasync {' '.join(map(str, args))} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    return run
