"""deltasync: ship RL weight updates as sparse bitwise deltas.

    import deltasync
    deltasync.ops.encode / apply / digest          # torch.ops.deltasync (CPU; CUDA when built with nvcc)
    deltasync.DeltaPublisher(model, store="file:///path")   # trainer side
    deltasync.DeltaSubscriber(model, store="file:///path")  # any PyTorch model
    deltasync.vllm.DeltaWorkerExtension                     # --worker-extension-cls

Importing works without a GPU; CUDA tensors need a build with the CUDA backend.
"""
from __future__ import annotations

from . import ops
from ._library import has_cuda_ops, library_path

__version__ = "0.1.0"

__all__ = ["ops", "has_cuda_ops", "library_path", "DeltaPublisher", "ShardedDeltaPublisher", "DeltaSubscriber", "__version__"]


def __getattr__(name):
    # Publisher and subscriber pull in the store code; loaded on first use.
    if name == "DeltaPublisher":
        from .publisher import DeltaPublisher

        return DeltaPublisher
    if name == "ShardedDeltaPublisher":
        from .sharded import ShardedDeltaPublisher

        return ShardedDeltaPublisher
    if name == "DeltaSubscriber":
        from .subscriber import DeltaSubscriber

        return DeltaSubscriber
    raise AttributeError(f"module 'deltasync' has no attribute {name!r}")
