// The GPU compact codec against its CPU twin (compact_codec.hpp), byte for byte: encode writes
// the same .cindex/.cdata bytes for every width, density, kind of change and block size; decode
// returns the same positions, new bits and base bits, which cuda::Applier turns into the new
// weights; and every corrupt payload is refused with the CPU twin's exact message, leaving the
// base as it was. Every test skips where no CUDA device exists, except CompactBlockLogic and
// CompactTileLogic: the device's per-block decode logic and its per-change reordering of tiled
// tensors are plain host/device code, run here on the host against the CPU codec, so that a
// change to the CPU decoder's order of checks or to the tile order is caught without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstring>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "compact_test_support.hpp"
#include "codec/compact_codec.hpp"
#include "engine/cpu_engine.hpp"
#include "deltasync/cuda/compact.hpp"
#include "deltasync/cuda/engine.hpp"
#include "engine/cuda/compact_decode.hpp"
#include "engine/cuda/cuda_calls.hpp"
#include "core/error.hpp"
#include "sim/training_sim.hpp"
// White-box: the block logic the decode kernel runs (and its message text), compiled for the host.
#include "../kernels/src/compact_decode_kernels.cuh"
#include "../kernels/src/compact_fault_text.hpp"
#include "../kernels/src/compact_tile_kernels.cuh"
#include "codec/compact_tile_order.hpp"

namespace ds = deltasync;
namespace compact = deltasync::compact;
namespace cuda = deltasync::cuda;
using namespace compact_test;

namespace {

// ---- device memory ----------------------------------------------------------------------------

class DeviceBytes {
 public:
  explicit DeviceBytes(size_t size = 0) : size_(size) {
    if (size_ > 0) cuda::check(cudaMalloc(&data_, size_), "test cudaMalloc");
  }
  explicit DeviceBytes(std::span<const uint8_t> host) : DeviceBytes(host.size()) {
    if (size_ > 0) cuda::check(cudaMemcpy(data_, host.data(), size_, cudaMemcpyHostToDevice), "test upload");
  }
  ~DeviceBytes() {
    if (data_ != nullptr) cudaFree(data_);
  }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
  DeviceBytes(DeviceBytes&& other) noexcept : data_(other.data_), size_(other.size_) {
    other.data_ = nullptr;
    other.size_ = 0;
  }

