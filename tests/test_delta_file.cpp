// The TRL delta and anchor layouts: write/parse round trips for every weight dtype, the I64 index
// path, one test per kind of malformed delta layout, and matching a delta against a base.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "codec/delta_io.hpp"
#include "format/delta_file.hpp"
#include "core/error.hpp"
#include "format/safetensors.hpp"
#include "core/sparse_delta.hpp"
#include "test_support.hpp"

namespace st = deltasync::st;
using deltasync::DeltaInfo;
using deltasync::DType;
using deltasync::ParsedDelta;
using deltasync::PatchRef;
using deltasync::SparseDelta;
using deltasync::TensorMeta;

namespace {

// One tensor's changes: ascending positions and the new bits.
struct Changes {
  std::vector<int64_t> indices;
  std::vector<uint8_t> values;
};

// Every `stride`-th position from `first` changes, with random new bits.
Changes every_nth(const TensorMeta& t, uint64_t first, uint64_t stride, uint64_t seed) {
  Changes c;
  for (uint64_t i = first; i < t.numel(); i += stride) c.indices.push_back(static_cast<int64_t>(i));
  c.values = random_bytes(c.indices.size() * t.width(), seed);
  return c;
}

SparseDelta pack(const std::vector<Changes>& per_tensor) {
  SparseDelta d;
  d.offsets.push_back(0);
  d.value_offsets.push_back(0);
  for (const Changes& c : per_tensor) {
    d.indices.insert(d.indices.end(), c.indices.begin(), c.indices.end());
    d.values.insert(d.values.end(), c.values.begin(), c.values.end());
    d.offsets.push_back(d.indices.size());
    d.value_offsets.push_back(d.values.size());
  }
  return d;
}

std::vector<int64_t> patch_indices(const PatchRef& p) {
  std::vector<int64_t> out(p.count);
  for (uint64_t i = 0; i < p.count; ++i) {
    if (p.index_width == 4) {
      int32_t v;
      std::memcpy(&v, static_cast<const uint8_t*>(p.indices) + 4 * i, 4);
      out[i] = v;
    } else {
      std::memcpy(&out[i], static_cast<const uint8_t*>(p.indices) + 8 * i, 8);
    }
  }
  return out;
}

std::vector<uint8_t> patch_values(const PatchRef& p) {
  const auto* begin = static_cast<const uint8_t*>(p.values);
  return {begin, begin + p.count * p.value_width};
}

// A model with every weight dtype, odd sizes, and one tensor that does not change.
std::vector<TensorMeta> sample_model() {
  return {
      {"embed.weight", DType::BF16, {4, 5}},   {"norm.weight", DType::F16, {7}},
      {"frozen.weight", DType::BF16, {6}},     {"proj.weight", DType::F32, {3, 3}},
      {"fp8.e4m3", DType::F8_E4M3, {11}},      {"fp8.e5m2", DType::F8_E5M2, {2, 3}},
  };
}

std::vector<Changes> sample_changes(const std::vector<TensorMeta>& model) {
  std::vector<Changes> changes;
  for (size_t t = 0; t < model.size(); ++t) {
    if (model[t].name == "frozen.weight") {
      changes.push_back({});
    } else {
      changes.push_back(every_nth(model[t], t % 3, 2 + t % 2, 100 + t));
    }
  }
  return changes;
}

struct OwnedTensor {
  std::string name;
  DType dtype;
  std::vector<uint64_t> shape;
  std::vector<uint8_t> bytes;
};

// A delta-shaped file built tensor by tensor, for malformed layouts the writer never produces.
st::File craft(const std::vector<OwnedTensor>& tensors, const st::Metadata& metadata) {
  std::vector<st::WriteTensor> views;
  for (const OwnedTensor& t : tensors) views.push_back({t.name, t.dtype, t.shape, t.bytes});
  return st::File::from_bytes(st::serialize(views, metadata), "delta.safetensors");
}

OwnedTensor i32_indices(const std::string& name, std::vector<int32_t> values) {
  std::vector<uint8_t> bytes(values.size() * 4);
  std::memcpy(bytes.data(), values.data(), bytes.size());
  return {name, DType::I32, {values.size()}, bytes};
}

OwnedTensor tensor(const std::string& name, DType dtype, std::vector<uint64_t> shape) {
  uint64_t n = 1;
  for (uint64_t d : shape) n *= d;
  return {name, dtype, shape, random_bytes(n * deltasync::dtype_width(dtype), n)};
}

const st::Metadata kMinimalMetadata{{"sparse", "True"}, {"model_version", "3"}};

st::Metadata with(st::Metadata md, const std::string& key, const std::string& value) {
  md[key] = value;
  return md;
}

// A well-formed two-element change to "w" (BF16), to break one piece at a time.
std::vector<OwnedTensor> good_pair() { return {i32_indices("w.indices", {1, 5}), tensor("w.values", DType::BF16, {2})}; }

std::string parse_error(const std::vector<OwnedTensor>& tensors, const st::Metadata& metadata) {
  const st::File file = craft(tensors, metadata);
  return error_message([&] { deltasync::parse_trl_delta(file); });
}

void expect_reason(const std::string& message, const std::string& reason) {
  EXPECT_EQ(message.rfind("delta.safetensors: ", 0), 0u) << message;
  EXPECT_NE(message.find(reason), std::string::npos) << "message: " << message << "\nexpected reason: " << reason;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Round trips

TEST(DeltaFileRoundTrip, EveryWeightDtypeWithMetadata) {
  const auto model = sample_model();
  const auto changes = sample_changes(model);
  const SparseDelta delta = pack(changes);
  DeltaInfo info;
  info.model_version = 12;
  info.base_version = 11;
  info.extra = {{"base_digest", "00ff"}, {"result_digest", "abcd"}};
  TempDir dir;
  const std::string path = dir.file("step12.delta.safetensors");
  deltasync::write_trl_delta(path, model, delta.view(), info);

  const st::File file = st::File::open(path);
  // The container itself: the TRL layout, I32 indices, values in the tensor's dtype, 1-D.
  EXPECT_EQ(file.find("frozen.weight.indices"), nullptr);
  EXPECT_EQ(file.tensors().size(), 2 * (model.size() - 1));
  for (size_t t = 0; t < model.size(); ++t) {
    if (changes[t].indices.empty()) continue;
    const st::TensorInfo& idx = file.at(model[t].name + ".indices");
    const st::TensorInfo& val = file.at(model[t].name + ".values");
    EXPECT_EQ(idx.dtype, DType::I32);
    EXPECT_EQ(val.dtype, model[t].dtype);
    EXPECT_EQ(idx.shape, std::vector<uint64_t>{changes[t].indices.size()});
    EXPECT_EQ(val.shape, idx.shape);
  }

  uint64_t total = 0, changed = 0;
  for (size_t t = 0; t < model.size(); ++t) {
    total += model[t].numel();
    changed += changes[t].indices.size();
  }
  const st::Metadata& md = file.metadata();
  EXPECT_EQ(md.at("sparse"), "True");
  EXPECT_EQ(md.at("format"), "trl");
  EXPECT_EQ(md.at("model_version"), "12");
  EXPECT_EQ(md.at("base_version"), "11");
  EXPECT_EQ(md.at("total_elements"), std::to_string(total));
  EXPECT_EQ(md.at("total_changed_elements"), std::to_string(changed));
  EXPECT_DOUBLE_EQ(std::stod(md.at("sparsity")), 1.0 - static_cast<double>(changed) / static_cast<double>(total));
  EXPECT_EQ(md.at("changed_params"),
            R"(["embed.weight","norm.weight","proj.weight","fp8.e4m3","fp8.e5m2"])");
  EXPECT_EQ(md.at("tensor_shapes"),
            R"({"embed.weight":{"dtype":"BF16","shape":[4,5]},"norm.weight":{"dtype":"F16","shape":[7]},)"
            R"("frozen.weight":{"dtype":"BF16","shape":[6]},"proj.weight":{"dtype":"F32","shape":[3,3]},)"
            R"("fp8.e4m3":{"dtype":"F8_E4M3","shape":[11]},"fp8.e5m2":{"dtype":"F8_E5M2","shape":[2,3]}})");
  EXPECT_EQ(md.at("base_digest"), "00ff");
  EXPECT_EQ(md.at("result_digest"), "abcd");

  const ParsedDelta parsed = deltasync::parse_trl_delta(file);
  EXPECT_TRUE(parsed.sparse);
  EXPECT_EQ(parsed.info.model_version, 12u);
  EXPECT_EQ(parsed.info.base_version, std::optional<uint64_t>(11));
  EXPECT_EQ(parsed.info.extra.at("base_digest"), "00ff");
  EXPECT_EQ(parsed.info.extra.count("model_version"), 0u) << "typed keys live in DeltaInfo's fields";
  EXPECT_EQ(parsed.info.extra.at("changed_params"), md.at("changed_params")) << "derived keys stay visible";
  ASSERT_EQ(parsed.entries.size(), model.size() - 1);

  const std::vector<PatchRef> patches = deltasync::resolve_patches(parsed, model, path);
  ASSERT_EQ(patches.size(), model.size());
  for (size_t t = 0; t < model.size(); ++t) {
    SCOPED_TRACE(model[t].name);
    const PatchRef& p = patches[t];
    EXPECT_EQ(p.count, changes[t].indices.size());
    EXPECT_EQ(p.value_width, model[t].width());
    if (p.count == 0) continue;
    EXPECT_EQ(p.index_width, 4u);
    EXPECT_EQ(patch_indices(p), changes[t].indices);
    EXPECT_EQ(patch_values(p), changes[t].values);
    // The writer lays tensors out widest element first so every array is naturally aligned.
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p.indices) % p.index_width, 0u);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p.values) % p.value_width, 0u);
  }
}

