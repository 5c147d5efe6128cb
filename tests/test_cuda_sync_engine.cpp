// The CUDA sync engine against its CPU twin, byte for byte: encode (full and low-byte shadows,
// raw and device-coded staging), apply of both layouts, refusals (wrong base, tampered result
// digest, corrupt block) with the same message and the weights unchanged, digests, and the
// read/write of anchors, gather/scatter (the mapped receiver's pieces) and the shadow's size.
// Skipped without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "codec/compact_codec.hpp"
#include "codec/delta_io.hpp"
#include "codec/digest.hpp"
#include "deltasync/cuda/engine.hpp"
#include "engine/cuda/cuda_calls.hpp"
#include "engine/cpu_sync_engine.hpp"
#include "engine/cuda/cuda_sync_engine.hpp"
#include "engine/integrity.hpp"
#include "test_support.hpp"

namespace ds = deltasync;
namespace en = deltasync::engine;
namespace in = deltasync::integrity;

namespace {

#define SKIP_WITHOUT_GPU() \
  if (!ds::cuda::device_available()) GTEST_SKIP() << "no CUDA device: the CUDA sync engine cannot run here"

using Bytes = std::vector<uint8_t>;
using Model = std::vector<Bytes>;

struct DeviceBytes {
  void* ptr = nullptr;
  size_t size = 0;
  explicit DeviceBytes(const Bytes& host) : size(host.size()) {
    ds::cuda::check(cudaMalloc(&ptr, size ? size : 1), "cudaMalloc");
    upload(host);
  }
  ~DeviceBytes() { cudaFree(ptr); }
  void upload(const Bytes& host) const {
    ds::cuda::check(cudaMemcpy(ptr, host.data(), host.size(), cudaMemcpyHostToDevice), "upload");
  }
  Bytes download() const {
    Bytes out(size);
    ds::cuda::check(cudaMemcpy(out.data(), ptr, size, cudaMemcpyDeviceToHost), "download");
    return out;
  }
};

// A model's tensors on the host and the same bits on the device.
struct Tensors {
  std::vector<std::string> names;
  std::vector<uint64_t> numel;
  std::vector<uint32_t> width;
  Model host;
  std::vector<std::shared_ptr<DeviceBytes>> device;  // shared: copies of a Tensors describe the same device bits

  size_t size() const { return names.size(); }
  void set(const Model& bits) {
    host = bits;
    device.clear();
    for (const Bytes& b : bits) device.push_back(std::make_shared<DeviceBytes>(b));
  }
  Model device_bits() const {
    Model out;
    for (const auto& d : device) out.push_back(d->download());
    return out;
  }
  std::vector<ds::ConstTensorRef> host_refs() const { return refs<ds::ConstTensorRef>(false); }
  std::vector<ds::ConstTensorRef> device_refs() const { return refs<ds::ConstTensorRef>(true); }
  std::vector<ds::TensorRef> host_targets() { return refs<ds::TensorRef>(false); }
  std::vector<ds::TensorRef> device_targets() { return refs<ds::TensorRef>(true); }
  std::vector<ds::TensorMeta> metas() const {
    std::vector<ds::TensorMeta> out;
    for (size_t t = 0; t < size(); ++t) {
      const ds::DType dtype = width[t] == 1 ? ds::DType::F8_E4M3 : width[t] == 2 ? ds::DType::BF16 : ds::DType::F32;
      out.push_back({names[t], dtype, {numel[t]}});
    }
    return out;
  }

