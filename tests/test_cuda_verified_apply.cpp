// The one verified apply (integrity::apply_verified) on the device transaction
// (engine::CudaPatchTransaction over cuda::SavingApplier) against the CPU one: same weights and
// digests on success, wrong base refused with nothing written, result mismatch rolled back bit
// for bit, invalid patch refused.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/cpu_engine.hpp"
#include "deltasync/cuda/engine.hpp"
#include "deltasync/cuda/saving_apply.hpp"
#include "engine/cuda/cuda_calls.hpp"
#include "engine/cuda/cuda_patch_transaction.hpp"
#include "codec/digest.hpp"
#include "core/error.hpp"
#include "engine/integrity.hpp"
#include "core/sparse_delta.hpp"

namespace ds = deltasync;
namespace in = deltasync::integrity;

namespace {

#define SKIP_WITHOUT_GPU() \
  if (!ds::cuda::device_available()) GTEST_SKIP() << "no CUDA device: the GPU verified apply cannot run here"

struct DeviceBytes {
  void* ptr = nullptr;
  explicit DeviceBytes(size_t n) { ds::cuda::check(cudaMalloc(&ptr, n ? n : 1), "cudaMalloc"); }
  DeviceBytes(const void* host, size_t n) : DeviceBytes(n) {
    ds::cuda::check(cudaMemcpy(ptr, host, n, cudaMemcpyHostToDevice), "upload");
  }
  ~DeviceBytes() { cudaFree(ptr); }
  std::vector<uint8_t> download(size_t n) const {
    std::vector<uint8_t> out(n);
    ds::cuda::check(cudaMemcpy(out.data(), ptr, n, cudaMemcpyDeviceToHost), "download");
    return out;
  }
};

// An fp8, a bf16 and an f32 tensor on the host and the device, a next state, and the delta. The
// fp8 tensor comes first so that the saved bits of the others would be misaligned if packed.
struct Fixture {
  std::vector<std::string> names = {"a", "b", "c"};
  std::vector<uint64_t> numel = {100'000, 333, 5'000};
  std::vector<uint32_t> width = {1, 2, 4};
  std::vector<std::vector<uint8_t>> base, next;
  ds::SparseDelta delta;
  std::vector<std::unique_ptr<DeviceBytes>> weights, indices, values;
  in::DeltaDigests expected;

  Fixture() {
    std::mt19937_64 rng(9);
    std::vector<ds::TensorMeta> metas;
    std::vector<ds::EncodeItem> items;
    for (size_t t = 0; t < 3; ++t) {
      base.emplace_back(numel[t] * width[t]);
      for (auto& x : base[t]) x = static_cast<uint8_t>(rng());
      next.push_back(base[t]);
      for (uint64_t i = 0; i < numel[t]; ++i)
        if (t != 1 && rng() % 50 == 0) next[t][i * width[t]] ^= 1;
      const ds::DType dtype = width[t] == 1 ? ds::DType::F8_E4M3 : width[t] == 2 ? ds::DType::BF16 : ds::DType::F32;
      metas.push_back({names[t], dtype, {numel[t]}});
    }
    auto shadow = base;
    for (size_t t = 0; t < 3; ++t) items.push_back({names[t], next[t].data(), shadow[t].data(), numel[t], width[t]});
    ds::cpu::encode(items, delta);
    const auto view = delta.view();
    expected = in::delta_digests(metas, view, ds::digest_tensors(host_refs(base)), 2, 1);
    for (size_t t = 0; t < 3; ++t) {
      weights.push_back(std::make_unique<DeviceBytes>(base[t].data(), base[t].size()));
      indices.push_back(std::make_unique<DeviceBytes>(view.indices.data() + view.offsets[t], view.count(t) * 8));
      values.push_back(std::make_unique<DeviceBytes>(view.values.data() + view.value_offsets[t], view.count(t) * width[t]));
    }
  }
  std::vector<ds::ConstTensorRef> host_refs(const std::vector<std::vector<uint8_t>>& d) const {
    std::vector<ds::ConstTensorRef> out;
    for (size_t t = 0; t < 3; ++t) out.push_back({names[t], d[t].data(), numel[t], width[t]});
    return out;
  }
  std::vector<ds::TensorRef> targets() const {
    std::vector<ds::TensorRef> out;
    for (size_t t = 0; t < 3; ++t) out.push_back({names[t], weights[t]->ptr, numel[t], width[t]});
    return out;
  }
  std::vector<ds::PatchRef> patches() const {
    std::vector<ds::PatchRef> out;
    for (size_t t = 0; t < 3; ++t) out.push_back({delta.view().count(t), indices[t]->ptr, 8, values[t]->ptr, width[t]});
    return out;
  }
  std::vector<std::vector<uint8_t>> device_state() const {
    std::vector<std::vector<uint8_t>> out;
    for (size_t t = 0; t < 3; ++t) out.push_back(weights[t]->download(numel[t] * width[t]));
    return out;
  }
};

// The device transaction under the one policy, on the legacy default stream.
in::ApplyReport apply_on_device(ds::cuda::SavingApplier& applier, const Fixture& f,
                                const std::vector<ds::PatchRef>& patches, const in::DeltaDigests& expected,
                                std::vector<uint64_t>& current) {
  ds::engine::CudaPatchTransaction transaction(applier, nullptr);
  const std::vector<ds::TensorRef> targets = f.targets();
  return in::apply_verified(targets, patches, expected, current, 1, transaction);
}

}  // namespace