TEST(DeltaFileRoundTrip, NothingChanged) {
  const auto model = sample_model();
  const SparseDelta delta = pack(std::vector<Changes>(model.size()));
  TempDir dir;
  const std::string path = dir.file("noop.safetensors");
  deltasync::write_trl_delta(path, model, delta.view(), DeltaInfo{5, std::nullopt, {}});
  const st::File file = st::File::open(path);
  EXPECT_TRUE(file.tensors().empty());
  EXPECT_EQ(file.metadata().at("sparsity"), "1.0");
  EXPECT_EQ(file.metadata().at("changed_params"), "[]");
  EXPECT_EQ(file.metadata().count("base_version"), 0u);
  const ParsedDelta parsed = deltasync::parse_trl_delta(file);
  EXPECT_TRUE(parsed.entries.empty());
  EXPECT_FALSE(parsed.info.base_version.has_value());
  for (const PatchRef& p : deltasync::resolve_patches(parsed, model, path)) EXPECT_EQ(p.count, 0u);
}

TEST(DeltaFileRoundTrip, SparsityIsAPlainDecimal) {
  const std::vector<TensorMeta> model = {{"w", DType::BF16, {4}}};
  TempDir dir;
  const auto sparsity_of = [&](const Changes& c) {
    const std::string path = dir.file("s.safetensors");
    deltasync::write_trl_delta(path, model, pack({c}).view(), DeltaInfo{1, std::nullopt, {}});
    return st::File::open(path).metadata().at("sparsity");
  };
  EXPECT_EQ(sparsity_of({{2}, {0, 0}}), "0.75");
  EXPECT_EQ(sparsity_of({{0, 1, 2, 3}, std::vector<uint8_t>(8)}), "0.0");
}

