// cuda::LowByteEncoder by itself (the engine's low-byte tests compare it with the CPU twin):
// staging after an encode on another stream, and staging with no encode to stage. Skips where
// no CUDA device exists.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "deltasync/cuda/engine.hpp"
#include "deltasync/cuda/low_byte.hpp"
#include "engine/cuda/cuda_calls.hpp"

namespace ds = deltasync;

namespace {

#define SKIP_WITHOUT_GPU() \
  if (!ds::cuda::device_available()) GTEST_SKIP() << "no CUDA device: the low-byte encoder cannot run here"

struct Device {
  void* ptr = nullptr;
  Device(const void* host, size_t n) {
    ds::cuda::check(cudaMalloc(&ptr, n), "cudaMalloc");
    ds::cuda::check(cudaMemcpy(ptr, host, n, cudaMemcpyHostToDevice), "upload");
  }
  ~Device() { cudaFree(ptr); }
};

struct Stream {
  cudaStream_t s = nullptr;
  Stream() { ds::cuda::check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate"); }
  ~Stream() { cudaStreamDestroy(s); }
};

}  // namespace

TEST(CudaLowByte, StagesTheEncodeOnAnotherStreamAndRefusesWithoutOne) {
  SKIP_WITHOUT_GPU();
  // Two bf16 tensors large enough that the encode's kernels are still running when stage() is
  // queued on a second stream: the staged copy must wait for them.
  const std::vector<uint64_t> numel = {3'000'000, 1'000'001};
  std::mt19937_64 rng(5);
  std::vector<std::vector<uint16_t>> current(2);
  std::vector<std::vector<uint8_t>> shadow(2);
  std::vector<std::vector<int64_t>> expected(2);
  for (size_t t = 0; t < 2; ++t) {
    current[t].resize(numel[t]);
    shadow[t].resize(numel[t]);
    for (uint64_t i = 0; i < numel[t]; ++i) {
      current[t][i] = static_cast<uint16_t>(rng());
      shadow[t][i] = static_cast<uint8_t>(current[t][i]);
      if (rng() % 97 == 0) {
        shadow[t][i] ^= 0x5A;
        expected[t].push_back(static_cast<int64_t>(i));
      }
    }
  }
  std::vector<Device> cur, sh;
  cur.reserve(2);
  sh.reserve(2);
  std::vector<ds::EncodeItem> items;
  const std::string names[2] = {"a", "b"};
  for (size_t t = 0; t < 2; ++t) {
    cur.emplace_back(current[t].data(), numel[t] * 2);
    sh.emplace_back(shadow[t].data(), numel[t]);
    items.push_back({names[t], cur[t].ptr, sh[t].ptr, numel[t], 2});
  }
  // The pageable uploads may still be in flight, and the encode's stream does not wait for them.
  ds::cuda::check(cudaDeviceSynchronize(), "upload");
  ds::cuda::LowByteEncoder encoder;
  Stream encode_stream, stage_stream;
  ASSERT_EQ(encoder.encode(items, encode_stream.s), cudaSuccess);
  ASSERT_EQ(encoder.stage(stage_stream.s), cudaSuccess);
  ds::cuda::check(cudaStreamSynchronize(stage_stream.s), "synchronize");
  const ds::DeltaView staged = encoder.staged();
  ASSERT_EQ(staged.offsets.size(), 3u);
  for (size_t t = 0; t < 2; ++t) {
    SCOPED_TRACE(names[t]);
    ASSERT_EQ(staged.count(t), expected[t].size());
    for (uint64_t k = 0; k < expected[t].size(); ++k) {
      ASSERT_EQ(staged.indices[staged.offsets[t] + k], expected[t][k]) << "change " << k;
      uint16_t value = 0;
      std::memcpy(&value, staged.values.data() + staged.value_offsets[t] + 2 * k, 2);
      ASSERT_EQ(value, current[t][static_cast<size_t>(expected[t][k])]) << "change " << k;
    }
  }
  // A take_shadow replaces the encode's tensor table: nothing is left to stage.
  ASSERT_EQ(encoder.take_shadow(items, encode_stream.s), cudaSuccess);
  EXPECT_EQ(encoder.stage(stage_stream.s), cudaErrorInvalidValue);
  EXPECT_EQ(ds::cuda::take_refusal(), "low-byte stage: no encode to stage (none yet, or a take_shadow since)");
  ds::cuda::check(cudaStreamSynchronize(encode_stream.s), "synchronize");
}