  std::vector<uint8_t> download(size_t bytes) const {
    std::vector<uint8_t> host(bytes);
    if (bytes > 0) cuda::check(cudaMemcpy(host.data(), data_, bytes, cudaMemcpyDeviceToHost), "test download");
    return host;
  }
  std::vector<uint8_t> download() const { return download(size_); }
  uint8_t* get() const { return static_cast<uint8_t*>(data_); }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
};

template <typename T>
std::span<const uint8_t> bytes_of(const std::vector<T>& v) {
  return {reinterpret_cast<const uint8_t*>(v.data()), v.size() * sizeof(T)};
}

template <typename T>
std::vector<T> download_as(const void* device, size_t count) {
  std::vector<T> host(count);
  if (count > 0) cuda::check(cudaMemcpy(host.data(), device, count * sizeof(T), cudaMemcpyDeviceToHost), "test download");
  return host;
}

// A SparseDelta copied to the device, viewed the way cuda::Encoder's outputs are.
struct DeviceDelta {
  DeviceBytes offsets, value_offsets, indices, values, base_values;
  uint64_t num_tensors;
  explicit DeviceDelta(const ds::SparseDelta& d)
      : offsets(bytes_of(d.offsets)),
        value_offsets(bytes_of(d.value_offsets)),
        indices(bytes_of(d.indices)),
        values(bytes_of(d.values)),
        base_values(bytes_of(d.base_values)),
        num_tensors(d.offsets.empty() ? 0 : d.offsets.size() - 1) {}
  cuda::DeviceDeltaView view() const {
    return {num_tensors,
            reinterpret_cast<const uint64_t*>(offsets.get()),
            reinterpret_cast<const uint64_t*>(value_offsets.get()),
            reinterpret_cast<const int64_t*>(indices.get()),
            values.get(),
            base_values.get()};
  }
};

// ---- models and change sets (Model, fill_base, make_changes: compact_test_support.hpp) -------

const ds::DType kOneOfEachWidth[] = {ds::DType::F8_E4M3, ds::DType::BF16, ds::DType::F32};

// ---- the two codecs ---------------------------------------------------------------------------

// A decode's outcome: the error message, or the decoded arrays.
struct Outcome {
  std::string error;
  ds::SparseDelta storage;
};

Outcome cpu_decode(std::span<const compact::EncodedTensorView> views, const Model& m, const std::string& label) {
  Outcome out;
  compact::DecodedDelta decoded;
  compact::Options serial;
  serial.parallel = false;  // the first bad block in block order, like the GPU's lowest bad block
  const auto refs = m.base_refs();
  try {
    compact::decode(views, m.meta, refs, label, decoded, serial);
    out.storage = decoded.storage;
  } catch (const ds::Error& e) {
    out.error = e.what();
  }
  return out;
}

class CudaCompactCodec : public testing::Test {
 protected:
  void SetUp() override {
    if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
    cuda::check(cudaStreamCreate(&stream_), "test stream");
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  std::vector<compact::EncodedTensor> gpu_encode(const Model& m, const ds::SparseDelta& delta, uint32_t block) {
    DeviceDelta device(delta);
    compact::Options options;
    options.block_elements = block;
    return cuda::encode_compact(encoder_, m.meta, device.view(), stream_, options);
  }

  // Decodes on the GPU against a device copy of the base; checks the base was not written.
  Outcome gpu_decode(std::span<const compact::EncodedTensorView> views, const Model& m, const std::string& label) {
    std::vector<DeviceBytes> base;
    std::vector<ds::ConstTensorRef> refs;
    for (size_t t = 0; t < m.meta.size(); ++t) {
      base.emplace_back(std::span<const uint8_t>(m.base[t]));
      refs.push_back({m.meta[t].name, base.back().get(), m.meta[t].numel(), m.meta[t].width()});
    }
    Outcome out;
    try {
      const cuda::DeviceDecodedDelta& d = decoder_.decode(views, m.meta, refs, label, stream_);
      out.storage.offsets = d.offsets;
      out.storage.value_offsets = d.value_offsets;
      out.storage.indices = download_as<int64_t>(d.indices, d.offsets.back());
      out.storage.values = download_as<uint8_t>(d.values, d.value_offsets.back());
      out.storage.base_values = download_as<uint8_t>(d.base_values, d.value_offsets.back());
    } catch (const ds::Error& e) {
      out.error = e.what();
    }
    for (size_t t = 0; t < m.meta.size(); ++t) EXPECT_EQ(base[t].download(), m.base[t]) << "base written: " << m.meta[t].name;
    return out;
  }

  // Encode on both, same bytes; decode on both, same arrays; apply the GPU decode with
  // cuda::Applier and get the current weights.
  void expect_codecs_agree(Model& m, uint32_t block) {
    m.encode();
    compact::Options options;
    options.block_elements = block;
    const auto cpu = compact::encode(m.meta, m.delta.view(), options);
    const auto gpu = gpu_encode(m, m.delta, block);
    ASSERT_EQ(gpu.size(), cpu.size());
    for (size_t i = 0; i < cpu.size(); ++i) {
      EXPECT_EQ(gpu[i].name, cpu[i].name);
      EXPECT_EQ(gpu[i].changed, cpu[i].changed);
      EXPECT_EQ(gpu[i].index_version, cpu[i].index_version);
      EXPECT_EQ(gpu[i].block_index, cpu[i].block_index) << cpu[i].name;
      EXPECT_EQ(gpu[i].payload, cpu[i].payload) << cpu[i].name;
    }

    const auto views = views_of(cpu);
    const Outcome want = cpu_decode(views, m, "mem");
    ASSERT_EQ(want.error, "");
    // Decode and apply on the device.
    std::vector<DeviceBytes> target;
    std::vector<ds::ConstTensorRef> base_refs;
    std::vector<ds::TensorRef> targets;
    for (size_t t = 0; t < m.meta.size(); ++t) {
      target.emplace_back(std::span<const uint8_t>(m.base[t]));
      base_refs.push_back({m.meta[t].name, target.back().get(), m.meta[t].numel(), m.meta[t].width()});
      targets.push_back({m.meta[t].name, target.back().get(), m.meta[t].numel(), m.meta[t].width()});
    }
    const cuda::DeviceDecodedDelta& d = decoder_.decode(views, m.meta, base_refs, "mem", stream_);
    EXPECT_EQ(d.offsets, want.storage.offsets);
    EXPECT_EQ(d.value_offsets, want.storage.value_offsets);
    EXPECT_EQ(download_as<int64_t>(d.indices, d.offsets.back()), want.storage.indices);
    EXPECT_EQ(download_as<uint8_t>(d.values, d.value_offsets.back()), want.storage.values);
    EXPECT_EQ(download_as<uint8_t>(d.base_values, d.value_offsets.back()), want.storage.base_values);
    cuda::Applier applier;
    cuda::apply_checked(applier, targets, d.patches(m.meta), stream_);
    for (size_t t = 0; t < m.meta.size(); ++t) EXPECT_EQ(target[t].download(), m.current[t]) << m.meta[t].name;
  }

  cudaStream_t stream_ = nullptr;
  cuda::CompactEncoder encoder_;
  ds::engine::DeviceCompactDecode decoder_;
};

// ---- encode and decode agree with the CPU ---------------------------------------------------

TEST_F(CudaCompactCodec, EveryWidthDensityAndChangeKind) {
  std::mt19937_64 rng(1234);
  for (ds::DType dtype : kOneOfEachWidth) {
    for (double density : {0.001, 0.01, 0.3, 1.0}) {
      for (Change kind : {Change::Ulp, Change::Random, Change::SignFlip}) {
        Model m = sweep_model(dtype, density, kind, rng);
        SCOPED_TRACE(sweep_case(dtype, density, kind));
        expect_codecs_agree(m, 1000);
      }
    }
  }
}

// compact_version 2 (32 lanes, one per thread of the decoding warp): the GPU decodes the CPU's
// bytes to the CPU's arrays, and the GPU encoder refuses to write it.
TEST_F(CudaCompactCodec, Version2DecodesLikeTheCpu) {
  std::mt19937_64 rng(4321);
  for (ds::DType dtype : kOneOfEachWidth) {
    for (double density : {0.001, 0.01, 0.3, 1.0}) {
      for (uint32_t block : {1u, 31u, 33u, 1000u, 16384u}) {
        Model m = sweep_model(dtype, density, Change::Random, rng);
        SCOPED_TRACE(sweep_case(dtype, density, Change::Random) + " block " + std::to_string(block));
        m.encode();
        compact::Options options;
        options.block_elements = block;
        options.version = compact::kFormatVersion2;
        const auto cpu = compact::encode(m.meta, m.delta.view(), options);
        const auto views = views_of(cpu);
        const Outcome want = cpu_decode(views, m, "mem");
        ASSERT_EQ(want.error, "");
        const Outcome got = gpu_decode(views, m, "mem");
        ASSERT_EQ(got.error, "");
        EXPECT_EQ(got.storage.offsets, want.storage.offsets);
        EXPECT_EQ(got.storage.indices, want.storage.indices);
        EXPECT_EQ(got.storage.values, want.storage.values);
        EXPECT_EQ(got.storage.base_values, want.storage.base_values);
      }
    }
  }
  Model m = sweep_model(ds::DType::BF16, 0.01, Change::Ulp, rng);
  m.encode();
  DeviceDelta device(m.delta);
  compact::Options v2;
  v2.version = compact::kFormatVersion2;
  std::string refusal;
  try {
    cuda::encode_compact(encoder_, m.meta, device.view(), stream_, v2);
  } catch (const ds::Error& e) {
    refusal = e.what();
  }
  EXPECT_EQ(refusal, "compact: the GPU encoder writes compact_version 1 only, got 2");
}

TEST_F(CudaCompactCodec, BlockBoundaries) {
  std::mt19937_64 rng(99);
  for (uint32_t block : {1u, 2u, 3u, 7u, 64u, 16384u}) {
    for (uint64_t changes : {uint64_t{1}, uint64_t{block}, uint64_t{block} + 1, 2 * uint64_t{block} + 1}) {
      Model m;
      m.add("a", ds::DType::BF16, 3 * changes + 5);
      fill_base(m.base[0], 2, rng, false);
      m.current[0] = m.base[0];
      // Changes at 0, 3, 6, ...: the first element is changed, gaps are small.
      for (uint64_t i = 0; i < changes; ++i) store(m.current[0], 3 * i, 2, load(m.base[0], 3 * i, 2) ^ 0x0001);
      SCOPED_TRACE("block " + std::to_string(block) + " changes " + std::to_string(changes));
      expect_codecs_agree(m, block);
    }
  }
}

TEST_F(CudaCompactCodec, AdjacentFirstLastZerosAndNaNs) {
  std::mt19937_64 rng(5);
  for (ds::DType dtype : kOneOfEachWidth) {
    const uint32_t w = ds::dtype_width(dtype);
    Model m;
    m.add("all", dtype, 5000);     // every element changed: all gaps 0
    m.add("ends", dtype, 70001);   // first and last only: the largest gap of the tensor
    m.add("special", dtype, 64);   // ±0 and NaN patterns in both directions
    fill_base(m.base[0], w, rng, true);
    fill_base(m.base[1], w, rng, false);
    m.current[0] = m.base[0];
    for (uint64_t i = 0; i < 5000; ++i) store(m.current[0], i, w, load(m.base[0], i, w) ^ 1u);
    m.current[1] = m.base[1];
    store(m.current[1], 0, w, load(m.base[1], 0, w) ^ (1u << (8 * w - 1)));
    store(m.current[1], 70000, w, load(m.base[1], 70000, w) ^ 3u);
    const uint32_t sign = 1u << (8 * w - 1);
    const uint32_t nan = w == 1 ? 0x7F : w == 2 ? 0x7FC0 : 0x7FC00000u;
    const uint32_t patterns[] = {0, sign, nan, nan | sign, nan | 1, compact::width_mask(w), 1, sign | 1};
    for (uint64_t i = 0; i < 64; ++i) {
      store(m.base[2], i, w, patterns[i % 8]);
      store(m.current[2], i, w, patterns[(i / 8 + i + 1) % 8] == patterns[i % 8] ? patterns[(i + 1) % 8]
                                                                                   : patterns[(i / 8 + i + 1) % 8]);
    }
    SCOPED_TRACE(std::string(ds::dtype_name(dtype)));
    expect_codecs_agree(m, 1000);
    expect_codecs_agree(m, compact::kDefaultBlockElements);
  }
}

TEST_F(CudaCompactCodec, DefaultBlocksOnALargerTensor) {
  std::mt19937_64 rng(77);
  Model m;
  m.add("big", ds::DType::BF16, 3'000'000);  // ~30K changes: two full blocks and a partial one
  m.add("small", ds::DType::F32, 1000);
  fill_base(m.base[0], 2, rng, false);
  fill_base(m.base[1], 4, rng, false);
  make_changes(m, 0, 0.012, Change::Ulp, rng);
  make_changes(m, 1, 0.05, Change::Random, rng);
  expect_codecs_agree(m, compact::kDefaultBlockElements);
}

TEST_F(CudaCompactCodec, HugeBlocksReadTheirStreamsFromGlobalMemory) {
  // One block of ~200K random F32 changes: ~1 MB of rANS and raw bits, more than the decoder
  // stages in shared memory, so its streams are read in place.
  std::mt19937_64 rng(8);
  Model m;
  m.add("wide", ds::DType::F32, 400'000);
  fill_base(m.base[0], 4, rng, true);
  make_changes(m, 0, 0.5, Change::Random, rng);
  expect_codecs_agree(m, 1u << 20);
}

TEST_F(CudaCompactCodec, RealisticAdamWSteps) {
  ds::sim::ModelShape shape;
  shape.vocab = 1024;
  shape.hidden = 256;
  shape.intermediate = 704;
  shape.layers = 2;
  shape.kv_heads_dim = 128;
  ds::sim::TrainingSim sim(shape, 42);
  ds::sim::AdamW opt;
  opt.lr = 3e-6;
  for (int step = 0; step < 3; ++step) {
    Model m;
    for (size_t t = 0; t < sim.tensors().size(); ++t) {
      const ds::TensorMeta& meta = sim.tensors()[t];
      m.add(meta.name, meta.dtype, meta.numel());
      std::memcpy(m.base[t].data(), sim.bf16(t), m.base[t].size());
    }
    sim.step(opt);
    for (size_t t = 0; t < m.meta.size(); ++t) std::memcpy(m.current[t].data(), sim.bf16(t), m.current[t].size());
    SCOPED_TRACE("step " + std::to_string(step));
    expect_codecs_agree(m, compact::kDefaultBlockElements);
  }
}

// Tensors cut into tiles (banded: coded positions; stripes only): the device encoder writes the
// CPU's bytes, and decodes them (a CPU publisher's file) into flat order on the device base.
TEST_F(CudaCompactCodec, TiledTensorsEncodeAndDecodeLikeTheCpu) {
  for (ds::DType dtype : kOneOfEachWidth) {
    for (double density : {0.01, 0.1, 1.0}) {
      for (uint32_t block : {7u, 16u, 64u, 16384u}) {
        std::mt19937_64 rng(block + static_cast<uint64_t>(density * 100));
        Model m = tiled_model(dtype, density, rng);
        SCOPED_TRACE(std::string(ds::dtype_name(dtype)) + " density " + std::to_string(density) + " block " + std::to_string(block));
        expect_codecs_agree(m, block);
      }
    }
  }
}

TEST_F(CudaCompactCodec, EncodesDirectlyFromTheCudaEncoder) {
  std::mt19937_64 rng(31);
  Model m;
  m.add("a", ds::DType::BF16, 200'000);
  m.add("b", ds::DType::F8_E5M2, 5000);
  m.add("c", ds::DType::F32, 40'000);
  for (size_t t = 0; t < m.meta.size(); ++t) {
    fill_base(m.base[t], m.meta[t].width(), rng, false);
    make_changes(m, t, 0.02, Change::Ulp, rng);
  }
  m.encode();
  std::vector<DeviceBytes> current, shadow;
  std::vector<ds::EncodeItem> items;
  for (size_t t = 0; t < m.meta.size(); ++t) {
    current.emplace_back(std::span<const uint8_t>(m.current[t]));
    shadow.emplace_back(std::span<const uint8_t>(m.base[t]));
    items.push_back({m.meta[t].name, current.back().get(), shadow.back().get(), m.meta[t].numel(), m.meta[t].width()});
  }
  cuda::Encoder diff;
  cuda::check(diff.encode(items, stream_), "test encode");
  const cuda::DeviceDeltaView view{diff.num_tensors(),        diff.device_offsets(), diff.device_value_offsets(),
                                   diff.device_indices(),     diff.device_values(),  diff.device_base_values()};
  compact::Options options;
  options.block_elements = 1500;
  const auto gpu = cuda::encode_compact(encoder_, m.meta, view, stream_, options);
  const auto cpu = compact::encode(m.meta, m.delta.view(), options);
  ASSERT_EQ(gpu.size(), cpu.size());
  for (size_t i = 0; i < cpu.size(); ++i) {
    EXPECT_EQ(gpu[i].block_index, cpu[i].block_index) << cpu[i].name;
    EXPECT_EQ(gpu[i].payload, cpu[i].payload) << cpu[i].name;
  }
}

TEST_F(CudaCompactCodec, PositionsBeyondTwoToThe32) {
  // Encode needs no tensor memory: a synthetic change set on a 2^41-element tensor, with gaps
  // that need up to 61 raw bits' worth of tokens.
  for (ds::DType dtype : kOneOfEachWidth) {
    const uint32_t w = ds::dtype_width(dtype);
    Model m;
    m.meta.push_back({"huge", dtype, {uint64_t{1} << 41}});
    const std::vector<int64_t> positions = {0, 1, (int64_t{1} << 32) + 5, (int64_t{1} << 32) + 6, int64_t{1} << 40,
                                            (int64_t{1} << 41) - 1};
    ds::SparseDelta& d = m.delta;
    d.offsets = {0, positions.size()};
    d.value_offsets = {0, positions.size() * w};
    d.indices = positions;
    d.values.resize(positions.size() * w);
    d.base_values.resize(positions.size() * w);
    for (size_t i = 0; i < d.values.size(); ++i) {
      d.values[i] = static_cast<uint8_t>(37 * i + 1);
      d.base_values[i] = static_cast<uint8_t>(11 * i);
    }
    for (uint32_t block : {1u, 4u, 16384u}) {
      compact::Options options;
      options.block_elements = block;
      const auto cpu = compact::encode(m.meta, d.view(), options);
      const auto gpu = gpu_encode(m, d, block);
      ASSERT_EQ(gpu.size(), 1u);
      EXPECT_EQ(gpu[0].block_index, cpu[0].block_index) << ds::dtype_name(dtype) << " block " << block;
      EXPECT_EQ(gpu[0].payload, cpu[0].payload) << ds::dtype_name(dtype) << " block " << block;
    }
  }
}

TEST_F(CudaCompactCodec, NothingChangedEncodesToNothing) {
  Model m;
  m.add("w", ds::DType::BF16, 100);
  m.encode();
  EXPECT_TRUE(gpu_encode(m, m.delta, 1000).empty());
  const Outcome decoded = gpu_decode({}, m, "mem");
  EXPECT_EQ(decoded.error, "");
  EXPECT_EQ(decoded.storage.offsets, (std::vector<uint64_t>{0, 0}));
}

TEST_F(CudaCompactCodec, EncoderRefusesWhatTheCpuRefuses) {
  Model m;  // one change to an F64 tensor: width 8 is not a compact width
  m.meta.push_back({"w", ds::DType::F64, {10}});
  m.delta.offsets = {0, 1};
  m.delta.value_offsets = {0, 8};
  m.delta.indices = {3};
  m.delta.values.assign(8, 1);
  m.delta.base_values.assign(8, 0);
  compact::Options bad_block;
  bad_block.block_elements = 0;
  const auto message = [&](auto&& fn) -> std::string {
    try {
      fn();
    } catch (const ds::Error& e) {
      return e.what();
    }
    return "";
  };
  DeviceDelta device(m.delta);
  const std::string cpu_block = message([&] { compact::encode(m.meta, m.delta.view(), bad_block); });
  EXPECT_NE(cpu_block, "");
  EXPECT_EQ(message([&] { cuda::encode_compact(encoder_, m.meta, device.view(), stream_, bad_block); }), cpu_block);
  const std::string cpu_width = message([&] { compact::encode(m.meta, m.delta.view()); });
  EXPECT_NE(cpu_width, "");
  EXPECT_EQ(message([&] { cuda::encode_compact(encoder_, m.meta, device.view(), stream_); }), cpu_width);
}

// ---- corrupt payloads: same message as the CPU, base untouched ---------------------------------

// A BF16 tensor of 30000 elements, 5% changed, in blocks of 500.
struct Corruptible : EditableTensor {
  Model m;
  explicit Corruptible(uint32_t version = compact::kFormatVersion1) {
    std::mt19937_64 rng(3);
    m.add("layer.w", ds::DType::BF16, 30000);
    fill_base(m.base[0], 2, rng, false);
    make_changes(m, 0, 0.05, Change::Ulp, rng);
    m.encode();
    compact::Options options;
    options.block_elements = 500;
    options.version = version;
    e = compact::encode(m.meta, m.delta.view(), options).at(0);
  }
};

class CudaCompactCorrupt : public CudaCompactCodec {
 protected:
  // The GPU refuses with exactly the CPU's message (which must contain `fragment`).
  void expect_same_refusal(const Corruptible& c, const std::string& fragment) {
    const Outcome cpu = cpu_decode(c.views(), c.m, "bad.safetensors");
    const Outcome gpu = gpu_decode(c.views(), c.m, "bad.safetensors");
    EXPECT_NE(cpu.error.find(fragment), std::string::npos) << "CPU message: '" << cpu.error << "'";
    EXPECT_EQ(gpu.error, cpu.error);
  }
};

TEST_F(CudaCompactCorrupt, UntouchedDecodesLikeTheCpu) {
  Corruptible c;
  ASSERT_GT(c.blocks(), 3u);
  const Outcome cpu = cpu_decode(c.views(), c.m, "x");
  const Outcome gpu = gpu_decode(c.views(), c.m, "x");
  EXPECT_EQ(gpu.error, "");
  EXPECT_EQ(gpu.storage.indices, cpu.storage.indices);
  EXPECT_EQ(gpu.storage.values, cpu.storage.values);
  EXPECT_EQ(gpu.storage.base_values, cpu.storage.base_values);
}

TEST_F(CudaCompactCorrupt, TruncatedStreams) {
  {
    Corruptible c;
    c.e.payload.pop_back();
    expect_same_refusal(c, "payload has");
  }
  {  // the last block's raw bits lose a byte, consistently in the index
    Corruptible c;
    const size_t last = c.record(c.blocks() - 1);
    c.e.payload.pop_back();
    c.add<uint32_t>(last + Corruptible::kBits, -1);
    c.set<uint64_t>(Corruptible::kHeaderPayload, c.e.payload.size());
    expect_same_refusal(c, "raw bit stream truncated");
  }
  {  // a rANS stream loses bytes to the raw bits
    Corruptible c;
    c.add<uint32_t>(c.record(1) + Corruptible::kRans, -3);
    c.add<uint32_t>(c.record(1) + Corruptible::kBits, 3);
    expect_same_refusal(c, "block 1: ");
  }
  {  // a rANS stream shorter than its four states
    Corruptible c;
    const uint32_t rans = c.get<uint32_t>(c.record(2) + Corruptible::kRans);
    c.add<uint32_t>(c.record(2) + Corruptible::kRans, 12 - int64_t{rans});
    c.add<uint32_t>(c.record(2) + Corruptible::kBits, int64_t{rans} - 12);
    expect_same_refusal(c, "block 2: rANS stream truncated");
  }
  {  // tables cut into the rANS stream
    Corruptible c;
    c.add<uint32_t>(c.record(0) + Corruptible::kTable, -2);
    c.add<uint32_t>(c.record(0) + Corruptible::kRans, 2);
    expect_same_refusal(c, "block 0: ");
  }
  {
    Corruptible c;
    c.e.block_index.resize(c.e.block_index.size() - 5);
    expect_same_refusal(c, "block index has");
    c.e.block_index.resize(10);
    expect_same_refusal(c, "block index truncated");
  }
}

TEST_F(CudaCompactCorrupt, BadBlockIndex) {
  for (const BlockIndexDefect& defect : block_index_defects()) {
    SCOPED_TRACE(defect.what);
    Corruptible c;
    defect.apply(c);
    expect_same_refusal(c, defect.fragment);
  }
}

TEST_F(CudaCompactCorrupt, ABlockCrossingATileIsRefusedLikeTheCpu) {
  Corruptible c;
  Model m;
  std::mt19937_64 rng(5);
  m.add_shaped("layer.w", ds::DType::BF16, {150, 200});
  fill_base(m.base[0], 2, rng, false);
  make_changes(m, 0, 0.05, Change::Ulp, rng);
  m.encode();
  compact::Options options;
  options.block_elements = 500;  // ~1500 changes in 3 blocks: one tile
  c.m = m;
  c.e = compact::encode(m.meta, m.delta.view(), options).at(0);
  ASSERT_EQ(c.e.index_version, compact::kIndexVersion2);
  // Stripes the blocks were not cut by: some block crosses into the next stripe.
  c.set<uint32_t>(Corruptible::kHeaderStripes, 2 * c.get<uint32_t>(Corruptible::kHeaderStripes));
  expect_same_refusal(c, "crosses a tile boundary");
}

TEST_F(CudaCompactCorrupt, OverlongGap) {
  Corruptible c;
  c.e = changes_at_0_and_50_of_60();
  c.m.meta[0].shape = {40};
  c.m.base[0].resize(80);
  expect_same_refusal(c, "gap after position 0 leads outside the tensor (40 elements)");
}

TEST_F(CudaCompactCorrupt, TrailingBytesAndBadTables) {
  {
    Corruptible c;
    c.e.payload.push_back(0);
    c.set<uint64_t>(Corruptible::kHeaderPayload, c.e.payload.size());
    expect_same_refusal(c, "trailing bytes");
  }
  {
    Corruptible c;
    c.e.payload.push_back(0);
    c.add<uint32_t>(c.record(c.blocks() - 1) + Corruptible::kBits, 1);
    c.set<uint64_t>(Corruptible::kHeaderPayload, c.e.payload.size());
    expect_same_refusal(c, "raw bit stream has trailing bytes");
  }
  {  // a nonzero padding bit in the last raw byte
    Corruptible c;
    c.e.payload.push_back(0x80);
    c.add<uint32_t>(c.record(c.blocks() - 1) + Corruptible::kBits, 1);
    c.set<uint64_t>(Corruptible::kHeaderPayload, c.e.payload.size());
    expect_same_refusal(c, "raw bit stream has trailing bytes");
  }
  {
    Corruptible c;
    c.add<uint32_t>(c.record(0) + Corruptible::kTable, 1);
    c.add<uint32_t>(c.record(0) + Corruptible::kRans, -1);
    expect_same_refusal(c, "block 0: ");
  }
  {  // gap table announcing too many symbols (first byte of block 3's payload)
    Corruptible c;
    const uint64_t at = c.get<uint64_t>(c.record(3) + Corruptible::kOffset);
    c.e.payload[at] = 0x7F;
    expect_same_refusal(c, "block 3: ");
  }
}

TEST_F(CudaCompactCorrupt, Version2TruncatedStreamsAndBadStates) {
  {
    Corruptible c(compact::kFormatVersion2);
    const size_t last = c.record(c.blocks() - 1);
    c.e.payload.pop_back();
    c.add<uint32_t>(last + Corruptible::kBits, -1);
    c.set<uint64_t>(Corruptible::kHeaderPayload, c.e.payload.size());
    expect_same_refusal(c, "raw bit stream truncated");
  }
  {  // a lane's initial state out of range (block 2's state bytes follow its tables)
    Corruptible c(compact::kFormatVersion2);
    const uint64_t at = c.get<uint64_t>(c.record(2) + Corruptible::kOffset) +
                        c.get<uint32_t>(c.record(2) + Corruptible::kTable);
    c.e.payload[at + 4 * 7 + 3] = 0xFF;
    expect_same_refusal(c, "block 2: rANS stream has an invalid initial state");
  }
  {  // the rANS stream loses a word to the raw bits
    Corruptible c(compact::kFormatVersion2);
    c.add<uint32_t>(c.record(1) + Corruptible::kRans, -2);
    c.add<uint32_t>(c.record(1) + Corruptible::kBits, 2);
    expect_same_refusal(c, "block 1: ");
  }
}

TEST_F(CudaCompactCorrupt, Version2RandomByteFlipsGiveTheCpuOutcome) {
  Corruptible c(compact::kFormatVersion2);
  std::mt19937_64 rng(2025);
  int refused = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const auto saved_index = c.e.block_index;
    const auto saved_payload = c.e.payload;
    c.flip_random_bits(rng);
    const Outcome cpu = cpu_decode(c.views(), c.m, "fuzz");
    const Outcome gpu = gpu_decode(c.views(), c.m, "fuzz");
    ASSERT_EQ(gpu.error, cpu.error) << "trial " << trial;
    if (cpu.error.empty()) {
      ASSERT_EQ(gpu.storage.indices, cpu.storage.indices) << "trial " << trial;
      ASSERT_EQ(gpu.storage.values, cpu.storage.values) << "trial " << trial;
      ASSERT_EQ(gpu.storage.base_values, cpu.storage.base_values) << "trial " << trial;
    } else {
      ++refused;
    }
    c.e.block_index = saved_index;
    c.e.payload = saved_payload;
  }
  EXPECT_GT(refused, 150);
}

TEST_F(CudaCompactCorrupt, RandomByteFlipsGiveTheCpuOutcome) {
  // Each mutation either decodes to the CPU's arrays or is refused with the CPU's message.
  Corruptible c;
  std::mt19937_64 rng(2024);
  int refused = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const auto saved_index = c.e.block_index;
    const auto saved_payload = c.e.payload;
    c.flip_random_bits(rng);
    const Outcome cpu = cpu_decode(c.views(), c.m, "fuzz");
    const Outcome gpu = gpu_decode(c.views(), c.m, "fuzz");
    ASSERT_EQ(gpu.error, cpu.error) << "trial " << trial;
    if (cpu.error.empty()) {
      ASSERT_EQ(gpu.storage.indices, cpu.storage.indices) << "trial " << trial;
      ASSERT_EQ(gpu.storage.values, cpu.storage.values) << "trial " << trial;
      ASSERT_EQ(gpu.storage.base_values, cpu.storage.base_values) << "trial " << trial;
    } else {
      ++refused;
    }
    c.e.block_index = saved_index;
    c.e.payload = saved_payload;
  }
  EXPECT_GT(refused, 150);
}

// ---- the decode kernel's block logic on the host, against the CPU decoder ---------------------

namespace block_logic {

namespace detail = deltasync::cuda::detail;

uint64_t read_le(const uint8_t* p, int n) {
  uint64_t v = 0;
  for (int k = 0; k < n; ++k) v |= uint64_t{p[k]} << (8 * k);
  return v;
}

// What decode_blocks + check_block_order do for a tensor whose block index is valid: per block
// the tables, the slot lookups, the serial decode and the gather; then block order. Returns the
// error message (label "fuzz", the first bad block) or fills `out`.
std::string emulate_decode(const compact::EncodedTensor& e, const std::vector<uint8_t>& base, uint64_t numel,
                           uint32_t w, ds::SparseDelta& out) {
  const auto num_blocks = static_cast<uint32_t>(read_le(e.block_index.data() + 20, 4));
  const uint64_t changed = read_le(e.block_index.data(), 8);
  out.indices.assign(changed, 0);
  out.values.assign(changed * w, 0);
  out.base_values.assign(changed * w, 0);
  const std::string where = "fuzz: tensor " + e.name + ": block ";
  std::vector<uint32_t> gap_slots(4096), value_slots(4096);
  std::vector<uint64_t> firsts;
  uint64_t first = 0;
  for (uint32_t b = 0; b < num_blocks; ++b) {
    const uint8_t* r = e.block_index.data() + compact::index_header_bytes(e.index_version) + 32 * size_t{b};
    const detail::CompactDecodeTask task{e.payload.data() + read_le(r + 8, 8),
                                         base.data(),
                                         out.indices.data() + first,
                                         out.values.data() + first * w,
                                         out.base_values.data() + first * w,
                                         read_le(r, 8),
                                         numel,
                                         static_cast<uint32_t>(read_le(r + 16, 4)),
                                         static_cast<uint32_t>(read_le(r + 20, 4)),
                                         static_cast<uint32_t>(read_le(r + 24, 4)),
                                         static_cast<uint32_t>(read_le(r + 28, 4)),
                                         w,
                                         b};
    firsts.push_back(first);
    first += task.count;
    detail::CompactBlockFault fault{detail::kFaultNone, 0, 0, 0};
    uint16_t gap_freq[256], gap_start[256], value_freq[128], value_start[128];
    uint32_t num_gap = 0, num_value = 0;
    if (detail::compact_decode::read_tables(task, gap_freq, gap_start, value_freq, value_start, num_gap, num_value,
                                            fault) != detail::kFaultNone)
      return where + std::to_string(b) + ": " + detail::describe_fault(fault);
    detail::compact_decode::fill_slots(num_gap, gap_freq, gap_start, gap_slots.data(), 0, 1);
    detail::compact_decode::fill_slots(num_value, value_freq, value_start, value_slots.data(), 0, 1);
    uint8_t chunk_gap[detail::compact_decode::kDecodeChunk], chunk_value[detail::compact_decode::kDecodeChunk];
    if (detail::compact_decode::decode_serial(task, task.payload + task.table_bytes, gap_slots.data(),
                                              value_slots.data(), chunk_gap, chunk_value,
                                              fault) != detail::kFaultNone)
      return where + std::to_string(b) + ": " + detail::describe_fault(fault);
    for (uint32_t j = 0; j < task.count; ++j) {
      const uint32_t old = load(base, static_cast<uint64_t>(task.positions[j]), w);
      uint32_t symbol = 0;
      std::memcpy(&symbol, task.new_bits + size_t{j} * w, w);
      std::memcpy(task.base_bits + size_t{j} * w, &old, w);
      const uint32_t bits = compact::apply_value_symbol(symbol, old, w);
      std::memcpy(task.new_bits + size_t{j} * w, &bits, w);
    }
  }
  for (uint32_t b = 1; b < num_blocks; ++b)
    if (out.indices[firsts[b]] <= out.indices[firsts[b] - 1])
      return where + std::to_string(b) + " starts at position " + std::to_string(out.indices[firsts[b]]) +
             ", not after the previous block's last (" + std::to_string(out.indices[firsts[b] - 1]) + ")";
  return "";
}

}  // namespace block_logic

TEST(CompactBlockLogic, DecodesAndRefusesExactlyLikeTheCpuDecoder) {
  // Bit flips in the payloads and shifted borders between a block's sections (the index stays
  // valid, so every defect reaches the block decoder), for every width and several block sizes.
  int refused = 0, decoded = 0;
  for (ds::DType dtype : kOneOfEachWidth) {
    for (uint32_t block : {37u, 500u, 16384u}) {
      const uint32_t w = ds::dtype_width(dtype);
      std::mt19937_64 rng(block + w);
      Model m;
      m.add("layer.w", dtype, 30000);
      fill_base(m.base[0], w, rng, true);
      make_changes(m, 0, 0.05, Change::Random, rng);
      m.encode();
      compact::Options options;
      options.block_elements = block;
      const compact::EncodedTensor original = compact::encode(m.meta, m.delta.view(), options).at(0);
      SCOPED_TRACE(std::string(ds::dtype_name(dtype)) + " block " + std::to_string(block));
      for (int trial = 0; trial < 1500; ++trial) {
        compact::EncodedTensor e = original;
        if (trial > 0) {
          const int flips = 1 + static_cast<int>(rng() % 3);
          for (int k = 0; k < flips; ++k) e.payload[rng() % e.payload.size()] ^= static_cast<uint8_t>(1u << (rng() % 8));
          if (rng() % 2 == 0) {  // move the border between tables and rANS, or rANS and raw bits
            const auto blocks = static_cast<uint32_t>(block_logic::read_le(e.block_index.data() + 20, 4));
            uint8_t* record = e.block_index.data() + compact::index_header_bytes(e.index_version) + 32 * size_t{rng() % blocks};
            const size_t at = 20 + 4 * (rng() % 2);
            const int64_t shift = static_cast<int64_t>(rng() % 11) - 5;
            uint32_t a = 0, b = 0;
            std::memcpy(&a, record + at, 4);
            std::memcpy(&b, record + at + 4, 4);
            if (static_cast<int64_t>(a) + shift >= 0 && static_cast<int64_t>(b) - shift >= 0) {
              a = static_cast<uint32_t>(a + shift);
              b = static_cast<uint32_t>(b - shift);
              std::memcpy(record + at, &a, 4);
              std::memcpy(record + at + 4, &b, 4);
            }
          }
        }
        const std::vector<compact::EncodedTensorView> views{e.view()};
        const Outcome cpu = cpu_decode(views, m, "fuzz");
        ds::SparseDelta gpu;
        const std::string gpu_error = block_logic::emulate_decode(e, m.base[0], m.meta[0].numel(), w, gpu);
        ASSERT_EQ(gpu_error, cpu.error) << "trial " << trial;
        if (cpu.error.empty()) {
          ASSERT_EQ(gpu.indices, cpu.storage.indices) << "trial " << trial;
          ASSERT_EQ(gpu.values, cpu.storage.values) << "trial " << trial;
          ASSERT_EQ(gpu.base_values, cpu.storage.base_values) << "trial " << trial;
          ++decoded;
        } else {
          ++refused;
        }
      }
    }
  }
  EXPECT_GT(refused, 5000);
  EXPECT_GT(decoded, 9);  // at least the untouched payloads
}

}  // namespace

namespace tile_logic {

namespace detail = deltasync::cuda::detail;

// What the tile kernels compute for one banded tensor, item by item on the host: segment counts,
// their exclusive scan, then one reorder step per change (compact_tile_kernels.cuh).
std::vector<uint64_t> scanned_segments(const detail::TiledTensor& t, bool band_major) {
  const uint64_t segments = t.tiles.rows * t.tiles.bands;
  std::vector<uint64_t> start(segments + 1, 0);
  for (uint64_t s = 0; s < segments; ++s)
    start[s + 1] = start[s] + (band_major ? detail::compact_tiles::band_row_count(t, s) : detail::compact_tiles::row_band_count(t, s));
  return start;
}

}  // namespace tile_logic

TEST(CompactTileLogic, TheKernelsReorderingAndTileStartsAreTheCpuTwins) {
  namespace detail = deltasync::cuda::detail;
  int banded = 0, striped = 0;
  for (ds::DType dtype : kOneOfEachWidth) {
    for (double density : {0.02, 0.3, 1.0}) {
      const uint32_t w = ds::dtype_width(dtype);
      std::mt19937_64 rng(static_cast<uint64_t>(density * 1000) + w);
      Model m = tiled_model(dtype, density, rng);
      m.encode();
      SCOPED_TRACE(std::string(ds::dtype_name(dtype)) + " density " + std::to_string(density));
      for (size_t t = 0; t < m.meta.size(); ++t) {
        const uint64_t n = m.delta.view().count(t);
        if (n == 0) continue;
        const compact::TileGeometry g = compact::choose_tiles(m.meta[t].shape, n, 16, 8);
        if (g.tiles() == 1) continue;
        const std::span<const int64_t> positions(m.delta.indices.data() + m.delta.offsets[t], n);
        const std::span<const uint8_t> new_bits(m.delta.values.data() + m.delta.value_offsets[t], n * w);
        const std::span<const uint8_t> base_bits(m.delta.base_values.data() + m.delta.value_offsets[t], n * w);
        const compact::CodedOrder cpu = compact::to_coded_order(g, positions, new_bits, base_bits, w);

        // Encoder: flat -> coded order, then the tile starts.
        std::vector<int64_t> coded(n);
        std::vector<uint8_t> coded_new(n * w), coded_base(n * w);
        detail::TiledTensor enc{positions.data(), new_bits.data(), base_bits.data(), nullptr, coded.data(), coded_new.data(),
                                coded_base.data(), n, 0, 0, 0, g, w};
        if (g.bands > 1) {
          const std::vector<uint64_t> start = tile_logic::scanned_segments(enc, true);
          for (uint64_t i = 0; i < n; ++i) detail::compact_tiles::to_coded_one(enc, i, start.data());
          EXPECT_EQ(coded, cpu.positions) << m.meta[t].name;
          EXPECT_EQ(coded_new, cpu.new_bits) << m.meta[t].name;
          EXPECT_EQ(coded_base, cpu.base_bits) << m.meta[t].name;
        }
        const int64_t* coded_positions = g.bands > 1 ? coded.data() : positions.data();
        for (uint32_t j = 0; j < g.tiles(); ++j)
          EXPECT_EQ(detail::compact_tiles::tile_start(enc, coded_positions, j), cpu.tile_starts[j]) << m.meta[t].name << " tile " << j;
        if (g.bands == 1) {
          ++striped;
          continue;
        }
        ++banded;

        // Decoder: what the block decoder leaves (coded positions, new bits decoded against the
        // base at the coded positions) back to flat order on the base: the delta itself.
        std::vector<uint8_t> decoded_new(n * w), decoded_base(n * w);
        for (uint64_t i = 0; i < n; ++i) {
          const uint32_t at_q = load(m.base[t], static_cast<uint64_t>(coded[i]), w);
          const uint32_t symbol = compact::value_symbol(load(coded_new, i, w), load(coded_base, i, w), w);
          store(decoded_base, i, w, at_q);
          store(decoded_new, i, w, compact::apply_value_symbol(symbol, at_q, w));
        }
        std::vector<int64_t> flat(n);
        std::vector<uint8_t> flat_new(n * w), flat_base(n * w);
        detail::TiledTensor dec{coded.data(), decoded_new.data(), decoded_base.data(), m.base[t].data(), flat.data(), flat_new.data(),
                                flat_base.data(), n, 0, 0, 0, g, w};
        const std::vector<uint64_t> start = tile_logic::scanned_segments(dec, false);
        for (uint64_t i = 0; i < n; ++i) detail::compact_tiles::to_flat_one(dec, i, start.data());
        EXPECT_TRUE(std::equal(flat.begin(), flat.end(), positions.begin())) << m.meta[t].name;
        EXPECT_TRUE(std::equal(flat_new.begin(), flat_new.end(), new_bits.begin())) << m.meta[t].name;
        EXPECT_TRUE(std::equal(flat_base.begin(), flat_base.end(), base_bits.begin())) << m.meta[t].name;
        // And the CPU's reorder of what its decoder leaves (coded order, bits of the flat positions).
        std::vector<int64_t> cpu_flat(n);
        std::vector<uint8_t> cpu_new(n * w), cpu_base(n * w);
        compact::to_flat_order(g, {cpu.positions, cpu.new_bits, cpu.base_bits}, w, cpu_flat, cpu_new, cpu_base);
        EXPECT_EQ(cpu_flat, flat);
        EXPECT_EQ(cpu_new, flat_new);
        EXPECT_EQ(cpu_base, flat_base);
      }
    }
  }
  EXPECT_GT(banded, 10);
  EXPECT_GT(striped, 2);  // odd.w: 75 columns take no bands
}

