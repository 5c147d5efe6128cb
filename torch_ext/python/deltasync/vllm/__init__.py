"""deltasync inside vLLM, two ways onto the same receiver code:

- the native weight-transfer backend "deltasync" (registered by the vLLM plugin entry point):
    llm = LLM(model=..., weight_transfer_config={"backend": "deltasync"})
    llm.init_weight_transfer_engine({"init_info": {"store": "file:///bucket"}})
    llm.start_weight_update(); llm.update_weights({"update_info": {"version": "newest"}})
    llm.finish_weight_update("7")
- the worker extension for collective_rpc users:
    llm = LLM(model=..., worker_extension_cls="deltasync.vllm.DeltaWorkerExtension")
    llm.collective_rpc("deltasync_init", args=("file:///bucket",))
    llm.collective_rpc("deltasync_update")

See docs/torch.md for what was and was not run against real vLLM.
"""
from .extension import DeltaWorkerExtension
from .index_map import IndexMap, learn_index_maps
from .updatable import NotUpdatableError

__all__ = ["DeltaWorkerExtension", "IndexMap", "NotUpdatableError", "learn_index_maps"]
