#include "sim/training_sim.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/parallel.hpp"

namespace deltasync::sim {
namespace {

// splitmix64: a stateless hash, so that element i's persistent gradient signal needs no memory
// and every chunk of a parallel loop draws its own reproducible stream.
inline uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// An approximately standard normal number from one 64-bit random word: the sum of four 16-bit
// uniforms (Irwin-Hall), rescaled. Tails stop at ±3.5σ, which is fine for gradient noise.
inline float normal_from(uint64_t r) {
  const uint32_t a = r & 0xFFFF, b = (r >> 16) & 0xFFFF, c = (r >> 32) & 0xFFFF, d = r >> 48;
  const float sum = static_cast<float>(a + b + c + d) * (1.0f / 65536.0f);  // mean 2, variance 1/3
  return (sum - 2.0f) * 1.7320508f;
}

// Box-Muller for the initial weights (runs once; exact normal tails matter for the magnitudes).
inline double exact_normal(uint64_t r1, uint64_t r2) {
  const double u1 = (static_cast<double>(r1 >> 11) + 0.5) * (1.0 / 9007199254740992.0);
  const double u2 = static_cast<double>(r2 >> 11) * (1.0 / 9007199254740992.0);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

inline uint16_t to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN stays NaN
  bits += 0x7FFFu + ((bits >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

constexpr uint64_t kChunk = 1 << 18;

}  // namespace

TrainingSim::TrainingSim(const ModelShape& s, uint64_t seed) : seed_(seed) {
  using deltasync::DType;
  // Initial spread as in GPT-2/Llama inits: matrices N(0, 0.02), output projections scaled by
  // 1/sqrt(2·layers), RMSNorm weights near 1 (trained norms drift, hence a little spread).
  const double out_std = 0.02 / std::sqrt(2.0 * static_cast<double>(s.layers));
  auto add = [&](std::string name, std::vector<uint64_t> shape, double mean, double stddev) {
    meta_.push_back({std::move(name), DType::BF16, std::move(shape)});
    init_.push_back({mean, stddev});
  };
  add("model.embed_tokens.weight", {s.vocab, s.hidden}, 0.0, 0.02);
  for (uint64_t l = 0; l < s.layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "input_layernorm.weight", {s.hidden}, 1.0, 0.05);
    add(p + "self_attn.q_proj.weight", {s.hidden, s.hidden}, 0.0, 0.02);
    add(p + "self_attn.k_proj.weight", {s.kv_heads_dim, s.hidden}, 0.0, 0.02);
    add(p + "self_attn.v_proj.weight", {s.kv_heads_dim, s.hidden}, 0.0, 0.02);
    add(p + "self_attn.o_proj.weight", {s.hidden, s.hidden}, 0.0, out_std);
    add(p + "post_attention_layernorm.weight", {s.hidden}, 1.0, 0.05);
    add(p + "mlp.gate_proj.weight", {s.intermediate, s.hidden}, 0.0, 0.02);
    add(p + "mlp.up_proj.weight", {s.intermediate, s.hidden}, 0.0, 0.02);
    add(p + "mlp.down_proj.weight", {s.hidden, s.intermediate}, 0.0, out_std);
  }
  add("model.norm.weight", {s.hidden}, 1.0, 0.05);
  for (const auto& m : meta_) {
    offset_.push_back(total_);
    total_ += m.numel();
  }
  offset_.push_back(total_);
  master_.resize(total_);
  m_.resize(total_);
  v_.resize(total_);
  bf16_.resize(total_);
  reset();
}

void TrainingSim::reset() {
  step_ = 0;
  for (size_t t = 0; t < meta_.size(); ++t) {
    const uint64_t begin = offset_[t], end = offset_[t + 1];
    const Init init = init_[t];
    const uint64_t chunks = (end - begin + kChunk - 1) / kChunk;
    deltasync::parallel_for(chunks, [&, begin, end, init, t](size_t c) {
      for (uint64_t i = begin + c * kChunk; i < std::min(end, begin + (c + 1) * kChunk); ++i) {
        const uint64_t r = mix(seed_ ^ (i * 2 + 1)), r2 = mix(r ^ 0x5555 ^ t);
        master_[i] = static_cast<float>(init.mean + init.stddev * exact_normal(r, r2));
        m_[i] = 0.0f;
        v_[i] = 0.0f;
        bf16_[i] = to_bf16(master_[i]);
      }
    });
  }
}

void TrainingSim::step(const AdamW& opt) {
  ++step_;
  const float lr = static_cast<float>(opt.lr), b1 = static_cast<float>(opt.beta1), b2 = static_cast<float>(opt.beta2);
  const float c1 = static_cast<float>(1.0 / (1.0 - std::pow(opt.beta1, step_)));
  const float c2 = static_cast<float>(1.0 / (1.0 - std::pow(opt.beta2, step_)));
  const float eps = static_cast<float>(opt.eps), decay = static_cast<float>(opt.lr * opt.weight_decay);
  const float noise = static_cast<float>(opt.noise_ratio);
  const uint64_t step_seed = mix(seed_ + 0x1234567ull * static_cast<uint64_t>(step_));
  const uint64_t chunks = (total_ + kChunk - 1) / kChunk;
  deltasync::parallel_for(chunks, [&](size_t c) {
    const uint64_t end = std::min(total_, (c + 1) * kChunk);
    uint64_t state = mix(step_seed ^ c);
    for (uint64_t i = c * kChunk; i < end; ++i) {
      // Gradient scale 1e-3 (its size does not matter to Adam beyond eps).
      const float signal = normal_from(mix(seed_ ^ 0xABCDEF ^ (i << 1)));
      state = mix(state);
      const float g = 1e-3f * (signal + noise * normal_from(state));
      m_[i] = b1 * m_[i] + (1.0f - b1) * g;
      v_[i] = b2 * v_[i] + (1.0f - b2) * g * g;
      const float update = (m_[i] * c1) / (std::sqrt(v_[i] * c2) + eps);
      master_[i] -= lr * update + decay * master_[i];
      bf16_[i] = to_bf16(master_[i]);
    }
  });
}

}  // namespace deltasync::sim
