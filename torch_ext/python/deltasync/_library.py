"""Loads the native library once per process: the extension module `_deltasync_ops`, which
registers torch.ops.deltasync when it loads and binds the C++ Publisher and Subscriber.

Where it is looked for, first hit wins:
  1. $DELTASYNC_OPS_LIBRARY (a path to _deltasync_ops.so, e.g. in a CMake build tree);
  2. next to this file (where `pip install .` puts it).
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import torch  # noqa: F401  (torch's libraries must be loaded before ours)

_LIBRARY_NAME = "_deltasync_ops.so"
_MODULE_NAME = "deltasync._deltasync_ops"
_module = None
_loaded_from: str | None = None


def library_path() -> Path:
    override = os.environ.get("DELTASYNC_OPS_LIBRARY")
    if override:
        return Path(override)
    return Path(__file__).with_name(_LIBRARY_NAME)


def native():
    """The native module (loading it registers torch.ops.deltasync)."""
    global _module, _loaded_from
    if _module is None:
        path = library_path()
        if not path.is_file():
            raise ImportError(
                f"deltasync: native library not found at {path}; build it (pip install "
                f"--no-build-isolation . from the repository root) or set DELTASYNC_OPS_LIBRARY"
            )
        spec = importlib.util.spec_from_file_location(_MODULE_NAME, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[_MODULE_NAME] = module
        spec.loader.exec_module(module)
        _module, _loaded_from = module, str(path)
    return _module


def load() -> str:
    """Loads the library if needed and returns the path it was loaded from."""
    native()
    return _loaded_from


def has_cuda_ops() -> bool:
    """True when the loaded library registered CUDA implementations (built with nvcc)."""
    load()
    return torch._C._dispatch_has_kernel_for_dispatch_key("deltasync::encode", "CUDA")