TEST(DeltaFileRoundTrip, LargeTensorUsesI64Indices) {
  // Only the metadata claims 3e9 elements: a delta carries just the changed values, so no
  // tensor of that size is ever allocated.
  const std::vector<TensorMeta> model = {{"small", DType::F16, {10}}, {"huge", DType::BF16, {3, 1000000000}}};
  const std::vector<Changes> changes = {
      {{0, 9}, random_bytes(4, 1)},
      {{0, 2147483647, 2147483648, 2999999999}, random_bytes(8, 2)},
  };
  TempDir dir;
  const std::string path = dir.file("big.safetensors");
  deltasync::write_trl_delta(path, model, pack(changes).view(), DeltaInfo{2, 1, {}});
  const st::File file = st::File::open(path);
  EXPECT_EQ(file.at("huge.indices").dtype, DType::I64);
  EXPECT_EQ(file.at("small.indices").dtype, DType::I32);
  EXPECT_EQ(file.metadata().at("total_elements"), "3000000010");
  const auto patches = deltasync::resolve_patches(deltasync::parse_trl_delta(file), model, path);
  EXPECT_EQ(patches[1].index_width, 8u);
  EXPECT_EQ(patch_indices(patches[1]), changes[1].indices);
  EXPECT_EQ(patch_values(patches[1]), changes[1].values);
  EXPECT_EQ(patch_indices(patches[0]), changes[0].indices);
}

TEST(DeltaFileRoundTrip, AnchorHoldsEveryTensorWhole) {
  const auto model = sample_model();
  std::vector<std::vector<uint8_t>> data;
  std::vector<std::span<const uint8_t>> spans;
  for (size_t t = 0; t < model.size(); ++t) data.push_back(random_bytes(model[t].numel() * model[t].width(), t));
  for (const auto& d : data) spans.push_back(d);
  TempDir dir;
  const std::string path = dir.file("anchor.safetensors");
  deltasync::write_anchor(path, model, spans, DeltaInfo{40, std::nullopt, {{"result_digest", "beef"}}});

  const st::File file = st::File::open(path);
  ASSERT_EQ(file.tensors().size(), model.size());
  for (size_t t = 0; t < model.size(); ++t) {
    const st::TensorInfo& info = file.tensors()[t];
    EXPECT_EQ(info.name, model[t].name);
    EXPECT_EQ(info.shape, model[t].shape);
    const auto bytes = file.bytes(info);
    EXPECT_EQ(std::vector<uint8_t>(bytes.begin(), bytes.end()), data[t]);
  }
  EXPECT_EQ(file.metadata().at("sparse"), "False");
  EXPECT_EQ(file.metadata().at("format"), "anchor");
  EXPECT_EQ(file.metadata().at("model_version"), "40");
  EXPECT_EQ(file.metadata().at("result_digest"), "beef");
  EXPECT_EQ(deltasync::model_tensors(file).size(), model.size());

  const ParsedDelta parsed = deltasync::parse_trl_delta(file);
  EXPECT_FALSE(parsed.sparse);
  EXPECT_TRUE(parsed.entries.empty());
  EXPECT_EQ(parsed.info.model_version, 40u);
  EXPECT_EQ(error_message([&] { deltasync::resolve_patches(parsed, model, path); }),
            path + ": file is an anchor (sparse=\"False\"), not a delta to apply to a base");
}

// ---------------------------------------------------------------------------------------------
// Writer checks

TEST(DeltaFileWrite, DerivedKeysInExtraAreRecomputed) {
  const std::vector<TensorMeta> model = {{"w", DType::F32, {2}}};
  TempDir dir;
  const std::string path = dir.file("d.safetensors");
  DeltaInfo info{1, std::nullopt, {{"sparsity", "0.123"}, {"total_elements", "99"}}};
  deltasync::write_trl_delta(path, model, pack({{{1}, random_bytes(4, 1)}}).view(), info);
  EXPECT_EQ(st::File::open(path).metadata().at("sparsity"), "0.5");
  EXPECT_EQ(st::File::open(path).metadata().at("total_elements"), "2");
}

TEST(DeltaFileWrite, TypedKeysInExtraAreRefused) {
  const std::vector<TensorMeta> model = {{"w", DType::F32, {2}}};
  TempDir dir;
  const std::string path = dir.file("d.safetensors");
  DeltaInfo info{1, std::nullopt, {{"model_version", "2"}}};
  EXPECT_EQ(error_message([&] { deltasync::write_trl_delta(path, model, pack({{}}).view(), info); }),
            path + ": metadata key \"model_version\" comes from DeltaInfo's fields; remove it from extra");
  EXPECT_TRUE(dir.entries().empty());
}

TEST(DeltaFileWrite, TensorCountMustMatchTheDelta) {
  const std::vector<TensorMeta> model = {{"a", DType::F32, {2}}, {"b", DType::F32, {2}}};
  TempDir dir;
  const std::string path = dir.file("d.safetensors");
  EXPECT_EQ(error_message([&] { deltasync::write_trl_delta(path, model, pack({{}}).view(), DeltaInfo{}); }),
            path + ": delta covers 1 tensors but the model has 2");
  EXPECT_TRUE(dir.entries().empty());
}

TEST(DeltaFileWrite, ValueBytesMustMatchTheCount) {
  const std::vector<TensorMeta> model = {{"a", DType::F32, {4}}};
  TempDir dir;
  const std::string path = dir.file("d.safetensors");
  EXPECT_EQ(error_message([&] { deltasync::write_trl_delta(path, model, pack({{{1, 2}, random_bytes(6, 1)}}).view(), {}); }),
            path + ": tensor a: 6 value bytes for 2 changes of width 4");
}

TEST(DeltaFileWrite, PositionThatCannotBeNarrowedIsRefused) {
  const std::vector<TensorMeta> model = {{"a", DType::BF16, {4}}};
  TempDir dir;
  const std::string path = dir.file("d.safetensors");
  const Changes beyond{{1, 4294967297}, random_bytes(4, 1)};  // would wrap to 1 as int32
  EXPECT_EQ(error_message([&] { deltasync::write_trl_delta(path, model, pack({beyond}).view(), {}); }),
            path + ": tensor a: changed position 4294967297 is outside its 4 elements");
  EXPECT_TRUE(dir.entries().empty());
}

