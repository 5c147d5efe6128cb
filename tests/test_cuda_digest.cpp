// GPU digests against the CPU: same bits for every width, size (empty, tiny, ragged, many
// tiles), alignment and output location (device or pinned), and digest shifts equal to
// digest_update.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "deltasync/cuda/digest.hpp"
#include "deltasync/cuda/engine.hpp"
#include "engine/cuda/cuda_calls.hpp"
#include "codec/digest.hpp"

namespace ds = deltasync;

namespace {

#define SKIP_WITHOUT_GPU() \
  if (!ds::cuda::device_available()) GTEST_SKIP() << "no CUDA device: GPU digests cannot run here"

struct DeviceBytes {
  void* ptr = nullptr;
  explicit DeviceBytes(size_t n) { ds::cuda::check(cudaMalloc(&ptr, n ? n : 1), "cudaMalloc"); }
  ~DeviceBytes() { cudaFree(ptr); }
  uint8_t* data() const { return static_cast<uint8_t*>(ptr); }
};

std::vector<uint8_t> random_bytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> out(n);
  for (auto& b : out) b = static_cast<uint8_t>(rng());
  return out;
}

// Host tensors of the given sizes and widths packed into one device buffer. Each tensor starts
// `misalign` bytes past a 256-byte boundary (rounded to its width) to exercise the unaligned path.
struct Set {
  std::vector<std::vector<uint8_t>> host;
  std::vector<ds::ConstTensorRef> host_refs, device_refs;
  std::unique_ptr<DeviceBytes> device;

  Set(const std::vector<uint64_t>& sizes, const std::vector<uint32_t>& widths, size_t misalign, uint64_t seed) {
    std::vector<size_t> offsets;
    size_t total = 0;
    for (size_t t = 0; t < sizes.size(); ++t) {
      host.push_back(random_bytes(sizes[t] * widths[t], seed + t));
      total = (total + 255) / 256 * 256 + misalign / widths[t] * widths[t];
      offsets.push_back(total);
      total += sizes[t] * widths[t];
    }
    device = std::make_unique<DeviceBytes>(total);
    for (size_t t = 0; t < sizes.size(); ++t) {
      ds::cuda::check(cudaMemcpy(device->data() + offsets[t], host[t].data(), host[t].size(), cudaMemcpyHostToDevice),
                      "upload");
      host_refs.push_back({"t", host[t].data(), sizes[t], widths[t]});
      device_refs.push_back({"t", device->data() + offsets[t], sizes[t], widths[t]});
    }
  }
};

}  // namespace

