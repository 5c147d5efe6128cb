// The CUDA backend against its CPU twin, byte for byte, on the same inputs: every encode result
// (offsets, value offsets, indices, new and base values, and the shadows afterwards) and every
// apply (targets afterwards, or the same error with nothing written). Every test skips where no
// CUDA device exists.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "engine/cpu_engine.hpp"
#include "deltasync/cuda/engine.hpp"
#include "engine/cuda/cuda_calls.hpp"
#include "core/error.hpp"
#include "test_support.hpp"

using namespace deltasync;

namespace {

// ---------------------------------------------------------------------------------------------
// Device memory for tests

class DeviceBytes {
 public:
  // `misalign` bytes into a fresh allocation: a view into a flat buffer, not 16-byte aligned.
  explicit DeviceBytes(size_t size, size_t misalign = 0) : size_(size), misalign_(misalign) {
    if (size_ > 0) cuda::check(cudaMalloc(&data_, size_ + misalign_), "test cudaMalloc");
  }
  explicit DeviceBytes(std::span<const uint8_t> host, size_t misalign = 0) : DeviceBytes(host.size(), misalign) {
    upload(host);
  }
  ~DeviceBytes() {
    if (data_ != nullptr) cudaFree(data_);
  }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;

  void upload(std::span<const uint8_t> host) {
    ASSERT_EQ(host.size(), size_);
    if (size_ > 0) cuda::check(cudaMemcpy(get(), host.data(), size_, cudaMemcpyHostToDevice), "test upload");
  }
  std::vector<uint8_t> download() const {
    std::vector<uint8_t> host(size_);
    if (size_ > 0) cuda::check(cudaMemcpy(host.data(), get(), size_, cudaMemcpyDeviceToHost), "test download");
    return host;
  }
  uint8_t* get() const { return static_cast<uint8_t*>(data_) + (data_ != nullptr ? misalign_ : 0); }
  size_t size() const { return size_; }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
  size_t misalign_ = 0;
};

template <typename T>
std::vector<uint8_t> as_bytes(const std::vector<T>& v) {
  std::vector<uint8_t> bytes(v.size() * sizeof(T));
  if (!bytes.empty()) std::memcpy(bytes.data(), v.data(), bytes.size());
  return bytes;
}

// Equal spans, or the first difference (printing whole arrays of millions is useless).
template <typename T>
testing::AssertionResult same_elements(std::span<const T> got, std::span<const T> want) {
  if (got.size() != want.size())
    return testing::AssertionFailure() << "size " << got.size() << " != expected " << want.size();
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i])
      return testing::AssertionFailure() << "element " << i << ": " << +got[i] << " != expected " << +want[i];
  }
  return testing::AssertionSuccess();
}

template <typename T>
testing::AssertionResult same_elements(std::span<const T> got, const std::vector<T>& want) {
  return same_elements(got, std::span<const T>(want));
}

class CudaEngineTest : public testing::Test {
 protected:
  void SetUp() override {
    if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
    cuda::check(cudaStreamCreate(&stream_), "cudaStreamCreate");
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  cudaStream_t stream_ = nullptr;
};

// Every encode test runs with both select strategies.
class CudaEncodeTest : public CudaEngineTest, public testing::WithParamInterface<cuda::SelectStrategy> {
 protected:
  cuda::EncoderOptions options() const { return cuda::EncoderOptions{GetParam()}; }
};

INSTANTIATE_TEST_SUITE_P(Select, CudaEncodeTest,
                         testing::Values(cuda::SelectStrategy::kTwoPass, cuda::SelectStrategy::kSinglePass),
                         [](const testing::TestParamInfo<cuda::SelectStrategy>& info) {
                           return info.param == cuda::SelectStrategy::kTwoPass ? "TwoPass" : "SinglePass";
                         });

// ---------------------------------------------------------------------------------------------
// A set of tensors mirrored on the host (for the CPU twin) and on the device (for the encoder).
// Both sides start from the same shadow; every step changes `current` identically on both, then
// encodes on both and compares.

class TwinModel {
 public:
  // A tensor whose shadow and current start equal (random bits); `misalign` bytes (a multiple of
  // the width) past a 256-byte aligned address on the device.
  void add(std::string name, uint32_t width, uint64_t numel, uint64_t seed, size_t misalign = 0) {
    auto t = std::make_unique<Tensor>();
    t->name = std::move(name);
    t->width = width;
    t->numel = numel;
    t->current = random_bytes(numel * width, seed);
    t->shadow = t->current;
    t->device_current = std::make_unique<DeviceBytes>(t->current, misalign);
    t->device_shadow = std::make_unique<DeviceBytes>(t->shadow, misalign);
    tensors_.push_back(std::move(t));
  }