TEST(DeltaFileWrite, AnchorNeedsOneBufferPerTensor) {
  const std::vector<TensorMeta> model = {{"a", DType::F32, {1}}};
  TempDir dir;
  const std::string path = dir.file("a.safetensors");
  EXPECT_EQ(error_message([&] { deltasync::write_anchor(path, model, {}, {}); }), path + ": 0 data buffers for 1 tensors");
}

// ---------------------------------------------------------------------------------------------
// Model tensors

TEST(DeltaFileModel, CheckpointWithNonWeightDtypeIsRefused) {
  const st::File file = craft({tensor("w", DType::BF16, {2}), tensor("step", DType::I64, {1})}, {});
  EXPECT_EQ(error_message([&] { deltasync::model_tensors(file); }),
            "delta.safetensors: tensor step has dtype I64; deltasync handles BF16, F16, F32, F8_E4M3, F8_E5M2");
}

TEST(DeltaFileModel, TensorMetaNumel) {
  EXPECT_EQ((TensorMeta{"s", DType::F32, {}}).numel(), 1u);
  EXPECT_EQ((TensorMeta{"z", DType::F32, {5, 0}}).numel(), 0u);
  EXPECT_EQ((TensorMeta{"m", DType::F32, {3, 7}}).numel(), 21u);
  const std::string message = error_message([] { (TensorMeta{"big", DType::F32, {1ull << 32, 1ull << 32}}).numel(); });
  EXPECT_NE(message.find("big"), std::string::npos) << message;
}

// ---------------------------------------------------------------------------------------------
// Malformed delta layouts: one test per kind

TEST(DeltaFileMalformed, MissingOrBadSparseKey) {
  expect_reason(parse_error(good_pair(), {{"model_version", "3"}}), "metadata has no \"sparse\" key");
  expect_reason(parse_error(good_pair(), with(kMinimalMetadata, "sparse", "true")),
                "metadata sparse is \"true\"; expected \"True\" or \"False\"");
}

TEST(DeltaFileMalformed, FormatDisagreesWithSparse) {
  expect_reason(parse_error(good_pair(), with(kMinimalMetadata, "format", "compact")),
                "metadata format is \"compact\" but sparse=\"True\" means format \"trl\"");
}

TEST(DeltaFileMalformed, MissingOrBadVersion) {
  expect_reason(parse_error(good_pair(), {{"sparse", "True"}}), "metadata has no \"model_version\" key");
  expect_reason(parse_error(good_pair(), with(kMinimalMetadata, "model_version", "-3")),
                "metadata model_version '-3': not a decimal integer");
  expect_reason(parse_error(good_pair(), with(kMinimalMetadata, "base_version", "2x")),
                "metadata base_version '2x': not a decimal integer");
  expect_reason(parse_error(good_pair(), with(kMinimalMetadata, "total_elements", "")),
                "metadata total_elements '': not a decimal integer");
}

// What std::stoull-style readers took (" 7" and "+7" as 7, "-1" as 2^64-1) is refused, in one
// line that names the file.
TEST(DeltaFileMalformed, VersionWithSignOrSpaceIsRefused) {
  for (const char* text : {"+7", " 7", "7 ", "-1"}) {
    const std::string message = parse_error(good_pair(), with(kMinimalMetadata, "model_version", text));
    EXPECT_EQ(message, "delta.safetensors: metadata model_version '" + std::string(text) + "': not a decimal integer");
  }
  expect_reason(parse_error(good_pair(), with(kMinimalMetadata, "base_version", "18446744073709551616")),
                "metadata base_version '18446744073709551616': out of range (max 18446744073709551615)");
}

TEST(DeltaFileMalformed, TensorThatIsNeitherIndicesNorValues) {
  auto tensors = good_pair();
  tensors.push_back(tensor("w.scale", DType::F32, {1}));
  expect_reason(parse_error(tensors, kMinimalMetadata), "tensor w.scale is neither NAME.indices nor NAME.values");
}

TEST(DeltaFileMalformed, IndicesWithoutValues) {
  expect_reason(parse_error({i32_indices("w.indices", {1})}, kMinimalMetadata),
                "tensor w.indices has no matching w.values");
}

TEST(DeltaFileMalformed, ValuesWithoutIndices) {
  expect_reason(parse_error({tensor("w.values", DType::BF16, {1})}, kMinimalMetadata),
                "tensor w.values has no matching w.indices");
}

TEST(DeltaFileMalformed, IndicesOfWrongDtype) {
  expect_reason(parse_error({tensor("w.indices", DType::U32, {2}), tensor("w.values", DType::BF16, {2})}, kMinimalMetadata),
                "tensor w.indices has dtype U32; indices must be I32 or I64");
}

TEST(DeltaFileMalformed, ValuesOfNonWeightDtype) {
  expect_reason(parse_error({i32_indices("w.indices", {0, 1}), tensor("w.values", DType::I16, {2})}, kMinimalMetadata),
                "tensor w.values has dtype I16; deltasync handles BF16, F16, F32, F8_E4M3, F8_E5M2");
}

TEST(DeltaFileMalformed, IndicesOrValuesNotOneDimensional) {
  expect_reason(parse_error({tensor("w.indices", DType::I32, {1, 2}), tensor("w.values", DType::BF16, {2})}, kMinimalMetadata),
                "tensor w.indices has shape [1, 2]; expected 1-D");
  expect_reason(parse_error({i32_indices("w.indices", {0, 1}), tensor("w.values", DType::BF16, {2, 1})}, kMinimalMetadata),
                "tensor w.values has shape [2, 1]; expected 1-D");
}

TEST(DeltaFileMalformed, IndicesAndValuesOfDifferentLengths) {
  expect_reason(parse_error({i32_indices("w.indices", {0, 1, 2}), tensor("w.values", DType::BF16, {2})}, kMinimalMetadata),
                "tensor w has 3 indices but 2 values");
}

