#include "inputs.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "core/error.hpp"
#include "core/parse_number.hpp"
#include "core/parallel.hpp"

namespace deltasync::bench {

namespace {

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

double uniform_open(uint64_t& state) {  // (0, 1]
  return (static_cast<double>(splitmix64(state) >> 11) + 1.0) * (1.0 / 9007199254740992.0);
}

// Qwen3-0.6B: hidden 1024, 28 layers, 16 query heads and 8 key/value heads of 128, MLP 3072,
// vocabulary 151936 with tied embeddings. The point is the mix of sizes a real model has.
std::vector<TensorShape> qwen3_0_6b_shapes() {
  constexpr uint64_t hidden = 1024, layers = 28, head = 128, q_heads = 16, kv_heads = 8, mlp = 3072, vocab = 151936;
  std::vector<TensorShape> s;
  s.push_back({"model.embed_tokens.weight", vocab * hidden});
  for (uint64_t l = 0; l < layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    s.push_back({p + "input_layernorm.weight", hidden});
    s.push_back({p + "self_attn.q_proj.weight", q_heads * head * hidden});
    s.push_back({p + "self_attn.k_proj.weight", kv_heads * head * hidden});
    s.push_back({p + "self_attn.v_proj.weight", kv_heads * head * hidden});
    s.push_back({p + "self_attn.o_proj.weight", hidden * q_heads * head});
    s.push_back({p + "self_attn.q_norm.weight", head});
    s.push_back({p + "self_attn.k_norm.weight", head});
    s.push_back({p + "post_attention_layernorm.weight", hidden});
    s.push_back({p + "mlp.gate_proj.weight", mlp * hidden});
    s.push_back({p + "mlp.up_proj.weight", mlp * hidden});
    s.push_back({p + "mlp.down_proj.weight", hidden * mlp});
  }
  s.push_back({"model.norm.weight", hidden});
  return s;
}

}  // namespace

std::vector<TensorShape> model_shapes(const std::string& tensors_axis, uint64_t total) {
  if (total == 0) throw Error("axis Elements: must be at least 1");
  if (tensors_axis == "model") {
    std::vector<TensorShape> shapes = qwen3_0_6b_shapes();
    uint64_t full = 0;
    for (const auto& s : shapes) full += s.numel;
    if (total < shapes.size()) throw Error("axis Tensors=model needs Elements >= " + std::to_string(shapes.size()));
    const double scale = static_cast<double>(total) / static_cast<double>(full);
    uint64_t sum = 0;
    for (auto& s : shapes) {
      s.numel = std::max<uint64_t>(1, static_cast<uint64_t>(std::llround(static_cast<double>(s.numel) * scale)));
      sum += s.numel;
    }
    // Rounding drift goes to the embedding, the largest tensor, so every size stays positive.
    shapes.front().numel = shapes.front().numel + total - sum;
    return shapes;
  }
  const uint64_t count = parse_decimal<uint64_t>(tensors_axis, "axis Tensors", ErrorKind::kInvalidArgument);
  if (count == 0) throw Error("axis Tensors: " + tensors_axis + " is not a positive count or \"model\"");
  if (count > total) throw Error("axis Tensors: " + tensors_axis + " tensors exceed Elements=" + std::to_string(total));
  std::vector<TensorShape> shapes;
  const uint64_t each = total / count;
  for (uint64_t t = 0; t < count; ++t)
    shapes.push_back({"tensor." + std::to_string(t), t + 1 == count ? total - each * (count - 1) : each});
  return shapes;
}

AlignedBytes allocate_aligned(size_t bytes) {
  AlignedBytes out;
  // HugeBuffer aligns to 64 bytes at least, so every tensor offset (a multiple of 64) stays on
  // its own cache line.
  out.buffer = HugeBuffer(std::max<size_t>(bytes, 1));
  out.size = bytes;
  return out;
}

void fill_random(std::span<uint8_t> bytes, uint64_t seed) {
  constexpr size_t kChunk = size_t{1} << 22;
  const size_t chunks = (bytes.size() + kChunk - 1) / kChunk;
  parallel_for(chunks, [&](size_t c) {
    uint64_t state = seed * 0x100000001B3ull + c;
    const size_t begin = c * kChunk, end = std::min(bytes.size(), begin + kChunk);
    size_t i = begin;
    for (; i + 8 <= end; i += 8) {
      const uint64_t v = splitmix64(state);
      std::memcpy(bytes.data() + i, &v, 8);
    }
    for (; i < end; ++i) bytes[i] = static_cast<uint8_t>(splitmix64(state));
  });
}

std::vector<std::vector<int64_t>> random_changes(std::span<const TensorShape> shapes, double share, uint64_t seed) {
  if (!(share >= 0 && share <= 1)) throw Error("axis ChangedShare: must be within [0, 1]");
  std::vector<std::vector<int64_t>> out(shapes.size());
  parallel_for(shapes.size(), [&](size_t t) {
    uint64_t state = seed ^ (0xD1B54A32D192ED03ull * (t + 1));
    const uint64_t n = shapes[t].numel;
    auto& pos = out[t];
    if (share <= 0) return;
    if (share >= 1) {
      pos.resize(n);
      for (uint64_t i = 0; i < n; ++i) pos[i] = static_cast<int64_t>(i);
      return;
    }
    pos.reserve(static_cast<size_t>(static_cast<double>(n) * share * 1.1) + 16);
    // Gaps between Bernoulli(share) successes are geometric: skip straight to the next one.
    const double log_keep = std::log1p(-share);
    double next = std::floor(std::log(uniform_open(state)) / log_keep);
    while (next < static_cast<double>(n)) {
      pos.push_back(static_cast<int64_t>(next));
      next += 1 + std::floor(std::log(uniform_open(state)) / log_keep);
    }
  });
  return out;
}

HostModel::HostModel(std::vector<TensorShape> shapes, uint32_t width) : shapes_(std::move(shapes)), width_(width) {
  offsets_.reserve(shapes_.size());
  for (const auto& s : shapes_) {
    offsets_.push_back(arena_bytes_);
    total_ += s.numel;
    arena_bytes_ += (s.numel * width_ + 63) / 64 * 64;
  }
}

std::vector<TensorRef> HostModel::refs(uint8_t* arena) const {
  std::vector<TensorRef> out;
  for (size_t t = 0; t < shapes_.size(); ++t) out.push_back({shapes_[t].name, arena + offsets_[t], shapes_[t].numel, width_});
  return out;
}

std::vector<ConstTensorRef> HostModel::const_refs(const uint8_t* arena) const {
  std::vector<ConstTensorRef> out;
  for (size_t t = 0; t < shapes_.size(); ++t) out.push_back({shapes_[t].name, arena + offsets_[t], shapes_[t].numel, width_});
  return out;
}

std::vector<EncodeItem> HostModel::encode_items(const uint8_t* current, uint8_t* shadow) const {
  std::vector<EncodeItem> out;
  for (size_t t = 0; t < shapes_.size(); ++t)
    out.push_back({shapes_[t].name, current + offsets_[t], shadow + offsets_[t], shapes_[t].numel, width_});
  return out;
}

uint64_t derive_changed_copy(const HostModel& model, const uint8_t* src, uint8_t* dst,
                             const std::vector<std::vector<int64_t>>& changes, uint64_t seed) {
  constexpr size_t kChunk = size_t{1} << 24;
  const size_t bytes = model.arena_bytes();
  parallel_for((bytes + kChunk - 1) / kChunk, [&](size_t c) {
    const size_t begin = c * kChunk;
    std::memcpy(dst + begin, src + begin, std::min(kChunk, bytes - begin));
  });
  const uint32_t w = model.width();
  parallel_for(changes.size(), [&](size_t t) {
    uint64_t state = seed ^ (0xA0761D6478BD642Full * (t + 1));
    uint8_t* base = dst + model.offset(t);
    for (int64_t i : changes[t]) {
      uint8_t* e = base + static_cast<uint64_t>(i) * w;
      uint32_t bits = 0;
      std::memcpy(&bits, e, w);
      const uint64_t r = splitmix64(state);
      const uint32_t mask = w == 4 ? 0xFFFFFFFFu : (1u << (8 * w)) - 1;
      uint32_t next = (r & 7) ? bits + ((r >> 3) & 1 ? 1u : mask) : static_cast<uint32_t>(r >> 8);
      next &= mask;
      if (next == bits) next = bits ^ 1u;  // a change must change the bits
      std::memcpy(e, &next, w);
    }
  });
  return count_changes(changes);
}

uint64_t count_changes(const std::vector<std::vector<int64_t>>& changes) {
  uint64_t n = 0;
  for (const auto& c : changes) n += c.size();
  return n;
}

}  // namespace deltasync::bench
