"""Loads the native operator library (torch.ops.deltasync) once per process.

Where it is looked for, first hit wins:
  1. $DELTASYNC_OPS_LIBRARY (a path to _deltasync_ops.so, e.g. in a CMake build tree);
  2. next to this file (where `pip install .` puts it).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

_LIBRARY_NAME = "_deltasync_ops.so"
_loaded_from: str | None = None


def library_path() -> Path:
    override = os.environ.get("DELTASYNC_OPS_LIBRARY")
    if override:
        return Path(override)
    return Path(__file__).with_name(_LIBRARY_NAME)


def load() -> str:
    """Loads the library if needed and returns the path it was loaded from."""
    global _loaded_from
    if _loaded_from is None:
        path = library_path()
        if not path.is_file():
            raise ImportError(
                f"deltasync: native operators not found at {path}; build them (pip install "
                f"--no-build-isolation . from the repository root) or set DELTASYNC_OPS_LIBRARY"
            )
        torch.ops.load_library(str(path))
        _loaded_from = str(path)
    return _loaded_from


def has_cuda_ops() -> bool:
    """True when the loaded library registered CUDA implementations (built with nvcc)."""
    load()
    return torch._C._dispatch_has_kernel_for_dispatch_key("deltasync::encode", "CUDA")