TEST(DeltaFileMalformed, ChangedParamsMalformedOrInconsistent) {
  expect_reason(parse_error(good_pair(), with(kMinimalMetadata, "changed_params", "[w]")),
                "metadata changed_params is not valid JSON");
  expect_reason(parse_error(good_pair(), with(kMinimalMetadata, "changed_params", R"({"w": 1})")),
                "metadata changed_params is not a JSON list");
  expect_reason(parse_error(good_pair(), with(kMinimalMetadata, "changed_params", "[1]")),
                "metadata changed_params holds 1, not a tensor name");
  expect_reason(parse_error(good_pair(), with(kMinimalMetadata, "changed_params", R"(["w", "v"])")),
                "metadata changed_params lists 2 tensors that differ from the file's 1 changed tensors");
  expect_reason(parse_error(good_pair(), with(kMinimalMetadata, "changed_params", R"(["w", "w"])")),
                "metadata changed_params names a tensor twice");
}

TEST(DeltaFileMalformed, TensorShapesMalformedOrInconsistent) {
  expect_reason(parse_error(good_pair(), with(kMinimalMetadata, "tensor_shapes", "{")),
                "metadata tensor_shapes is not valid JSON");
  expect_reason(parse_error(good_pair(), with(kMinimalMetadata, "tensor_shapes", "[]")),
                "metadata tensor_shapes is not a JSON object");
  expect_reason(parse_error(good_pair(), with(kMinimalMetadata, "tensor_shapes", R"({"w": ["BF16", [8]]})")),
                "metadata tensor_shapes entry \"w\" is not {\"dtype\": string, \"shape\": list}");
  expect_reason(parse_error(good_pair(), with(kMinimalMetadata, "tensor_shapes", R"({"w": {"dtype": "BF8", "shape": [8]}})")),
                "metadata tensor_shapes entry \"w\" has unknown dtype \"BF8\"");
  expect_reason(parse_error(good_pair(), with(kMinimalMetadata, "tensor_shapes", R"({"w": {"dtype": "BF16", "shape": [-8]}})")),
                "metadata tensor_shapes entry \"w\" has shape entry -8, not a non-negative integer");
  expect_reason(parse_error(good_pair(), with(kMinimalMetadata, "tensor_shapes", R"({"v": {"dtype": "BF16", "shape": [8]}})")),
                "tensor w is changed but missing from metadata tensor_shapes");
  expect_reason(parse_error(good_pair(), with(kMinimalMetadata, "tensor_shapes", R"({"w": {"dtype": "F16", "shape": [8]}})")),
                "tensor w has values of dtype BF16 but tensor_shapes says F16");
}

TEST(DeltaFileMalformed, TotalChangedElementsDisagrees) {
  expect_reason(parse_error(good_pair(), with(kMinimalMetadata, "total_changed_elements", "3")),
                "metadata total_changed_elements is 3 but the file holds 2 changes");
}

TEST(DeltaFileMalformed, SparsityNotAFraction) {
  expect_reason(parse_error(good_pair(), with(kMinimalMetadata, "sparsity", "high")),
                "metadata sparsity 'high': not a decimal number");
  expect_reason(parse_error(good_pair(), with(kMinimalMetadata, "sparsity", "1.5")),
                "metadata sparsity '1.5': out of range (max 1)");
  expect_reason(parse_error(good_pair(), with(kMinimalMetadata, "sparsity", "-0")),
                "metadata sparsity '-0': not a decimal number");
}

TEST(DeltaFileMalformed, MinimalForeignDeltaIsAccepted) {
  // What another TRL-style writer may produce: no format, shapes or totals. It parses.
  const st::File file = craft(good_pair(), with(kMinimalMetadata, "sparsity", "0.5"));
  const ParsedDelta parsed = deltasync::parse_trl_delta(file);
  ASSERT_EQ(parsed.entries.size(), 1u);
  EXPECT_EQ(parsed.entries[0].name, "w");
  EXPECT_EQ(parsed.entries[0].dtype, DType::BF16);
  EXPECT_EQ(patch_indices(parsed.entries[0].patch), (std::vector<int64_t>{1, 5}));
}

// ---------------------------------------------------------------------------------------------
// Matching a delta to a base

namespace {

ParsedDelta written_delta(const TempDir& dir, const std::vector<TensorMeta>& model, const std::vector<Changes>& changes,
                          std::optional<st::File>& keep_alive) {
  const std::string path = dir.file("d.safetensors");
  deltasync::write_trl_delta(path, model, pack(changes).view(), DeltaInfo{2, 1, {}});
  keep_alive.emplace(st::File::open(path));
  return deltasync::parse_trl_delta(*keep_alive);
}

}  // namespace

TEST(DeltaFileResolve, TensorMissingFromBase) {
  TempDir dir;
  std::optional<st::File> file;
  const std::vector<TensorMeta> model = {{"a", DType::BF16, {4}}, {"b", DType::BF16, {4}}};
  const ParsedDelta delta = written_delta(dir, model, {{}, {{1}, random_bytes(2, 1)}}, file);
  const std::vector<TensorMeta> base = {{"a", DType::BF16, {4}}};
  EXPECT_EQ(error_message([&] { deltasync::resolve_patches(delta, base, "d.st"); }),
            "d.st: tensor b not in base checkpoint");
}

TEST(DeltaFileResolve, DtypeDiffersFromBase) {
  TempDir dir;
  std::optional<st::File> file;
  const std::vector<TensorMeta> model = {{"a", DType::BF16, {4}}};
  const ParsedDelta delta = written_delta(dir, model, {{{1}, random_bytes(2, 1)}}, file);
  const std::vector<TensorMeta> base = {{"a", DType::F16, {4}}};
  EXPECT_EQ(error_message([&] { deltasync::resolve_patches(delta, base, "d.st"); }),
            "d.st: tensor a has dtype BF16 in delta but F16 in base");
}

