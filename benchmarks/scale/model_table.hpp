// The tensor table of a DeepSeek-V3 / Kimi-K2-like MoE (names, count and dim-0 sizes as published;
// the trailing dimensions divided by a scale divisor) and how a TP/EP-sharded inference rank maps
// each tensor, as vLLM's DeepSeek-V2/V3 model does: MLA's q_b/kv_b column-parallel, o_proj
// row-parallel, q_a/kv_a and norms replicated, embed/lm_head vocab-parallel, routed experts whole
// per EP rank, shared and dense MLPs tensor-parallel (gate/up by rows, down by columns).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/placement.hpp"
#include "core/tensor_meta.hpp"

namespace deltasync::scale_model {

struct ModelShape {
  uint64_t layers = 61;
  uint64_t dense_layers = 1;  // Kimi-K2: first_k_dense_replace 1 (DeepSeek-V3: 3)
  uint64_t experts = 384;     // routed, per MoE layer (+1 shared)
  uint64_t hidden = 7168, moe_intermediate = 2048, dense_intermediate = 18432, vocab = 163840;
  uint64_t heads = 64, q_lora_rank = 1536, kv_lora_rank = 512, qk_nope = 128, qk_rope = 64, v_head = 128;
  uint64_t divisor = 1024;  // trailing dimensions divided by this (rounded up); dim 0 kept
};

enum class Role { kReplicated, kRows, kColumns, kExpert };

struct ModelTensor {
  TensorMeta meta;       // scaled shape
  uint64_t full_numel;   // numel at full width
  Role role;
  uint64_t expert = 0;   // kExpert: which routed expert
};

std::vector<ModelTensor> model_table(const ModelShape& shape);

// The full positions inference rank `rank` of `tp` (TP = EP = tp) holds of a tensor (an empty
// placement: none). Routed experts go to EP rank expert / (experts / tp), in contiguous blocks.
Placement receiver_placement(const ModelTensor& t, const ModelShape& shape, uint64_t rank, uint64_t tp);

}  // namespace deltasync::scale_model
