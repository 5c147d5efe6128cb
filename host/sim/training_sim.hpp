// A stand-in for an RL trainer: a transformer-shaped set of bf16 weights with fp32 master
// copies, updated by AdamW from noisy gradients at RL learning rates. Every step produces the
// bf16 checkpoint a trainer would publish; the difference to the previous one is the delta.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "format/delta_file.hpp"

namespace deltasync::sim {

struct ModelShape {
  uint64_t vocab = 8192;
  uint64_t hidden = 1024;
  uint64_t intermediate = 2816;
  uint64_t layers = 2;
  uint64_t kv_heads_dim = 1024;  // k/v projection output size (GQA models use less than hidden)
};

struct AdamW {
  double lr = 1e-6;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
  // Gradient = persistent per-element signal + per-step noise of noise_ratio times its size.
  double noise_ratio = 3.0;
};

class TrainingSim {
 public:
  TrainingSim(const ModelShape& shape, uint64_t seed);

  // Resets master weights, optimizer state and the published bf16 copy to the initial model.
  void reset();
  // One AdamW step; refreshes bf16() from the master weights (round to nearest even).
  void step(const AdamW& opt);

  const std::vector<deltasync::TensorMeta>& tensors() const { return meta_; }
  uint64_t total_elements() const { return total_; }
  // The current bf16 bits of tensor t.
  const uint16_t* bf16(size_t t) const { return bf16_.data() + offset_[t]; }
  int step_count() const { return step_; }

 private:
  struct Init {
    double mean, stddev;
  };
  std::vector<deltasync::TensorMeta> meta_;
  std::vector<Init> init_;
  std::vector<uint64_t> offset_;  // element offset of each tensor in the flat arrays
  uint64_t total_ = 0;
  uint64_t seed_;
  int step_ = 0;
  std::vector<float> master_, m_, v_;
  std::vector<uint16_t> bf16_;
};

}  // namespace deltasync::sim