TEST(DeltaFileResolve, ShapeDiffersFromBase) {
  TempDir dir;
  std::optional<st::File> file;
  const std::vector<TensorMeta> model = {{"a", DType::BF16, {2, 4}}, {"frozen", DType::F32, {3}}};
  const ParsedDelta delta = written_delta(dir, model, {{{1}, random_bytes(2, 1)}, {}}, file);
  const std::vector<TensorMeta> changed_reshaped = {{"a", DType::BF16, {4, 2}}, {"frozen", DType::F32, {3}}};
  EXPECT_EQ(error_message([&] { deltasync::resolve_patches(delta, changed_reshaped, "d.st"); }),
            "d.st: tensor a has shape [2, 4] in delta but [4, 2] in base");
  // An unchanged tensor of another shape means another model too.
  const std::vector<TensorMeta> unchanged_reshaped = {{"a", DType::BF16, {2, 4}}, {"frozen", DType::F32, {4}}};
  EXPECT_EQ(error_message([&] { deltasync::resolve_patches(delta, unchanged_reshaped, "d.st"); }),
            "d.st: tensor frozen has shape [3] in delta but [4] in base");
}

TEST(DeltaFileResolve, BaseMayBeOneShardOfTheModel) {
  TempDir dir;
  std::optional<st::File> file;
  const std::vector<TensorMeta> model = {{"a", DType::BF16, {4}}, {"b", DType::F32, {4}}};
  const ParsedDelta delta = written_delta(dir, model, {{{0, 3}, random_bytes(4, 1)}, {}}, file);
  const std::vector<TensorMeta> shard = {{"a", DType::BF16, {4}}};
  const auto patches = deltasync::resolve_patches(delta, shard, "d.st");
  ASSERT_EQ(patches.size(), 1u);
  EXPECT_EQ(patches[0].count, 2u);
}

TEST(DeltaFileResolve, PatchesFollowBaseOrder) {
  TempDir dir;
  std::optional<st::File> file;
  const std::vector<TensorMeta> model = {{"a", DType::BF16, {4}}, {"b", DType::F32, {4}}, {"c", DType::F16, {4}}};
  const std::vector<Changes> changes = {{{1}, random_bytes(2, 1)}, {}, {{0, 2, 3}, random_bytes(6, 2)}};
  const ParsedDelta delta = written_delta(dir, model, changes, file);
  const std::vector<TensorMeta> base = {model[2], model[1], model[0]};
  const auto patches = deltasync::resolve_patches(delta, base, "d.st");
  ASSERT_EQ(patches.size(), 3u);
  EXPECT_EQ(patch_indices(patches[0]), changes[2].indices);
  EXPECT_EQ(patches[1].count, 0u);
  EXPECT_EQ(patches[1].value_width, 4u);
  EXPECT_EQ(patch_values(patches[2]), changes[0].values);
}

// ---------------------------------------------------------------------------------------------
// TRL's later layout: NAME.idx + NAME.val, raw or gap_delta index encoding

namespace {

using deltasync::IndexEncoding;
using deltasync::ParsedTrlIdxDelta;

OwnedTensor u16_tensor(const std::string& name, std::vector<uint16_t> values) {
  std::vector<uint8_t> bytes(values.size() * 2);
  if (!bytes.empty()) std::memcpy(bytes.data(), values.data(), bytes.size());  // memcpy(null, ...) is UB (UBSan)
  return {name, DType::U16, {values.size()}, bytes};
}

const st::Metadata kIdxMetadata{{"format", "sparse_weight_patch"}, {"version", "1"}, {"sparse", "True"},
                                {"model_version", "3"}, {"encoding", "gap_delta"}};

std::string idx_parse_error(const std::vector<OwnedTensor>& tensors, const st::Metadata& metadata) {
  const st::File file = craft(tensors, metadata);
  ParsedTrlIdxDelta parsed;
  return error_message([&] { deltasync::parse_trl_idx_delta(file, parsed); });
}

// Parses and resolves against `model` the way every reader does (delta_io's dispatch).
std::string idx_resolve_error(const std::vector<OwnedTensor>& tensors, const st::Metadata& metadata,
                              const std::vector<TensorMeta>& model) {
  const st::File file = craft(tensors, metadata);
  deltasync::ResolvedDelta resolved;
  return error_message([&] { deltasync::resolve_delta(file, model, {}, resolved); });
}

}  // namespace

TEST(TrlIdxLayout, GapDeltaRoundTripEveryDtypeWithTrlMetadata) {
  const auto model = sample_model();
  const auto changes = sample_changes(model);
  TempDir dir;
  const std::string path = dir.file("d.safetensors");
  deltasync::write_trl_idx_delta(path, model, pack(changes).view(), DeltaInfo{12, 11, {{"result_digest", "ab"}}},
                                 IndexEncoding::GapDelta);
  const st::File file = st::File::open(path);
  EXPECT_TRUE(deltasync::is_trl_idx_file(file));
  EXPECT_EQ(file.find("frozen.weight.idx"), nullptr);
  uint64_t total = 0, changed = 0;
  for (size_t t = 0; t < model.size(); ++t) {
    total += model[t].numel();
    changed += changes[t].indices.size();
    if (changes[t].indices.empty()) continue;
    const st::TensorInfo& idx = file.at(model[t].name + ".idx");
    EXPECT_EQ(idx.dtype, DType::U16);
    EXPECT_EQ(file.at(model[t].name + ".val").dtype, model[t].dtype);
    // The first gap is the first position itself (p[-1] = -1), the next ones gap - 1.
    const auto bytes = file.bytes(idx);
    uint16_t first, second;
    std::memcpy(&first, bytes.data(), 2);
    std::memcpy(&second, bytes.data() + 2, 2);
    EXPECT_EQ(first, changes[t].indices[0]);
    EXPECT_EQ(second, changes[t].indices[1] - changes[t].indices[0] - 1);
  }
  const st::Metadata& md = file.metadata();
  EXPECT_EQ(md.at("format"), "sparse_weight_patch");
  EXPECT_EQ(md.at("version"), "1");
  EXPECT_EQ(md.at("sparse"), "True");
  EXPECT_EQ(md.at("model_version"), "12");
  EXPECT_EQ(md.at("num_changed_params"), "5");
  EXPECT_EQ(md.at("total_changed_elements"), std::to_string(changed));
  EXPECT_EQ(md.at("total_elements"), std::to_string(total));
  EXPECT_DOUBLE_EQ(std::stod(md.at("sparsity")), 1.0 - double(changed) / double(total));
  EXPECT_EQ(md.at("encoding"), "gap_delta");
  EXPECT_EQ(md.at("base_version"), "11");
  EXPECT_EQ(md.at("result_digest"), "ab");

  deltasync::ResolvedDelta resolved;
  deltasync::resolve_delta(file, model, {}, resolved);
  EXPECT_EQ(resolved.format, deltasync::DeltaFormat::TrlIdx);
  EXPECT_EQ(resolved.info.model_version, 12u);
  for (size_t t = 0; t < model.size(); ++t) {
    SCOPED_TRACE(model[t].name);
    EXPECT_EQ(patch_indices(resolved.patches[t]), changes[t].indices);
    EXPECT_EQ(patch_values(resolved.patches[t]), changes[t].values);
  }
}

