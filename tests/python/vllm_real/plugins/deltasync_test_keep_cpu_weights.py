"""TEST-ONLY vLLM plugin: keeps vLLM-CPU's weights in its parameters, as vLLM on CUDA does.

Stock vLLM-CPU (0.32) repacks weights after loading for its own kernels:
- linear layers (`UnquantizedLinearMethod.process_weights_after_loading` ->
  `vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)`)
  hand the weight to oneDNN / sgl-kernel prepacked GEMMs and leave an empty Parameter behind;
- MoE experts (`CPUUnquantizedExperts.process_weights_after_loading`, used by its x86/Arm/Power
  subclasses too) are prepacked in place into a grouped-GEMM layout of the same shape.
Neither can be updated in place. This plugin replaces the first by torch.nn.functional.linear on
the parameter and the second by a plain PyTorch MoE over the unpacked w13/w2, so a test can run
real vLLM's loaders, model code, scheduler and prefix cache on weights that stay where vLLM's
loaders put them. Nothing in site-packages is edited.

It is found through this folder's dist-info when the folder is on PYTHONPATH (so spawned engine
and worker processes load it too) and acts only when DELTASYNC_TEST_KEEP_CPU_WEIGHTS=1.
"""
import os

import torch


def _linear_on_parameter(layer, remove_weight=False):
    layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)


def _keep_unpacked(self, layer):
    self._use_zentorch = False


def _torch_moe(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
               expert_map, *args, **kwargs):
    if expert_map is not None:
        raise NotImplementedError("deltasync test MoE: no expert parallelism")
    x = hidden_states.float()
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32)
    for e in range(w1.shape[0]):
        token, slot = (topk_ids == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        gate_up = x[token] @ w1[e].float().t()
        half = gate_up.shape[1] // 2
        y = (torch.nn.functional.silu(gate_up[:, :half]) * gate_up[:, half:]) @ w2[e].float().t()
        out.index_add_(0, token, y * topk_weights[token, slot].float()[:, None])
    output.copy_(out.to(output.dtype))


def register():
    if os.environ.get("DELTASYNC_TEST_KEEP_CPU_WEIGHTS") != "1":
        return
    import vllm.model_executor.layers.utils as layer_utils
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    layer_utils.dispatch_cpu_unquantized_gemm = _linear_on_parameter
    cpu_moe.CPUUnquantizedExperts.process_weights_after_loading = _keep_unpacked
    cpu_moe.CPUUnquantizedExperts.apply = _torch_moe