  size_t size() const { return tensors_.size(); }
  std::vector<uint8_t>& current(size_t t) { return tensors_[t]->current; }
  uint32_t width(size_t t) const { return tensors_[t]->width; }

  // Changes each element of every tensor with probability `share` to other random bits.
  void change(double share, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::bernoulli_distribution pick(share);
    for (auto& t : tensors_) {
      for (uint64_t i = 0; i < t->numel; ++i) {
        if (pick(rng)) flip(*t, i, rng);
      }
    }
  }
  // Changes every element of every tensor.
  void change_all() {
    for (auto& t : tensors_)
      for (auto& b : t->current) b = static_cast<uint8_t>(~b);
  }
  // Sets element i of tensor t to the given little-endian bits.
  void set(size_t t, uint64_t i, uint32_t bits) {
    Tensor& tensor = *tensors_[t];
    std::memcpy(tensor.current.data() + i * tensor.width, &bits, tensor.width);
  }
  void set_shadow_and_current(size_t t, uint64_t i, uint32_t shadow_bits, uint32_t current_bits) {
    Tensor& tensor = *tensors_[t];
    std::memcpy(tensor.shadow.data() + i * tensor.width, &shadow_bits, tensor.width);
    std::memcpy(tensor.current.data() + i * tensor.width, &current_bits, tensor.width);
    tensor.device_shadow->upload(tensor.shadow);
  }

  // Uploads `current`, encodes on both backends and expects identical results and shadows.
  // Returns the number of changed elements.
  uint64_t encode_and_compare(cuda::Encoder& encoder, cudaStream_t stream) {
    std::vector<EncodeItem> host_items, device_items;
    for (auto& t : tensors_) {
      t->device_current->upload(t->current);
      host_items.push_back({t->name, t->current.data(), t->shadow.data(), t->numel, t->width});
      device_items.push_back({t->name, t->device_current->get(), t->device_shadow->get(), t->numel, t->width});
    }
    SparseDelta want;
    cpu::encode(host_items, want);

    cuda::check(encoder.encode(device_items, stream), "encode");
    EXPECT_EQ(encoder.num_tensors(), tensors_.size());
    EXPECT_EQ(encoder.total_changed(), want.indices.size());
    cuda::check(encoder.stage(stream), "stage");
    cuda::check(cudaStreamSynchronize(stream), "synchronize");
    const DeltaView got = encoder.staged();
    EXPECT_TRUE(same_elements(got.offsets, want.offsets)) << "offsets";
    EXPECT_TRUE(same_elements(got.value_offsets, want.value_offsets)) << "value_offsets";
    EXPECT_TRUE(same_elements(got.indices, want.indices)) << "indices";
    EXPECT_TRUE(same_elements(got.values, want.values)) << "values";
    EXPECT_TRUE(same_elements(got.base_values, want.base_values)) << "base_values";
    for (auto& t : tensors_) {
      const std::vector<uint8_t> device_shadow = t->device_shadow->download();
      EXPECT_TRUE(same_elements<uint8_t>(device_shadow, t->shadow)) << "shadow of " << t->name;
      EXPECT_TRUE(same_elements<uint8_t>(device_shadow, t->current)) << "shadow != current for " << t->name;
    }
    return want.indices.size();
  }

 private:
  struct Tensor {
    std::string name;
    uint32_t width = 0;
    uint64_t numel = 0;
    std::vector<uint8_t> current, shadow;
    std::unique_ptr<DeviceBytes> device_current, device_shadow;
  };

  static void flip(Tensor& t, uint64_t i, std::mt19937_64& rng) {
    uint8_t* e = t.current.data() + i * t.width;
    e[rng() % t.width] ^= static_cast<uint8_t>(1u + rng() % 255u);
  }