TEST(TrlIdxLayout, GapWidthIsChosenPerTensor) {
  const std::vector<TensorMeta> model = {{"near", DType::BF16, {100}}, {"far", DType::BF16, {200000}}};
  const std::vector<Changes> changes = {{{3, 4, 99}, random_bytes(6, 1)}, {{0, 65536, 65537, 199999}, random_bytes(8, 2)}};
  TempDir dir;
  const std::string path = dir.file("d.safetensors");
  deltasync::write_trl_idx_delta(path, model, pack(changes).view(), DeltaInfo{2, 1, {}}, IndexEncoding::GapDelta);
  const st::File file = st::File::open(path);
  EXPECT_EQ(file.at("near.idx").dtype, DType::U16);
  EXPECT_EQ(file.at("far.idx").dtype, DType::U32) << "199999 - 65537 - 1 does not fit U16";
  ParsedTrlIdxDelta parsed;
  deltasync::parse_trl_idx_delta(file, parsed);
  const auto patches = deltasync::resolve_patches(parsed.delta, model, path);
  EXPECT_EQ(patch_indices(patches[0]), changes[0].indices);
  EXPECT_EQ(patch_indices(patches[1]), changes[1].indices);
}

TEST(TrlIdxLayout, GapOfExactlyUint16MaxStaysU16) {
  const std::vector<TensorMeta> model = {{"w", DType::BF16, {140000}}};
  TempDir dir;
  const std::string path = dir.file("d.safetensors");
  deltasync::write_trl_idx_delta(path, model, pack({{{65535, 131071}, random_bytes(4, 1)}}).view(), DeltaInfo{2, 1, {}},
                                 IndexEncoding::GapDelta);
  EXPECT_EQ(st::File::open(path).at("w.idx").dtype, DType::U16);  // gaps 65535 and 65535
}

TEST(TrlIdxLayout, RawRoundTripAndLargeTensors) {
  const std::vector<TensorMeta> model = {{"small", DType::F16, {10}}, {"huge", DType::BF16, {3, 1000000000}}};
  const std::vector<Changes> changes = {{{0, 9}, random_bytes(4, 1)}, {{0, 2147483648, 2999999999}, random_bytes(6, 2)}};
  TempDir dir;
  const std::string path = dir.file("d.safetensors");
  deltasync::write_trl_idx_delta(path, model, pack(changes).view(), DeltaInfo{2, 1, {}}, IndexEncoding::Raw);
  const st::File file = st::File::open(path);
  EXPECT_EQ(file.metadata().at("encoding"), "raw");
  EXPECT_EQ(file.at("small.idx").dtype, DType::I32);
  EXPECT_EQ(file.at("huge.idx").dtype, DType::I64);
  deltasync::ResolvedDelta resolved;
  deltasync::resolve_delta(file, model, {}, resolved);
  EXPECT_EQ(resolved.format, deltasync::DeltaFormat::TrlIdxRaw);
  EXPECT_EQ(patch_indices(resolved.patches[0]), changes[0].indices);
  EXPECT_EQ(patch_indices(resolved.patches[1]), changes[1].indices);
  EXPECT_EQ(patch_values(resolved.patches[1]), changes[1].values);
}