TEST(CudaVerifiedApply, AppliesLikeTheCpu) {
  SKIP_WITHOUT_GPU();
  Fixture f;
  std::vector<uint64_t> current = ds::digest_tensors(f.host_refs(f.base));
  ds::cuda::SavingApplier applier;
  const auto report = apply_on_device(applier, f, f.patches(), f.expected, current);
  EXPECT_EQ(report.elements_changed, f.delta.view().total_changed());
  EXPECT_EQ(f.device_state(), f.next);
  EXPECT_EQ(current, ds::digest_tensors(f.host_refs(f.next)));
}

TEST(CudaVerifiedApply, WrongBaseWritesNothing) {
  SKIP_WITHOUT_GPU();
  Fixture f;
  std::vector<uint64_t> current = ds::digest_tensors(f.host_refs(f.base));
  current[0] ^= 1;  // the receiver's "a" is not the delta's base
  ds::cuda::SavingApplier applier;
  EXPECT_THROW(apply_on_device(applier, f, f.patches(), f.expected, current), ds::Error);
  EXPECT_EQ(f.device_state(), f.base);
}

TEST(CudaVerifiedApply, ResultMismatchRollsBackBitExactly) {
  SKIP_WITHOUT_GPU();
  Fixture f;
  f.expected.result["c"] += 1;
  std::vector<uint64_t> current = ds::digest_tensors(f.host_refs(f.base));
  const auto before = current;
  ds::cuda::SavingApplier applier;
  try {
    apply_on_device(applier, f, f.patches(), f.expected, current);
    ADD_FAILURE() << "no error";
  } catch (const ds::Error& e) {
    EXPECT_NE(std::string(e.what()).find("result digest mismatch for tensor c"), std::string::npos) << e.what();
  }
  EXPECT_EQ(f.device_state(), f.base);
  EXPECT_EQ(current, before);
}

TEST(CudaVerifiedApply, InvalidPatchWritesNothing) {
  SKIP_WITHOUT_GPU();
  Fixture f;
  auto patches = f.patches();
  // Last position of "c" beyond the tensor.
  const int64_t past_end = static_cast<int64_t>(f.numel[2]);
  ds::cuda::check(cudaMemcpy(static_cast<int64_t*>(f.indices[2]->ptr) + patches[2].count - 1, &past_end, 8,
                             cudaMemcpyHostToDevice),
                  "poison index");
  std::vector<uint64_t> current = ds::digest_tensors(f.host_refs(f.base));
  ds::cuda::SavingApplier applier;
  EXPECT_THROW(apply_on_device(applier, f, patches, f.expected, current), ds::Error);
  EXPECT_EQ(f.device_state(), f.base);
}

TEST(CudaVerifiedApply, HeaderErrorsAreRefusedBeforeTheSaveReadsAPosition) {
  // The save reads the patch positions before the scatter: a patch the Applier would refuse (a
  // 2-byte index width here, whose positions array is too short to read as int64) is refused
  // before the save is queued, with the Applier's words, and nothing is written.
  SKIP_WITHOUT_GPU();
  Fixture f;
  auto patches = f.patches();
  patches[1].index_width = 2;
  patches[1].count = 1;
  ds::cuda::SavingApplier applier;
  const auto targets = f.targets();
  EXPECT_EQ(applier.apply(targets, patches, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(ds::cuda::take_refusal(), "tensor b: index width 2 is not 4 or 8 bytes");
  ds::cuda::check(cudaDeviceSynchronize(), "synchronize");
  EXPECT_EQ(f.device_state(), f.base);
  // A value-width mismatch is the status's to report (nothing is saved or written) and the
  // tensors after it are not read at all, however they look.
  patches = f.patches();
  patches[0].value_width = 2;
  patches[2].indices = nullptr;
  std::vector<uint64_t> current = ds::digest_tensors(f.host_refs(f.base));
  EXPECT_THROW(apply_on_device(applier, f, patches, f.expected, current), ds::Error);
  EXPECT_EQ(f.device_state(), f.base);
}