 private:
  template <typename Ref>
  std::vector<Ref> refs(bool on_device) const {
    std::vector<Ref> out;
    for (size_t t = 0; t < size(); ++t) {
      void* data = on_device ? device[t]->ptr : const_cast<uint8_t*>(host[t].data());
      out.push_back(Ref{names[t], data, numel[t], width[t]});
    }
    return out;
  }
};

// Random weights and an optimizer-like step: ~2% of the elements change, mostly in the low
// bits; some changes touch only the high byte (a low-byte shadow misses those by design), and
// one tensor does not change at all.
Model random_model(const Tensors& shape, uint64_t seed) {
  Model m;
  for (size_t t = 0; t < shape.size(); ++t) m.push_back(random_bytes(shape.numel[t] * shape.width[t], seed + t));
  return m;
}

Model step(const Tensors& shape, const Model& from, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Model next = from;
  for (size_t t = 0; t + 1 < shape.size(); ++t) {  // the last tensor never changes
    const uint32_t w = shape.width[t];
    for (uint64_t i = 0; i < shape.numel[t]; ++i) {
      const uint64_t r = rng();
      if (r % 50 != 0) continue;
      uint8_t* e = next[t].data() + i * w;
      if (w >= 2 && (r >> 8) % 5 == 0) e[1] ^= 0x01;  // high byte only
      else e[0] ^= static_cast<uint8_t>(1 + (r >> 16) % 7);
    }
  }
  return next;
}

Tensors shapes_of(std::vector<std::string> names, std::vector<uint64_t> numel, std::vector<uint32_t> width) {
  Tensors s;
  s.names = std::move(names);
  s.numel = std::move(numel);
  s.width = std::move(width);
  return s;
}

// 1-, 2- and 4-byte tensors; the last never changes.
Tensors mixed_shapes() {
  return shapes_of({"embed.weight", "layers.0.scale", "layers.0.norm", "lm_head.weight", "frozen.bias"},
                   {200'003, 4'099, 333, 65'536, 1'000}, {2, 1, 2, 4, 2});
}

// 2-byte tensors only (the low-byte shadow), one of them empty.
Tensors bf16_shapes() {
  return shapes_of({"embed.weight", "layers.0.norm", "layers.0.mlp", "empty", "frozen.bias"},
                   {150'001, 333, 70'000, 0, 1'000}, {2, 2, 2, 2, 2});
}

void expect_same_changes(const en::StagedDelta& cpu, const en::StagedDelta& gpu) {
  EXPECT_EQ(gpu.counts, cpu.counts);
  EXPECT_EQ(gpu.has_base_values, cpu.has_base_values);
  EXPECT_EQ(gpu.changes.offsets, cpu.changes.offsets);
  EXPECT_EQ(gpu.changes.value_offsets, cpu.changes.value_offsets);
  EXPECT_EQ(gpu.changes.indices, cpu.changes.indices);
  EXPECT_EQ(gpu.changes.values, cpu.changes.values);
  EXPECT_EQ(gpu.changes.base_values, cpu.changes.base_values);
  EXPECT_FALSE(gpu.coded_on_device);
}

// The two engines' publish sides fed the same versions.
struct Publish {
  Tensors tensors;
  en::CpuSyncEngine cpu;
  en::CudaSyncEngine gpu;
  Publish(Tensors shapes, en::ShadowKind kind, const Model& first)
      : tensors(std::move(shapes)), cpu(en::EngineOptions{kind, 0}), gpu(en::EngineOptions{kind, 0}) {
    tensors.set(first);
    cpu.reset_shadow(tensors.host_refs());
    gpu.reset_shadow(tensors.device_refs());
  }
  void encode(const Model& next, const en::EncodeRequest& request, en::StagedDelta& on_cpu, en::StagedDelta& on_gpu) {
    tensors.set(next);
    cpu.encode(tensors.host_refs(), request, on_cpu);
    gpu.encode(tensors.device_refs(), request, on_gpu);
  }
};

TEST(CudaSyncEngine, FullShadowRawStagingEqualsTheCpu) {
  SKIP_WITHOUT_GPU();
  const Tensors shapes = mixed_shapes();
  Model v = random_model(shapes, 1);
  Publish p(shapes, en::ShadowKind::kFull, v);
  for (uint64_t version = 2; version <= 3; ++version) {  // the second encode diffs the updated shadow
    v = step(shapes, v, version);
    en::StagedDelta cpu, gpu;
    p.encode(v, {}, cpu, gpu);
    expect_same_changes(cpu, gpu);
    EXPECT_GT(gpu.total_changed(), 0u);
    EXPECT_TRUE(gpu.digest_shifts.empty());
    EXPECT_EQ(gpu.transfer.host_syncs, 2u);
    const uint64_t staged = gpu.changes.indices.size() * 8 + 2 * gpu.changes.values.size();
    EXPECT_GE(gpu.transfer.device_to_host_bytes, staged);
    EXPECT_LE(gpu.transfer.device_to_host_bytes, staged + 64 * (shapes.size() + 1));
  }
}

TEST(CudaSyncEngine, DeviceCodedStagingEqualsCompactEncodeOfTheCpuChanges) {
  SKIP_WITHOUT_GPU();
  const Tensors shapes = mixed_shapes();
  Model v = random_model(shapes, 2);
  Publish p(shapes, en::ShadowKind::kFull, v);
  en::EncodeRequest request;
  request.want_coded = true;
  request.compact.block_elements = 512;  // several blocks per tensor
  for (uint64_t version = 2; version <= 3; ++version) {
    const Model before = v;
    v = step(shapes, v, 10 + version);
    en::StagedDelta cpu, gpu;
    p.encode(v, request, cpu, gpu);
    EXPECT_TRUE(gpu.coded_on_device);
    EXPECT_EQ(gpu.counts, cpu.counts);
    EXPECT_TRUE(gpu.changes.indices.empty());
    EXPECT_TRUE(gpu.changes.values.empty());

    const auto expected = ds::compact::encode(shapes.metas(), cpu.changes.view(), request.compact);
    ASSERT_EQ(gpu.coded.size(), expected.size());
    uint64_t coded_bytes = 0;
    for (size_t i = 0; i < expected.size(); ++i) {
      EXPECT_EQ(gpu.coded[i].name, expected[i].name);
      EXPECT_EQ(gpu.coded[i].changed, expected[i].changed);
      EXPECT_EQ(gpu.coded[i].block_index, expected[i].block_index) << expected[i].name;
      EXPECT_EQ(gpu.coded[i].payload, expected[i].payload) << expected[i].name;
      coded_bytes += expected[i].block_index.size() + expected[i].payload.size();
    }
    // digest(after) - digest(before), as the host computes it from the whole tensors.
    Tensors old = shapes;
    old.host = before;
    const auto d_before = ds::digest_tensors(old.host_refs());
    const auto d_after = ds::digest_tensors(p.tensors.host_refs());
    ASSERT_EQ(gpu.digest_shifts.size(), shapes.size());
    for (size_t t = 0; t < shapes.size(); ++t) EXPECT_EQ(gpu.digest_shifts[t], d_after[t] - d_before[t]) << t;

    // Only the coded bytes, the shifts and per-tensor / per-block tables cross the bus.
    EXPECT_EQ(gpu.transfer.host_syncs, 3u);
    const uint64_t floor = coded_bytes + 8 * shapes.size();
    EXPECT_GE(gpu.transfer.device_to_host_bytes, floor);
    EXPECT_LE(gpu.transfer.device_to_host_bytes, floor + 64 * (shapes.size() + 1) + 1024);
  }
}

// The publisher describes its tensors' shapes (EncodeRequest::tensors): the device codes the
// tiles the CPU codec cuts for those shapes, byte for byte, with one more synchronization.
TEST(CudaSyncEngine, DeviceCodedStagingCutsTheDescribedShapesIntoTheCpusTiles) {
  SKIP_WITHOUT_GPU();
  const Tensors shapes = shapes_of({"attn.w", "mlp.w", "norm", "frozen.bias"}, {512 * 256, 256 * 384, 333, 1'000}, {2, 4, 2, 2});
  std::vector<ds::TensorMeta> described = shapes.metas();
  described[0].shape = {512, 256};
  described[1].shape = {256, 384};
  Model v = random_model(shapes, 4);
  Publish p(shapes, en::ShadowKind::kFull, v);
  en::EncodeRequest request;
  request.want_coded = true;
  request.compact.block_elements = 128;
  request.tensors = described;
  v = step(shapes, v, 21);
  en::StagedDelta cpu, gpu;
  p.encode(v, request, cpu, gpu);
  const auto expected = ds::compact::encode(described, cpu.changes.view(), request.compact);
  ASSERT_EQ(gpu.coded.size(), expected.size());
  uint32_t banded = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(gpu.coded[i].index_version, expected[i].index_version);
    EXPECT_EQ(gpu.coded[i].block_index, expected[i].block_index) << expected[i].name;
    EXPECT_EQ(gpu.coded[i].payload, expected[i].payload) << expected[i].name;
    const auto& d = described[i];  // the unchanged frozen.bias is last: changed tensors keep their index
    const auto rec = ds::compact::read_block_records(expected[i].block_index, expected[i].payload.size(), d.shape,
                                                      expected[i].index_version, expected[i].name);
    banded += rec.tiles.bands > 1;
  }
  EXPECT_EQ(banded, 2u);  // both matrices: ~2% of 131072 and 98304 elements in blocks of 128
  EXPECT_EQ(gpu.transfer.host_syncs, 4u);
}

TEST(CudaSyncEngine, NothingChangedCodesNothing) {
  SKIP_WITHOUT_GPU();
  const Tensors shapes = mixed_shapes();
  const Model v = random_model(shapes, 3);
  Publish p(shapes, en::ShadowKind::kFull, v);
  en::EncodeRequest request;
  request.want_coded = true;
  en::StagedDelta cpu, gpu;
  p.encode(v, request, cpu, gpu);
  EXPECT_EQ(gpu.total_changed(), 0u);
  EXPECT_TRUE(gpu.coded.empty());
  EXPECT_EQ(gpu.digest_shifts, std::vector<uint64_t>(shapes.size(), 0));
  EXPECT_EQ(gpu.transfer.host_syncs, 1u);
}

TEST(CudaSyncEngine, LowByteShadowEqualsTheCpu) {
  SKIP_WITHOUT_GPU();
  const Tensors shapes = bf16_shapes();
  Model v = random_model(shapes, 4);
  Publish p(shapes, en::ShadowKind::kLowByte, v);
  en::EncodeRequest request;
  request.want_coded = true;  // no base bits in this shadow: staged raw all the same
  for (uint64_t version = 2; version <= 3; ++version) {
    v = step(shapes, v, 20 + version);
    en::StagedDelta cpu, gpu;
    p.encode(v, request, cpu, gpu);
    expect_same_changes(cpu, gpu);
    EXPECT_FALSE(gpu.has_base_values);
    EXPECT_TRUE(gpu.changes.base_values.empty());
    EXPECT_GT(gpu.total_changed(), 0u);
    EXPECT_EQ(gpu.transfer.host_syncs, 2u);
  }
}

TEST(CudaSyncEngine, LowByteShadowRefusesWideTensorsLikeTheCpu) {
  SKIP_WITHOUT_GPU();
  Tensors shapes = mixed_shapes();
  shapes.set(random_model(shapes, 5));
  en::CpuSyncEngine cpu(en::EngineOptions{en::ShadowKind::kLowByte, 0});
  en::CudaSyncEngine gpu(en::EngineOptions{en::ShadowKind::kLowByte, 0});
  const std::string expected = error_message([&] { cpu.reset_shadow(shapes.host_refs()); });
  EXPECT_EQ(error_message([&] { gpu.reset_shadow(shapes.device_refs()); }), expected);
  EXPECT_FALSE(gpu.has_shadow());
}

// ---- apply -----------------------------------------------------------------------------------

// A delta from version 1 (`base`) to 2 (`next`) in the given layout, with its digests.
struct DeltaFixture {
  Tensors tensors = mixed_shapes();
  Model base, next;
  in::DeltaDigests digests;
  Bytes bytes;

  DeltaFixture(ds::DeltaFormat format, uint64_t seed) {
    base = random_model(tensors, seed);
    next = step(tensors, base, seed + 100);
    const en::StagedDelta staged = changes();
    const auto metas = tensors.metas();
    digests = in::delta_digests(metas, staged.changes.view(), ds::digest_tensors(tensors.host_refs()), 2, 1);
    ds::DeltaInfo info;
    in::put_delta_digests(info, digests);
    serialize(format, staged, info);
  }
  // The CPU engine's change set from base to next.
  en::StagedDelta changes() {
    tensors.set(base);
    en::CpuSyncEngine encoder;
    encoder.reset_shadow(tensors.host_refs());
    Tensors after = tensors;
    after.host = next;
    en::StagedDelta staged;
    encoder.encode(after.host_refs(), {}, staged);
    return staged;
  }
  void serialize(ds::DeltaFormat format, const en::StagedDelta& staged, const ds::DeltaInfo& info) {
    bytes = ds::serialize_delta(format, tensors.metas(), staged.changes.view(), info);
  }
};

// Applies `bytes` with both engines to the same starting weights; returns the two messages
// ("" for success) after checking that weights and digests agree.
struct ApplyOutcome {
  std::string cpu_error, gpu_error;
  in::ApplyReport cpu_report, gpu_report;
  en::TransferCounters gpu_transfer;
};

ApplyOutcome apply_both(Tensors& tensors, const Bytes& bytes, const Model& start) {
  ApplyOutcome out;
  tensors.set(start);
  const auto metas = tensors.metas();
  const auto start_digests = ds::digest_tensors(tensors.host_refs());
  std::vector<uint64_t> cpu_digests = start_digests, gpu_digests = start_digests;
  const ds::st::File cpu_file = ds::st::File::from_bytes(bytes, "delta-2");
  const ds::st::File gpu_file = ds::st::File::from_bytes(bytes, "delta-2");
  en::CpuSyncEngine cpu;
  en::CudaSyncEngine gpu;
  en::TransferCounters cpu_transfer;
  auto host_targets = tensors.host_targets();
  auto device_targets = tensors.device_targets();
  try {
    out.cpu_report = cpu.apply({&cpu_file, 2, 1}, metas, host_targets, cpu_digests, 1, cpu_transfer);
  } catch (const ds::Error& e) {
    out.cpu_error = e.what();
  }
  try {
    out.gpu_report = gpu.apply({&gpu_file, 2, 1}, metas, device_targets, gpu_digests, 1, out.gpu_transfer);
  } catch (const ds::Error& e) {
    out.gpu_error = e.what();
  }
  EXPECT_EQ(out.gpu_error, out.cpu_error);
  EXPECT_EQ(tensors.device_bits(), tensors.host) << "device weights differ from the CPU engine's";
  EXPECT_EQ(gpu_digests, cpu_digests);
  EXPECT_EQ(cpu_transfer.host_syncs, 0u);
  return out;
}

class CudaSyncEngineApply : public ::testing::TestWithParam<ds::DeltaFormat> {};

TEST_P(CudaSyncEngineApply, AppliesLikeTheCpu) {
  SKIP_WITHOUT_GPU();
  DeltaFixture f(GetParam(), 30);
  const ApplyOutcome r = apply_both(f.tensors, f.bytes, f.base);
  EXPECT_EQ(r.cpu_error, "");
  EXPECT_EQ(f.tensors.host, f.next);
  EXPECT_EQ(r.gpu_report.elements_changed, r.cpu_report.elements_changed);
  EXPECT_EQ(r.gpu_report.tensors_changed, r.cpu_report.tensors_changed);
  EXPECT_EQ(r.gpu_transfer.host_syncs, 1u);  // one wait per delta, either layout
  // The delta's tensors go up once; what comes back is a few status and digest words.
  EXPECT_LE(r.gpu_transfer.host_to_device_bytes, f.bytes.size() + 256 * (f.tensors.size() + 1) + 4096);
  EXPECT_LE(r.gpu_transfer.device_to_host_bytes, 64 * (f.tensors.size() + 1));
}

TEST_P(CudaSyncEngineApply, WrongBaseRefusedWithTheCpuMessageAndNothingWritten) {
  SKIP_WITHOUT_GPU();
  DeltaFixture f(GetParam(), 40);
  Model other = f.base;
  other[0][2] ^= 0x40;  // a tensor the delta changes now hashes differently
  const ApplyOutcome r = apply_both(f.tensors, f.bytes, other);
  EXPECT_NE(r.gpu_error.find("expects base version 1 digest"), std::string::npos) << r.gpu_error;
  EXPECT_EQ(f.tensors.host, other);
}

TEST_P(CudaSyncEngineApply, TamperedResultDigestRolledBackWithTheCpuMessage) {
  SKIP_WITHOUT_GPU();
  DeltaFixture f(GetParam(), 50);
  // Re-serialize with one result digest off by one.
  const en::StagedDelta staged = f.changes();
  in::DeltaDigests tampered = f.digests;
  tampered.result.begin()->second += 1;
  ds::DeltaInfo info;
  in::put_delta_digests(info, tampered);
  f.serialize(GetParam(), staged, info);
  const ApplyOutcome r = apply_both(f.tensors, f.bytes, f.base);
  EXPECT_NE(r.gpu_error.find("result digest mismatch"), std::string::npos) << r.gpu_error;
  EXPECT_EQ(f.tensors.host, f.base);
}

INSTANTIATE_TEST_SUITE_P(Layouts, CudaSyncEngineApply,
                         ::testing::Values(ds::DeltaFormat::Trl, ds::DeltaFormat::Compact),
                         [](const auto& info) { return std::string(ds::delta_format_name(info.param)); });

TEST(CudaSyncEngine, CorruptCompactBlockRefusedWithTheCpuMessageAndNothingWritten) {
  SKIP_WITHOUT_GPU();
  DeltaFixture f(ds::DeltaFormat::Compact, 60);
  // Flip bytes inside the first tensor's payload, found by its content.
  const ds::st::File parsed = ds::st::File::from_bytes(f.bytes, "delta-2");
  const ds::st::TensorInfo* cdata = nullptr;
  for (const auto& t : parsed.tensors())
    if (t.name.ends_with(".cdata")) cdata = &t;
  ASSERT_NE(cdata, nullptr);
  const auto payload = parsed.bytes(*cdata);
  ASSERT_GT(payload.size(), 8u);
  auto at = std::search(f.bytes.begin(), f.bytes.end(), payload.begin(), payload.end());
  ASSERT_NE(at, f.bytes.end());
  for (size_t k = 0; k < payload.size(); k += 97) at[static_cast<std::ptrdiff_t>(k)] ^= 0x5A;
  const ApplyOutcome r = apply_both(f.tensors, f.bytes, f.base);
  EXPECT_NE(r.gpu_error, "");
  EXPECT_EQ(f.tensors.host, f.base);
}

TEST(CudaSyncEngine, DeltaWithoutDigestsRefusedLikeTheCpu) {
  SKIP_WITHOUT_GPU();
  DeltaFixture f(ds::DeltaFormat::Compact, 70);
  const en::StagedDelta staged = f.changes();
  ds::DeltaInfo info;
  info.model_version = 2;
  info.base_version = 1;
  f.serialize(ds::DeltaFormat::Compact, staged, info);
  const ApplyOutcome r = apply_both(f.tensors, f.bytes, f.base);
  EXPECT_NE(r.gpu_error.find("carries no digests"), std::string::npos) << r.gpu_error;
}

// ---- digests, read, write --------------------------------------------------------------------

TEST(CudaSyncEngine, DigestsEqualTheHostDigests) {
  SKIP_WITHOUT_GPU();
  Tensors t = mixed_shapes();
  t.set(random_model(t, 80));
  en::CudaSyncEngine gpu;
  EXPECT_EQ(gpu.digests(t.device_refs()), ds::digest_tensors(t.host_refs()));
  EXPECT_EQ(gpu.cumulative_transfer().host_syncs, 1u);
}

TEST(CudaSyncEngine, AnchorPartsRoundTripThroughReadAndWrite) {
  SKIP_WITHOUT_GPU();
  // Larger than two staging buffers, so parts alternate buffers and the last one is short.
  const uint64_t numel = (uint64_t{40} << 20) / 2 + 12'345;
  const Bytes bits = random_bytes(numel * 2, 90);
  DeviceBytes device(Bytes(bits.size(), 0));
  const ds::TensorRef target{"embed.weight", device.ptr, numel, 2};
  const ds::ConstTensorRef source{"embed.weight", device.ptr, numel, 2};
  en::CudaSyncEngine gpu;
  // Written in three uneven parts, as an anchor streams in.
  const uint64_t cut1 = 7 << 20, cut2 = 30 << 20;
  gpu.write(target, 0, std::span(bits).first(cut1));
  gpu.write(target, cut1, std::span(bits).subspan(cut1, cut2 - cut1));
  gpu.write(target, cut2, std::span(bits).subspan(cut2));
  EXPECT_EQ(device.download(), bits);
  Bytes back(bits.size());
  gpu.read(source, 0, std::span(back).first(cut2));
  gpu.read(source, cut2, std::span(back).subspan(cut2));
  EXPECT_EQ(back, bits);
  Bytes small(10);
  gpu.read(source, 1001, small);
  EXPECT_TRUE(std::equal(small.begin(), small.end(), bits.begin() + 1001));
  EXPECT_EQ(gpu.cumulative_transfer().host_to_device_bytes, bits.size());
  EXPECT_EQ(gpu.cumulative_transfer().device_to_host_bytes, bits.size() + small.size());

  // Out-of-range parts are refused with the CPU engine's words, before anything moves.
  en::CpuSyncEngine cpu;
  Bytes host = bits;
  const ds::TensorRef host_target{"embed.weight", host.data(), numel, 2};
  const ds::ConstTensorRef host_source{"embed.weight", host.data(), numel, 2};
  Bytes two(2);
  EXPECT_EQ(error_message([&] { gpu.read(source, bits.size() - 1, two); }),
            error_message([&] { cpu.read(host_source, bits.size() - 1, two); }));
  EXPECT_EQ(error_message([&] { gpu.write(target, bits.size() - 1, two); }),
            error_message([&] { cpu.write(host_target, bits.size() - 1, two); }));
}

TEST(CudaSyncEngine, EncodeRefusesAChangedTensorSetLikeTheCpu) {
  SKIP_WITHOUT_GPU();
  const Tensors shapes = mixed_shapes();
  Publish p(shapes, en::ShadowKind::kFull, random_model(shapes, 95));
  Tensors fewer = p.tensors;
  fewer.numel[1] -= 1;
  en::StagedDelta cpu, gpu;
  const std::string expected = error_message([&] { p.cpu.encode(fewer.host_refs(), {}, cpu); });
  EXPECT_EQ(error_message([&] { p.gpu.encode(fewer.device_refs(), {}, gpu); }), expected);
}


// Positions per tensor (sorted, some tensors empty-handed) as int32 or int64 host arrays.
struct Positions {
  std::vector<std::vector<int32_t>> i32;
  std::vector<std::vector<int64_t>> i64;
  std::vector<ds::PatchRef> refs;
};

Positions every_kth(const Tensors& t, uint64_t k) {
  Positions p;
  p.i32.resize(t.size());
  p.i64.resize(t.size());
  for (size_t n = 0; n < t.size(); ++n) {
    for (uint64_t i = n % k; i < t.numel[n]; i += k + n) {
      if (n % 2 == 0) p.i32[n].push_back(static_cast<int32_t>(i));
      else p.i64[n].push_back(static_cast<int64_t>(i));
    }
  }
  for (size_t n = 0; n < t.size(); ++n) {
    ds::PatchRef r{};
    if (n % 2 == 0) {
      r.indices = p.i32[n].data();
      r.count = p.i32[n].size();
      r.index_width = 4;
    } else {
      r.indices = p.i64[n].data();
      r.count = p.i64[n].size();
      r.index_width = 8;
    }
    r.value_width = t.width[n];
    p.refs.push_back(r);
  }
  return p;
}

uint64_t gathered_bytes(const Tensors& t, const Positions& p) {
  uint64_t n = 0;
  for (size_t i = 0; i < t.size(); ++i) n += p.refs[i].count * t.width[i];
  return n;
}

TEST(CudaSyncEngine, GatherEqualsTheCpu) {
  SKIP_WITHOUT_GPU();
  Tensors t = mixed_shapes();
  t.set(random_model(t, 100));
  const Positions p = every_kth(t, 37);
  Bytes on_cpu(gathered_bytes(t, p)), on_gpu(on_cpu.size());
  en::CpuSyncEngine cpu;
  en::CudaSyncEngine gpu;
  en::TransferCounters cpu_transfer, gpu_transfer;
  cpu.gather(t.host_refs(), p.refs, on_cpu, cpu_transfer);
  gpu.gather(t.device_refs(), p.refs, on_gpu, gpu_transfer);
  EXPECT_EQ(on_gpu, on_cpu);
  EXPECT_EQ(gpu_transfer.host_syncs, 1u);
  EXPECT_GE(gpu_transfer.device_to_host_bytes, on_cpu.size());

  // A position past a tensor's end: the CPU's message, nothing read.
  Positions bad = every_kth(t, 37);
  bad.i64[1].back() = static_cast<int64_t>(t.numel[1]);
  EXPECT_EQ(error_message([&] { gpu.gather(t.device_refs(), bad.refs, on_gpu, gpu_transfer); }),
            error_message([&] { cpu.gather(t.host_refs(), bad.refs, on_cpu, cpu_transfer); }));
  // Header errors before any position is read, in the CPU's order: an index width that is not
  // 4 or 8 (its positions are not read as int64), then an output too small for the rest.
  Positions narrow = every_kth(t, 37);
  narrow.refs[1].index_width = 2;
  Bytes short_out(on_cpu.size() - 1);
  for (Bytes* out : {&on_gpu, &short_out}) {
    Bytes& cpu_out = out == &on_gpu ? on_cpu : short_out;
    EXPECT_EQ(error_message([&] { gpu.gather(t.device_refs(), narrow.refs, *out, gpu_transfer); }),
              error_message([&] { cpu.gather(t.host_refs(), narrow.refs, cpu_out, cpu_transfer); }));
  }
  EXPECT_EQ(error_message([&] { gpu.gather(t.device_refs(), p.refs, short_out, gpu_transfer); }), "gather: output too small");
}

TEST(CudaSyncEngine, ScatterEqualsTheCpuAndRefusesLikeIt) {
  SKIP_WITHOUT_GPU();
  Tensors t = mixed_shapes();
  const Model before = random_model(t, 110);
  t.set(before);
  Positions p = every_kth(t, 41);
  const Model values = random_model(t, 111);  // value bits, taken from the front of each tensor
  for (size_t n = 0; n < t.size(); ++n) p.refs[n].values = values[n].data();
  en::CpuSyncEngine cpu;
  en::CudaSyncEngine gpu;
  en::TransferCounters transfer;
  std::vector<ds::TensorRef> host = t.host_targets();
  gpu.scatter(t.device_targets(), p.refs, transfer);
  cpu.scatter(host, p.refs, transfer);
  EXPECT_EQ(t.device_bits(), t.host);
  EXPECT_NE(t.host, before);

  // Not ascending in one tensor: refused with the CPU's message and no tensor written.
  t.set(before);
  Positions bad = every_kth(t, 41);
  for (size_t n = 0; n < t.size(); ++n) bad.refs[n].values = values[n].data();
  std::swap(bad.i32[2][0], bad.i32[2][1]);
  host = t.host_targets();
  const std::string expected = error_message([&] { cpu.scatter(host, bad.refs, transfer); });
  EXPECT_FALSE(expected.empty());
  EXPECT_EQ(error_message([&] { gpu.scatter(t.device_targets(), bad.refs, transfer); }), expected);
  EXPECT_EQ(t.device_bits(), before);
}

TEST(CudaSyncEngine, ShadowBytesCountTheDeviceShadow) {
  SKIP_WITHOUT_GPU();
  const Tensors shapes = bf16_shapes();
  Publish full(shapes, en::ShadowKind::kFull, random_model(shapes, 120));
  Publish low(shapes, en::ShadowKind::kLowByte, random_model(shapes, 120));
  EXPECT_GE(full.gpu.shadow_bytes(), full.cpu.shadow_bytes());
  EXPECT_GE(low.gpu.shadow_bytes(), low.cpu.shadow_bytes());
  EXPECT_LT(low.gpu.shadow_bytes(), full.gpu.shadow_bytes() * 6 / 10);  // one byte of two, plus alignment
}

}  // namespace