  std::vector<std::unique_ptr<Tensor>> tensors_;
};

// Sizes around every boundary the kernels care about: empty, single, odd, 16-byte words for each
// width, CUB tiles, the 4096-element chunks of the global position space.
const std::vector<uint64_t> kEdgeSizes = {0,   1,   2,    3,    7,    8,    9,    15,   16,   17,  31,
                                          32,  33,  63,   64,   65,   127,  255,  256,  257,  1023,
                                          1024, 4095, 4096, 4097, 8191, 8192, 12289, 100003};

// ---------------------------------------------------------------------------------------------
// Encode

TEST_P(CudaEncodeTest, EncodeMatchesCpuAcrossEdgeSizesAndWidths) {
  for (uint32_t width : {1u, 2u, 4u}) {
    TwinModel model;
    for (size_t k = 0; k < kEdgeSizes.size(); ++k)
      model.add("w" + std::to_string(width) + "_n" + std::to_string(kEdgeSizes[k]), width, kEdgeSizes[k], 100 + k);
    model.change(0.03, width);
    cuda::Encoder encoder(options());
    EXPECT_GT(model.encode_and_compare(encoder, stream_), 0u) << "width " << width;
  }
}

TEST_P(CudaEncodeTest, EncodeMatchesCpuForEachSizeAlone) {
  cuda::Encoder encoder(options());  // one encoder across different sets: the cached tables must follow
  for (uint32_t width : {1u, 2u, 4u}) {
    for (uint64_t numel : kEdgeSizes) {
      TwinModel model;
      model.add("solo", width, numel, numel * 7 + width);
      model.change(0.2, numel + width);
      model.encode_and_compare(encoder, stream_);
    }
  }
}

// Views into flat buffers: width-aligned but not 16-byte aligned, so the select takes its
// element-wise path; mixed with aligned tensors of every width in one set.
TEST_P(CudaEncodeTest, EncodeMatchesCpuForTensorsNotAlignedTo16Bytes) {
  TwinModel model;
  uint64_t seed = 500;
  for (uint32_t width : {1u, 2u, 4u}) {
    for (size_t misalign : {size_t{0}, size_t{width}, size_t{8}, size_t{12}}) {
      if (misalign % width != 0) continue;
      for (uint64_t numel : {1ull, 4095ull, 4096ull, 9001ull})
        model.add("w" + std::to_string(width) + "_m" + std::to_string(misalign) + "_n" + std::to_string(numel), width,
                  numel, ++seed, misalign);
    }
  }
  model.change(0.05, 77);
  cuda::Encoder encoder(options());
  EXPECT_GT(model.encode_and_compare(encoder, stream_), 0u);
}

// One width per set: the select writes values packed directly (no strided scratch), and a set's
// last chunk ends inside its last tensor.
TEST_P(CudaEncodeTest, EncodeMatchesCpuForSingleWidthSets) {
  for (uint32_t width : {1u, 2u, 4u}) {
    TwinModel model;
    model.add("a", width, 4096 * 3 + 17, width);
    model.add("empty", width, 0, width + 1);
    model.add("b", width, 70000, width + 2);
    model.change(0.02, width + 3);
    cuda::Encoder encoder(options());
    EXPECT_GT(model.encode_and_compare(encoder, stream_), 0u) << "width " << width;
    model.change(0.5, width + 4);
    EXPECT_GT(model.encode_and_compare(encoder, stream_), 0u) << "width " << width;
  }
}

TEST_P(CudaEncodeTest, EncodeOfNothingChangedIsEmpty) {
  TwinModel model;
  for (uint32_t width : {1u, 2u, 4u}) model.add("same" + std::to_string(width), width, 10007, width);
  cuda::Encoder encoder(options());
  EXPECT_EQ(model.encode_and_compare(encoder, stream_), 0u);
}

TEST_P(CudaEncodeTest, EncodeOfEverythingChangedHasEveryPosition) {
  TwinModel model;
  uint64_t total = 0;
  for (uint32_t width : {1u, 2u, 4u}) {
    for (uint64_t numel : {1ull, 4097ull, 30001ull}) {
      model.add("all" + std::to_string(width) + "_" + std::to_string(numel), width, numel, numel + width);
      total += numel;
    }
  }
  model.change_all();
  cuda::Encoder encoder(options());
  EXPECT_EQ(model.encode_and_compare(encoder, stream_), total);
}

TEST_P(CudaEncodeTest, EncodeComparesBitsNotFloatValues) {
  TwinModel model;
  model.add("fp8", 1, 8, 1);
  model.add("bf16", 2, 8, 2);
  model.add("fp32", 4, 8, 3);
  // Each pair below is equal as a float comparison would see it (or NaN, never equal), but the
  // bits differ, so each is a change; the last element of each tensor keeps identical NaN bits.
  const uint32_t fp8_pairs[][2] = {{0x00, 0x80}, {0x7F, 0x7E}, {0xFF, 0xFE}};
  const uint32_t bf16_pairs[][2] = {{0x0000, 0x8000}, {0x7FC0, 0x7FC1}, {0xFFC0, 0x7FC0}};
  const uint32_t fp32_pairs[][2] = {{0x00000000, 0x80000000}, {0x7FC00000, 0x7FC00001}, {0x7F800001, 0x7FC00000}};
  for (int k = 0; k < 3; ++k) {
    model.set_shadow_and_current(0, k, fp8_pairs[k][0], fp8_pairs[k][1]);
    model.set_shadow_and_current(1, k, bf16_pairs[k][0], bf16_pairs[k][1]);
    model.set_shadow_and_current(2, k, fp32_pairs[k][0], fp32_pairs[k][1]);
  }
  model.set_shadow_and_current(0, 7, 0x7F, 0x7F);
  model.set_shadow_and_current(1, 7, 0x7FC1, 0x7FC1);
  model.set_shadow_and_current(2, 7, 0x7FC00001, 0x7FC00001);
  cuda::Encoder encoder(options());
  EXPECT_EQ(model.encode_and_compare(encoder, stream_), 9u);
}

TEST_P(CudaEncodeTest, EncodeOfHundredsOfSmallMixedTensorsIsOneCall) {
  TwinModel model;
  std::mt19937_64 rng(42);
  for (int t = 0; t < 600; ++t) {
    const uint32_t width = 1u << (rng() % 3);
    model.add("layer." + std::to_string(t), width, rng() % 700, 1000 + t);
  }
  model.change(0.05, 7);
  cuda::Encoder encoder(options());
  EXPECT_GT(model.encode_and_compare(encoder, stream_), 0u);
}

TEST_P(CudaEncodeTest, RepeatedEncodesGrowOnlyWhenNeededAndReuseBuffers) {
  // Three million bf16 elements: more than the encoder's first output capacity, so the dense
  // step must grow and rerun the select (the shadow must survive the aborted first pass).
  TwinModel model;
  model.add("embed", 2, 3'000'000, 1);
  model.add("odd", 1, 4099, 2);
  model.add("norm", 4, 513, 3);
  cuda::Encoder encoder(options());

  model.change(0.001, 10);
  model.encode_and_compare(encoder, stream_);

  model.change(0.9, 11);
  EXPECT_GT(model.encode_and_compare(encoder, stream_), uint64_t{1} << 21);
  const size_t grown = encoder.workspace_bytes();
  const int64_t* indices = encoder.device_indices();
  const uint8_t* values = encoder.device_values();
  EXPECT_GE(encoder.peak_workspace_bytes(), grown);

  // Smaller steps afterwards reuse the same buffers.
  for (int step = 0; step < 3; ++step) {
    model.change(0.01 * step, 12 + step);
    model.encode_and_compare(encoder, stream_);
    EXPECT_EQ(encoder.workspace_bytes(), grown);
    EXPECT_EQ(encoder.device_indices(), indices);
    EXPECT_EQ(encoder.device_values(), values);
  }
  // An unchanged model after all that: nothing, and the shadow still equals current.
  EXPECT_EQ(model.encode_and_compare(encoder, stream_), 0u);
}

// More than 2^31 elements in one tensor and in the set. Needs ~4.3 GB of device memory; the data
// is all zeros except a few known changes, so the expected result is written down directly.
TEST_P(CudaEncodeTest, EncodeHandlesMoreThanTwoToThe31Elements) {
  const uint64_t big = (uint64_t{1} << 31) + 100;
  size_t free_bytes = 0, total_bytes = 0;
  cuda::check(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
  if (free_bytes < 2 * big + (uint64_t{1} << 30)) GTEST_SKIP() << "needs ~5 GB of free device memory";

  DeviceBytes small_current(5), small_shadow(5), big_current(big), big_shadow(big);
  for (const DeviceBytes* d : {&small_current, &small_shadow, &big_current, &big_shadow})
    cuda::check(cudaMemset(d->get(), 0, d->size()), "memset");
  const std::vector<int64_t> big_changes = {0, (int64_t{1} << 31) - 1, int64_t{1} << 31, (int64_t{1} << 31) + 99};
  for (size_t k = 0; k < big_changes.size(); ++k) {
    const uint8_t v = static_cast<uint8_t>(k + 1);
    cuda::check(cudaMemcpy(big_current.get() + big_changes[k], &v, 1, cudaMemcpyHostToDevice), "poke");
  }
  const uint8_t small_value = 9;
  cuda::check(cudaMemcpy(small_current.get() + 4, &small_value, 1, cudaMemcpyHostToDevice), "poke");

  const std::vector<EncodeItem> items = {{"small", small_current.get(), small_shadow.get(), 5, 1},
                                         {"big", big_current.get(), big_shadow.get(), big, 1}};
  cuda::Encoder encoder(options());
  cuda::check(encoder.encode(items, stream_), "encode");
  cuda::check(encoder.stage(stream_), "stage");
  cuda::check(cudaStreamSynchronize(stream_), "synchronize");
  const DeltaView got = encoder.staged();
  EXPECT_TRUE(same_elements(got.offsets, std::vector<uint64_t>{0, 1, 5}));
  EXPECT_TRUE(same_elements(got.value_offsets, std::vector<uint64_t>{0, 1, 5}));
  std::vector<int64_t> want_indices = {4};
  want_indices.insert(want_indices.end(), big_changes.begin(), big_changes.end());
  EXPECT_TRUE(same_elements(got.indices, want_indices));
  EXPECT_TRUE(same_elements(got.values, std::vector<uint8_t>{9, 1, 2, 3, 4}));
  EXPECT_TRUE(same_elements(got.base_values, std::vector<uint8_t>{0, 0, 0, 0, 0}));

  // The shadows caught up everywhere: a second encode finds nothing.
  cuda::check(encoder.encode(items, stream_), "encode again");
  EXPECT_EQ(encoder.total_changed(), 0u);
}

// ---------------------------------------------------------------------------------------------
// Apply

// Targets on both sides plus patches whose indices and values live on both sides too.
class TwinPatches {
 public:
  void add_target(std::string name, uint32_t width, uint64_t numel, uint64_t seed) {
    auto t = std::make_unique<Target>();
    t->name = std::move(name);
    t->width = width;
    t->numel = numel;
    t->host = random_bytes(numel * width, seed);
    t->device = std::make_unique<DeviceBytes>(t->host);
    targets_.push_back(std::move(t));
  }
  // A patch for the last target added: `indices` as given (int32 or int64), random values.
  template <typename Index>
  void set_patch(const std::vector<Index>& indices, uint64_t seed, uint32_t value_width = 0) {
    Target& t = *targets_.back();
    t.index_width = sizeof(Index);
    t.count = indices.size();
    t.value_width = value_width == 0 ? t.width : value_width;
    t.indices = as_bytes(indices);
    t.values = random_bytes(indices.size() * t.value_width, seed);
    t.device_indices = std::make_unique<DeviceBytes>(t.indices);
    t.device_values = std::make_unique<DeviceBytes>(t.values);
  }

  std::vector<TensorRef> host_targets() {
    std::vector<TensorRef> refs;
    for (auto& t : targets_) refs.push_back({t->name, t->host.data(), t->numel, t->width});
    return refs;
  }
  std::vector<TensorRef> device_targets() {
    std::vector<TensorRef> refs;
    for (auto& t : targets_) refs.push_back({t->name, t->device->get(), t->numel, t->width});
    return refs;
  }
  std::vector<PatchRef> host_patches() const {
    std::vector<PatchRef> refs;
    for (auto& t : targets_)
      refs.push_back({t->count, t->indices.data(), t->index_width, t->values.data(), t->value_width});
    return refs;
  }
  std::vector<PatchRef> device_patches() const {
    std::vector<PatchRef> refs;
    for (auto& t : targets_) {
      refs.push_back({t->count, t->device_indices ? t->device_indices->get() : nullptr, t->index_width,
                      t->device_values ? t->device_values->get() : nullptr, t->value_width});
    }
    return refs;
  }
  // Device targets equal host targets, byte for byte.
  void expect_targets_agree() const {
    for (auto& t : targets_) EXPECT_TRUE(same_elements<uint8_t>(t->device->download(), t->host)) << t->name;
  }

 private:
  struct Target {
    std::string name;
    uint32_t width = 0;
    uint64_t numel = 0;
    std::vector<uint8_t> host;
    std::unique_ptr<DeviceBytes> device;
    uint64_t count = 0;
    uint32_t index_width = 8;
    uint32_t value_width = 0;
    std::vector<uint8_t> indices, values;
    std::unique_ptr<DeviceBytes> device_indices, device_values;
  };
  std::vector<std::unique_ptr<Target>> targets_;
};

// `count` strictly ascending positions in [0, numel), spread at random.
std::vector<int64_t> ascending_positions(uint64_t numel, uint64_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> all(numel);
  for (uint64_t i = 0; i < numel; ++i) all[i] = static_cast<int64_t>(i);
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(count);
  std::sort(all.begin(), all.end());
  return all;
}

std::vector<int32_t> narrow(const std::vector<int64_t>& v) { return {v.begin(), v.end()}; }

// A valid set over several widths and both index widths, including empty patches.
TwinPatches valid_patches() {
  TwinPatches p;
  p.add_target("a.bf16", 2, 100000, 1);
  p.set_patch(ascending_positions(100000, 3000, 1), 11);
  p.add_target("b.fp32.int32", 4, 7777, 2);
  p.set_patch(narrow(ascending_positions(7777, 7777, 2)), 12);  // every element
  p.add_target("c.empty_patch", 2, 50, 3);
  p.add_target("d.fp8", 1, 4097, 4);
  p.set_patch(narrow(ascending_positions(4097, 1, 4)), 14);
  p.add_target("e.fp8.int64", 1, 300000, 5);
  p.set_patch(ascending_positions(300000, 150000, 5), 15);
  return p;
}

TEST_F(CudaEngineTest, ApplyMatchesCpu) {
  TwinPatches p = valid_patches();
  cpu::apply(p.host_targets(), p.host_patches());
  cuda::Applier applier;
  cuda::apply_checked(applier, p.device_targets(), p.device_patches(), stream_);
  EXPECT_LT(applier.status().bad_tensor, 0);
  p.expect_targets_agree();
}

TEST_F(CudaEngineTest, ApplyOfNoPatchesIsValid) {
  cuda::Applier applier;
  cuda::apply_checked(applier, {}, {}, stream_);
  EXPECT_LT(applier.status().bad_tensor, 0);
  TwinPatches p;
  p.add_target("untouched", 2, 10, 1);
  cuda::apply_checked(applier, p.device_targets(), p.device_patches(), stream_);
  p.expect_targets_agree();
}

TEST_F(CudaEngineTest, RepeatedAppliesReuseTheApplier) {
  cuda::Applier applier;
  for (int round = 0; round < 3; ++round) {
    TwinPatches p = valid_patches();
    cpu::apply(p.host_targets(), p.host_patches());
    // Asynchronous form: queue, synchronize, read the status.
    cuda::check(applier.apply(p.device_targets(), p.device_patches(), stream_), "apply");
    cuda::check(cudaStreamSynchronize(stream_), "synchronize");
    EXPECT_LT(applier.status().bad_tensor, 0) << cuda::describe(applier.status(), p.device_targets());
    p.expect_targets_agree();
  }
}

// An invalid set: the CUDA error must be the CPU twin's, and no target may change at all
// (including the valid patches before and after the bad one).
void expect_rejected_like_cpu(TwinPatches& p, cudaStream_t stream, const std::string& must_mention) {
  const std::string cpu_message = error_message([&] { cpu::apply(p.host_targets(), p.host_patches()); });
  cuda::Applier applier;
  const std::string cuda_message =
      error_message([&] { cuda::apply_checked(applier, p.device_targets(), p.device_patches(), stream); });
  EXPECT_EQ(cuda_message, cpu_message);
  EXPECT_NE(cuda_message.find(must_mention), std::string::npos) << cuda_message;
  EXPECT_GE(applier.status().bad_tensor, 0);
  EXPECT_EQ(cuda::describe(applier.status(), p.device_targets()), cuda_message);
  p.expect_targets_agree();  // the CPU twin wrote nothing either
}

TEST_F(CudaEngineTest, ApplyRejectsIndexOutOfRangeAndWritesNothing) {
  TwinPatches p = valid_patches();
  p.add_target("f.bad", 2, 100, 6);
  p.set_patch(std::vector<int64_t>{1, 5, 99, 123}, 16);
  p.add_target("g.after", 2, 1000, 7);
  p.set_patch(ascending_positions(1000, 10, 7), 17);
  expect_rejected_like_cpu(p, stream_, "tensor f.bad: index 123 out of range [0, 100)");
}

TEST_F(CudaEngineTest, ApplyRejectsNegativeInt32Index) {
  TwinPatches p;
  p.add_target("neg", 4, 100, 1);
  p.set_patch(std::vector<int32_t>{-1, 3}, 2);
  expect_rejected_like_cpu(p, stream_, "tensor neg: index -1 out of range [0, 100)");
}

TEST_F(CudaEngineTest, ApplyRejectsUnsortedIndicesDeepInsideALargePatch) {
  TwinPatches p = valid_patches();
  // Position 70001 repeats its predecessor: the violation sits across thread and block
  // boundaries of the validator; a later out-of-range index in the same tensor must not win.
  std::vector<int64_t> indices = ascending_positions(200000, 100000, 8);
  indices[70001] = indices[70000];
  indices[90000] = 500000;
  p.add_target("h.unsorted", 2, 200000, 8);
  p.set_patch(indices, 18);
  expect_rejected_like_cpu(p, stream_, "tensor h.unsorted: indices not strictly ascending at position 70001");
}

TEST_F(CudaEngineTest, ApplyReportsTheFirstBadTensor) {
  TwinPatches p;
  p.add_target("first_ok", 2, 10, 1);
  p.set_patch(std::vector<int64_t>{0, 9}, 1);
  p.add_target("second_bad", 2, 10, 2);
  p.set_patch(std::vector<int64_t>{3, 2}, 2);
  p.add_target("third_bad", 2, 10, 3);
  p.set_patch(std::vector<int64_t>{10}, 3);
  expect_rejected_like_cpu(p, stream_, "tensor second_bad: indices not strictly ascending at position 1");
}

TEST_F(CudaEngineTest, ApplyRejectsValueWidthMismatchBeforeIndexErrors) {
  TwinPatches p;
  p.add_target("index_bad", 2, 10, 1);
  p.set_patch(std::vector<int64_t>{10}, 1);
  p.add_target("width_bad", 2, 10, 2);
  p.set_patch(std::vector<int64_t>{1, 2}, 2, /*value_width=*/4);
  expect_rejected_like_cpu(p, stream_, "tensor width_bad: values are 4-byte but the tensor is 2-byte");
}


// ---------------------------------------------------------------------------------------------
// Checks made on the host before anything is queued: these run (and must pass) without a GPU.
// The pointers below are never dereferenced by either backend.

TEST(CudaEngineHostChecks, EncoderRejectsABadWidthLikeTheCpuTwin) {
  std::vector<uint8_t> current(12), shadow(12);
  const EncodeItem bad{"odd_width", current.data(), shadow.data(), 4, 3};
  SparseDelta ignored;
  const std::string cpu_message = error_message([&] { cpu::encode({&bad, 1}, ignored); });
  cuda::Encoder encoder;
  const std::string message = error_message([&] { cuda::check(encoder.encode({&bad, 1}, nullptr), "encode"); });
  EXPECT_EQ(message, cpu_message);
  EXPECT_NE(message.find("tensor odd_width"), std::string::npos) << message;
}

TEST(CudaEngineHostChecks, ApplierRejectsMalformedPatchesLikeTheCpuTwin) {
  std::vector<uint8_t> target(64);
  std::vector<int64_t> indices = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
  std::vector<uint8_t> values(40);
  const std::vector<TensorRef> targets = {{"t0", target.data(), 8, 2}, {"t1", target.data(), 8, 2}};
  const PatchRef fine{2, indices.data(), 8, values.data(), 2};
  const std::vector<std::vector<PatchRef>> malformed = {
      {fine},                                              // fewer patches than tensors
      {fine, PatchRef{2, indices.data(), 2, values.data(), 2}},  // 2-byte indices
      {fine, PatchRef{9, indices.data(), 8, values.data(), 2}},  // more changes than elements
  };
  const std::vector<std::string> expected = {"1 patches for 2 tensors", "tensor t1: index width 2",
                                             "tensor t1: 9 changes for 8 elements"};
  for (size_t k = 0; k < malformed.size(); ++k) {
    const std::string cpu_message = error_message([&] { cpu::validate(targets, malformed[k]); });
    cuda::Applier applier;
    const std::string message =
        error_message([&] { cuda::check(applier.apply(targets, malformed[k], nullptr), "apply"); });
    EXPECT_EQ(message, cpu_message);
    EXPECT_NE(message.find(expected[k]), std::string::npos) << message;
  }
}

TEST(CudaEngineHostChecks, DescribeWordsEveryFailureLikeTheCpuTwin) {
  std::vector<uint8_t> target(200);
  const std::vector<TensorRef> targets = {{"ok", target.data(), 100, 2}, {"bad", target.data(), 100, 2}};
  std::vector<uint8_t> values(16);
  const std::vector<int64_t> fine = {1, 2};
  const std::vector<int64_t> out_of_range = {1, 5, 123};
  const std::vector<int64_t> unsorted = {1, 5, 7, 7};
  struct Failure {
    PatchRef patch;
    cuda::ApplyStatus status;
  };
  const std::vector<Failure> failures = {
      {{3, out_of_range.data(), 8, values.data(), 2}, {1, cuda::kIndexOutOfRange, 123}},
      {{4, unsorted.data(), 8, values.data(), 2}, {1, cuda::kIndexNotAscending, 3}},
      {{2, fine.data(), 8, values.data(), 4}, {1, cuda::kWidthMismatch, 4}},
  };
  for (const Failure& f : failures) {
    const std::vector<PatchRef> patches = {{2, fine.data(), 8, values.data(), 2}, f.patch};
    const std::string cpu_message = error_message([&] { cpu::validate(targets, patches); });
    EXPECT_EQ(cuda::describe(f.status, targets), cpu_message);
  }
}

// ---------------------------------------------------------------------------------------------
// Encode then apply, all on the device: a base copy patched with the encoder's device arrays
// becomes bit-identical to the current weights.

TEST_P(CudaEncodeTest, EncodedDeltaAppliedToTheBaseReproducesCurrent) {
  const std::vector<std::pair<uint32_t, uint64_t>> shapes = {{2, 123457}, {1, 4096}, {4, 999}, {2, 0}, {2, 70000}};
  std::vector<std::vector<uint8_t>> base, current;
  std::vector<std::unique_ptr<DeviceBytes>> device_current, device_shadow, device_target;
  std::vector<std::string> names;
  std::mt19937_64 rng(5);
  for (size_t t = 0; t < shapes.size(); ++t) {
    const auto [width, numel] = shapes[t];
    names.push_back("p" + std::to_string(t));
    base.push_back(random_bytes(numel * width, t + 1));
    current.push_back(base.back());
    for (uint64_t i = 0; i < numel; ++i)
      if (rng() % 50 == 0) current.back()[i * width + rng() % width] ^= 0x01;
    device_current.push_back(std::make_unique<DeviceBytes>(current.back()));
    device_shadow.push_back(std::make_unique<DeviceBytes>(base.back()));
    device_target.push_back(std::make_unique<DeviceBytes>(base.back()));
  }
  std::vector<EncodeItem> items;
  std::vector<TensorRef> targets;
  for (size_t t = 0; t < shapes.size(); ++t) {
    const auto [width, numel] = shapes[t];
    items.push_back({names[t], device_current[t]->get(), device_shadow[t]->get(), numel, width});
    targets.push_back({names[t], device_target[t]->get(), numel, width});
  }
  cuda::Encoder encoder(options());
  cuda::check(encoder.encode(items, stream_), "encode");
  cuda::check(encoder.stage(stream_), "stage");
  cuda::check(cudaStreamSynchronize(stream_), "synchronize");
  const DeltaView staged = encoder.staged();
  ASSERT_EQ(staged.num_tensors(), shapes.size());

  std::vector<PatchRef> patches;
  for (size_t t = 0; t < shapes.size(); ++t) {
    patches.push_back({staged.count(t), encoder.device_indices() + staged.offsets[t], 8,
                       encoder.device_values() + staged.value_offsets[t], shapes[t].first});
  }
  cuda::Applier applier;
  cuda::apply_checked(applier, targets, patches, stream_);
  for (size_t t = 0; t < shapes.size(); ++t)
    EXPECT_TRUE(same_elements<uint8_t>(device_target[t]->download(), current[t])) << names[t];
}

}  // namespace