TEST(TrlIdxLayout, GapBeyondUint32IsRefusedByTheWriter) {
  const std::vector<TensorMeta> model = {{"w", DType::BF16, {6000000000}}};
  TempDir dir;
  const std::string path = dir.file("d.safetensors");
  EXPECT_EQ(error_message([&] {
              deltasync::write_trl_idx_delta(path, model, pack({{{0, 5000000000}, random_bytes(4, 1)}}).view(),
                                             DeltaInfo{2, 1, {}}, IndexEncoding::GapDelta);
            }),
            path + ": tensor w: a gap of 4999999999 positions does not fit gap_delta's uint32; write it with the raw "
                   "encoding (trl-idx-raw) or compact");
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST(TrlIdxLayout, ForeignFileWithEmptyPairsAndNoOptionalKeys) {
  // TRL's writer keeps a pair for every tensor it was handed, changed or not, and may omit our keys.
  const std::vector<TensorMeta> model = {{"w", DType::BF16, {8}}, {"v", DType::BF16, {4}}};
  const st::File file = craft({u16_tensor("w.idx", {1, 3}), tensor("w.val", DType::BF16, {2}), u16_tensor("v.idx", {}),
                               tensor("v.val", DType::BF16, {0})},
                              with(kIdxMetadata, "num_changed_params", "2"));
  deltasync::ResolvedDelta resolved;
  deltasync::resolve_delta(file, model, {}, resolved);
  EXPECT_EQ(patch_indices(resolved.patches[0]), (std::vector<int64_t>{1, 5}));
  EXPECT_EQ(resolved.patches[1].count, 0u);
  // Without an encoding key TRL's reader assumes gap_delta; so does ours.
  st::Metadata no_encoding = kIdxMetadata;
  no_encoding.erase("encoding");
  const st::File implicit = craft({u16_tensor("w.idx", {0, 0}), tensor("w.val", DType::BF16, {2})}, no_encoding);
  deltasync::resolve_delta(implicit, model, {}, resolved);
  EXPECT_EQ(patch_indices(resolved.patches[0]), (std::vector<int64_t>{0, 1}));
}

TEST(TrlIdxLayout, AnchorWithTrlMetadataIsNotADelta) {
  const std::vector<TensorMeta> model = {{"w", DType::BF16, {2}}};
  const st::File file = craft({tensor("w", DType::BF16, {2})}, with(kIdxMetadata, "sparse", "False"));
  ParsedTrlIdxDelta parsed;
  deltasync::parse_trl_idx_delta(file, parsed);
  EXPECT_FALSE(parsed.delta.sparse);
  expect_reason(idx_resolve_error({tensor("w", DType::BF16, {2})}, with(kIdxMetadata, "sparse", "False"), model),
                "is an anchor (sparse=\"False\"), not a delta");
}

TEST(TrlIdxMalformed, EncodingOrVersionUnknown) {
  const auto pair = std::vector<OwnedTensor>{u16_tensor("w.idx", {1}), tensor("w.val", DType::BF16, {1})};
  expect_reason(idx_parse_error(pair, with(kIdxMetadata, "encoding", "zstd")),
                "metadata encoding \"zstd\" is unknown; expected \"raw\" or \"gap_delta\"");
  expect_reason(idx_parse_error(pair, with(kIdxMetadata, "encoding", "nvcomp_cascaded")),
                "metadata encoding \"nvcomp_cascaded\" (nvCOMP's GPU bitstream) is not supported");
  expect_reason(idx_parse_error(pair, with(kIdxMetadata, "version", "2")),
                "metadata version \"2\" of the sparse_weight_patch layout is not supported (known: 1)");
  expect_reason(idx_parse_error(pair, with(kIdxMetadata, "num_changed_params", "x")),
                "metadata num_changed_params 'x': not a decimal integer");
  expect_reason(idx_parse_error(pair, with(kIdxMetadata, "num_changed_params", "3")),
                "metadata num_changed_params is 3 but the file holds 1 changed tensors");
}

TEST(TrlIdxMalformed, IndexDtypeMustMatchTheEncoding) {
  expect_reason(idx_parse_error({i32_indices("w.idx", {1}), tensor("w.val", DType::BF16, {1})}, kIdxMetadata),
                "tensor w.idx has dtype I32; encoding gap_delta stores U16 or U32 gaps");
  expect_reason(idx_parse_error({u16_tensor("w.idx", {1}), tensor("w.val", DType::BF16, {1})},
                                with(kIdxMetadata, "encoding", "raw")),
                "tensor w.idx has dtype U16; encoding raw stores I32 (or I64) positions");
  expect_reason(idx_parse_error({tensor("w.idx", DType::F32, {1}), tensor("w.val", DType::BF16, {1})}, kIdxMetadata),
                "tensor w.idx has dtype F32; encoding gap_delta stores U16 or U32 gaps");
  expect_reason(idx_parse_error({u16_tensor("w.idx", {1}), tensor("w.val", DType::I16, {1})}, kIdxMetadata),
                "tensor w.val has dtype I16; deltasync handles");
}

TEST(TrlIdxMalformed, PairsOfTheOtherLayoutOrIncomplete) {
  expect_reason(idx_parse_error(good_pair(), kIdxMetadata), "tensor w.indices is neither NAME.idx nor NAME.val");
  expect_reason(idx_parse_error({u16_tensor("w.idx", {1})}, kIdxMetadata), "tensor w.idx has no matching w.val");
  expect_reason(idx_parse_error({u16_tensor("w.idx", {1, 2}), tensor("w.val", DType::BF16, {1})}, kIdxMetadata),
                "tensor w has 2 indices but 1 values");
}

TEST(TrlIdxMalformed, PositionsOutsideTheTensorOrNotAscending) {
  const std::vector<TensorMeta> model = {{"w", DType::BF16, {8}}};
  // uint16 gaps that run past the tensor's end (e.g. a writer that wrapped a wider gap).
  expect_reason(idx_resolve_error({u16_tensor("w.idx", {2, 5}), tensor("w.val", DType::BF16, {2})}, kIdxMetadata, model),
                "tensor w: position 8 (entry 1) is outside its 8 elements");
  expect_reason(idx_resolve_error({i32_indices("w.idx", {3, 3}), tensor("w.val", DType::BF16, {2})},
                                  with(kIdxMetadata, "encoding", "raw"), model),
                "tensor w: positions are not strictly ascending at entry 1 (3 after 3)");
  expect_reason(idx_resolve_error({i32_indices("w.idx", {-1}), tensor("w.val", DType::BF16, {1})},
                                  with(kIdxMetadata, "encoding", "raw"), model),
                "tensor w: position -1 (entry 0) is outside its 8 elements");
  expect_reason(idx_resolve_error({u16_tensor("w.idx", {1}), tensor("w.val", DType::F16, {1})}, kIdxMetadata, model),
                "tensor w has dtype F16 in delta but BF16 in base");
}

TEST(TrlIdxLayout, FormatNames) {
  using deltasync::DeltaFormat;
  for (const char* name : {"trl", "compact", "trl-idx", "trl-idx-raw"})
    EXPECT_EQ(deltasync::delta_format_name(deltasync::parse_delta_format(name)), name);
  EXPECT_EQ(error_message([] { deltasync::parse_delta_format("trl-v3"); }),
            "unknown delta format 'trl-v3' (choose compact, trl, trl-idx or trl-idx-raw)");
}
