"""deltasync inside vLLM: `--worker-extension-cls deltasync.vllm.DeltaWorkerExtension`.

    llm = LLM(model=..., worker_extension_cls="deltasync.vllm.DeltaWorkerExtension")
    llm.collective_rpc("deltasync_init", args=("file:///bucket",))   # learn maps, load newest
    llm.collective_rpc("deltasync_update")                           # -> per-worker reports

See docs/torch.md for what was and was not run against real vLLM.
"""
from .extension import DeltaWorkerExtension
from .index_map import IndexMap, learn_index_maps

__all__ = ["DeltaWorkerExtension", "IndexMap", "learn_index_maps"]
