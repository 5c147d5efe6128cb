#include "scale/model_table.hpp"

namespace deltasync::scale_model {
namespace {

uint64_t scaled(uint64_t dim, uint64_t divisor) { return (dim + divisor - 1) / divisor; }

}  // namespace

std::vector<ModelTensor> model_table(const ModelShape& s) {
  std::vector<ModelTensor> out;
  auto add = [&](std::string name, std::vector<uint64_t> full, Role role, uint64_t expert = 0) {
    std::vector<uint64_t> shape = full;
    for (size_t d = 1; d < shape.size(); ++d) shape[d] = scaled(shape[d], s.divisor);
    uint64_t full_numel = 1;
    for (uint64_t d : full) full_numel *= d;
    out.push_back(ModelTensor{TensorMeta{std::move(name), DType::BF16, std::move(shape)}, full_numel, role, expert});
  };
  const uint64_t H = s.hidden;
  add("model.embed_tokens.weight", {s.vocab, H}, Role::kRows);
  for (uint64_t l = 0; l < s.layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "input_layernorm.weight", {H}, Role::kReplicated);
    add(p + "post_attention_layernorm.weight", {H}, Role::kReplicated);
    add(p + "self_attn.q_a_proj.weight", {s.q_lora_rank, H}, Role::kReplicated);
    add(p + "self_attn.q_a_layernorm.weight", {s.q_lora_rank}, Role::kReplicated);
    add(p + "self_attn.q_b_proj.weight", {s.heads * (s.qk_nope + s.qk_rope), s.q_lora_rank}, Role::kRows);
    add(p + "self_attn.kv_a_proj_with_mqa.weight", {s.kv_lora_rank + s.qk_rope, H}, Role::kReplicated);
    add(p + "self_attn.kv_a_layernorm.weight", {s.kv_lora_rank}, Role::kReplicated);
    add(p + "self_attn.kv_b_proj.weight", {s.heads * (s.qk_nope + s.v_head), s.kv_lora_rank}, Role::kRows);
    add(p + "self_attn.o_proj.weight", {H, s.heads * s.v_head}, Role::kColumns);
    if (l < s.dense_layers) {
      add(p + "mlp.gate_proj.weight", {s.dense_intermediate, H}, Role::kRows);
      add(p + "mlp.up_proj.weight", {s.dense_intermediate, H}, Role::kRows);
      add(p + "mlp.down_proj.weight", {H, s.dense_intermediate}, Role::kColumns);
      continue;
    }
    add(p + "mlp.gate.weight", {s.experts, H}, Role::kReplicated);
    add(p + "mlp.gate.e_score_correction_bias", {s.experts}, Role::kReplicated);
    for (uint64_t e = 0; e < s.experts; ++e) {
      const std::string x = p + "mlp.experts." + std::to_string(e) + ".";
      add(x + "gate_proj.weight", {s.moe_intermediate, H}, Role::kExpert, e);
      add(x + "up_proj.weight", {s.moe_intermediate, H}, Role::kExpert, e);
      add(x + "down_proj.weight", {H, s.moe_intermediate}, Role::kExpert, e);
    }
    add(p + "mlp.shared_experts.gate_proj.weight", {s.moe_intermediate, H}, Role::kRows);
    add(p + "mlp.shared_experts.up_proj.weight", {s.moe_intermediate, H}, Role::kRows);
    add(p + "mlp.shared_experts.down_proj.weight", {H, s.moe_intermediate}, Role::kColumns);
  }
  add("model.norm.weight", {H}, Role::kReplicated);
  add("lm_head.weight", {s.vocab, H}, Role::kRows);
  return out;
}

Placement receiver_placement(const ModelTensor& t, const ModelShape& s, uint64_t rank, uint64_t tp) {
  switch (t.role) {
    case Role::kReplicated:
      return whole_placement(t.meta.numel());
    case Role::kRows:
      return shard_placement(t.meta.shape, 0, rank, tp);
    case Role::kColumns:
      return shard_placement(t.meta.shape, 1, rank, tp);
    case Role::kExpert: {
      const uint64_t per_rank = (s.experts + tp - 1) / tp;
      return t.expert / per_rank == rank ? whole_placement(t.meta.numel()) : Placement{};
    }
  }
  return {};
}

}  // namespace deltasync::scale_model