TEST(CudaDigest, MatchesCpuForEveryWidthSizeAndAlignment) {
  SKIP_WITHOUT_GPU();
  const std::vector<uint64_t> sizes = {0, 1, 3, 17, 65'535, 65'536, 65'537, 1'000'003, 4'194'304, 7};
  for (uint32_t width : {1u, 2u, 4u}) {
    for (size_t misalign : {size_t{0}, size_t{4}, size_t{6}}) {
      SCOPED_TRACE(testing::Message() << "width " << width << " misalign " << misalign);
      const std::vector<uint32_t> widths(sizes.size(), width);
      Set set(sizes, widths, misalign, 100 * width + misalign);
      EXPECT_EQ(ds::cuda::digest_device_tensors(set.device_refs), ds::digest_tensors(set.host_refs));
    }
  }
}

TEST(CudaDigest, MixedWidthsInOneLaunchIntoPinnedMemory) {
  SKIP_WITHOUT_GPU();
  Set set({300'001, 4096, 0, 2'000'000, 5}, {2, 4, 2, 1, 4}, 0, 7);
  void* pinned_raw = nullptr;
  ds::cuda::check(cudaMallocHost(&pinned_raw, 5 * sizeof(uint64_t)), "cudaMallocHost");
  auto* pinned = static_cast<uint64_t*>(pinned_raw);
  cudaStream_t stream;
  ds::cuda::check(cudaStreamCreate(&stream), "stream");
  ds::cuda::Digester digester;
  // Twice through the same Digester: the workspace is reused.
  for (int round = 0; round < 2; ++round) {
    std::fill(pinned, pinned + 5, 0xAAAAAAAAAAAAAAAAull);
    ASSERT_EQ(digester.digest(set.device_refs, pinned, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_EQ(std::vector<uint64_t>(pinned, pinned + 5), ds::digest_tensors(set.host_refs)) << round;
  }
  cudaStreamDestroy(stream);
  cudaFreeHost(pinned);
}

TEST(CudaDigest, RejectsUnsupportedWidth) {
  SKIP_WITHOUT_GPU();
  DeviceBytes buf(64);
  DeviceBytes out(8);
  const ds::ConstTensorRef bad{"f64", buf.data(), 8, 8};
  ds::cuda::Digester digester;
  EXPECT_EQ(digester.digest(std::span(&bad, 1), reinterpret_cast<uint64_t*>(out.data()), nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(ds::cuda::take_refusal(), "digest: tensor f64 has 8-byte elements; digests cover 1-, 2- and 4-byte elements");
}

TEST(CudaDigest, RefusesDataNotAlignedToItsElements) {
  // The kernels load 2- and 4-byte elements whole: a bf16 view at an odd address is refused
  // (the CPU twin reads it byte-wise), not left to fault the device.
  SKIP_WITHOUT_GPU();
  DeviceBytes buf(64);
  DeviceBytes out(8);
  const ds::ConstTensorRef odd{"w", static_cast<const uint8_t*>(buf.data()) + 1, 8, 2};
  ds::cuda::Digester digester;
  EXPECT_EQ(digester.digest(std::span(&odd, 1), reinterpret_cast<uint64_t*>(out.data()), nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(ds::cuda::take_refusal(), "digest: tensor w: data not aligned to its 2-byte elements");
}

TEST(CudaDigest, ShiftsEqualCpuDigestUpdate) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(5);
  for (uint32_t index_width : {4u, 8u}) {
    const std::vector<uint64_t> sizes = {500'000, 70'000, 33};
    const std::vector<uint32_t> widths = {2, 4, 1};
    Set set(sizes, widths, 0, 40 + index_width);
    const auto before = ds::digest_tensors(set.host_refs);

    // Random patches; keep the old bits, then write the new bits on the device and the host.
    std::vector<std::vector<uint8_t>> idx_host(3), old_host(3), new_host(3);
    std::vector<std::unique_ptr<DeviceBytes>> idx_dev, old_dev;
    std::vector<ds::PatchRef> patches;
    std::vector<const void*> old_ptrs;
    for (size_t t = 0; t < 3; ++t) {
      const uint64_t n = sizes[t], w = widths[t], count = t == 2 ? 0 : n / 50;
      std::vector<int64_t> pos(n);
      std::iota(pos.begin(), pos.end(), 0);
      std::shuffle(pos.begin(), pos.end(), rng);
      pos.resize(count);
      std::sort(pos.begin(), pos.end());
      idx_host[t].resize(count * index_width);
      for (uint64_t k = 0; k < count; ++k) {
        if (index_width == 4) {
          const int32_t v = static_cast<int32_t>(pos[k]);
          std::memcpy(&idx_host[t][4 * k], &v, 4);
        } else {
          std::memcpy(&idx_host[t][8 * k], &pos[k], 8);
        }
      }
      new_host[t] = random_bytes(count * w, 900 + t);
      old_host[t].resize(count * w);
      for (uint64_t k = 0; k < count; ++k) {
        std::memcpy(&old_host[t][k * w], &set.host[t][pos[k] * w], w);
        std::memcpy(&set.host[t][pos[k] * w], &new_host[t][k * w], w);
      }
      // The "scatter": the device copy of the tensor now holds the new bits too.
      ds::cuda::check(cudaMemcpy(const_cast<void*>(set.device_refs[t].data), set.host[t].data(), set.host[t].size(),
                                 cudaMemcpyHostToDevice),
                      "write new bits");
      idx_dev.push_back(std::make_unique<DeviceBytes>(idx_host[t].size()));
      old_dev.push_back(std::make_unique<DeviceBytes>(old_host[t].size()));
      ds::cuda::check(cudaMemcpy(idx_dev[t]->data(), idx_host[t].data(), idx_host[t].size(), cudaMemcpyHostToDevice), "idx");
      ds::cuda::check(cudaMemcpy(old_dev[t]->data(), old_host[t].data(), old_host[t].size(), cudaMemcpyHostToDevice), "old");
      patches.push_back({count, idx_dev[t]->data(), index_width, nullptr, static_cast<uint32_t>(w)});
      old_ptrs.push_back(old_dev[t]->data());
    }
    DeviceBytes out(3 * sizeof(uint64_t));
    ds::cuda::Digester digester;
    ASSERT_EQ(digester.shifts(set.device_refs, patches, old_ptrs, reinterpret_cast<uint64_t*>(out.data()), nullptr),
              cudaSuccess);
    std::vector<uint64_t> shift(3);
    ds::cuda::check(cudaMemcpy(shift.data(), out.data(), 3 * sizeof(uint64_t), cudaMemcpyDeviceToHost), "download");
    const auto after = ds::digest_tensors(set.host_refs);
    for (size_t t = 0; t < 3; ++t) EXPECT_EQ(before[t] + shift[t], after[t]) << "tensor " << t << " index width " << index_width;
    EXPECT_EQ(ds::cuda::digest_device_tensors(set.device_refs), after);
  }
}
