// The safetensors reader, serializer and atomic writer: round trips, the exact byte layout, one
// test per kind of malformed file (each checks the label and the reason in the one-line error),
// and the atomicity of writes.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "format/safetensors.hpp"
#include "test_support.hpp"

namespace st = deltasync::st;
using deltasync::DType;

namespace {

const std::string kLabel = "bad.safetensors";

// Parses `bytes` and returns the error message (failing the test if it parses).
std::string parse_error(const std::vector<uint8_t>& bytes) {
  return error_message([&] { st::File::from_bytes(bytes, kLabel); });
}

std::string parse_error(std::string_view header, size_t data_bytes = 0) {
  return parse_error(safetensors_bytes(header, random_bytes(data_bytes, 7)));
}

// Every reader error is one line of the form "LABEL: reason".
void expect_reason(const std::string& message, const std::string& reason) {
  EXPECT_EQ(message.rfind(kLabel + ": ", 0), 0u) << message;
  EXPECT_NE(message.find(reason), std::string::npos) << "message: " << message << "\nexpected reason: " << reason;
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
}

struct OwnedTensor {
  std::string name;
  DType dtype;
  std::vector<uint64_t> shape;
  std::vector<uint8_t> bytes;
  st::WriteTensor view() const { return {name, dtype, shape, bytes}; }
};

OwnedTensor random_tensor(std::string name, DType dtype, std::vector<uint64_t> shape, uint64_t seed) {
  uint64_t numel = 1;
  for (uint64_t d : shape) numel *= d;
  return {std::move(name), dtype, std::move(shape), random_bytes(numel * deltasync::dtype_width(dtype), seed)};
}

std::vector<st::WriteTensor> views(const std::vector<OwnedTensor>& tensors) {
  std::vector<st::WriteTensor> out;
  for (const OwnedTensor& t : tensors) out.push_back(t.view());
  return out;
}

void expect_same_content(const st::File& file, const std::vector<OwnedTensor>& expected, const st::Metadata& metadata) {
  ASSERT_EQ(file.tensors().size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    const st::TensorInfo& got = file.tensors()[i];
    EXPECT_EQ(got.name, expected[i].name);
    EXPECT_EQ(got.dtype, expected[i].dtype);
    EXPECT_EQ(got.shape, expected[i].shape);
    const auto bytes = file.bytes(got);
    EXPECT_EQ(std::vector<uint8_t>(bytes.begin(), bytes.end()), expected[i].bytes) << got.name;
    EXPECT_EQ(&file.at(expected[i].name), &got);
  }
  EXPECT_EQ(file.metadata(), metadata);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Round trips

TEST(SafetensorsRoundTrip, EveryDtypeThroughFileAndMemory) {
  const DType all[] = {DType::BF16, DType::F16, DType::F32, DType::F8_E4M3, DType::F8_E5M2,
                       DType::F64,  DType::I8,  DType::U8,  DType::I16,     DType::U16,
                       DType::I32,  DType::U32, DType::I64, DType::U64,     DType::BOOL};
  std::vector<OwnedTensor> tensors;
  uint64_t seed = 1;
  for (DType dtype : all) {
    // Odd shapes so that tensors end at unaligned offsets.
    tensors.push_back(random_tensor(std::string("layer.") + std::string(deltasync::dtype_name(dtype)), dtype,
                                    {3, seed % 5 + 1}, seed));
    ++seed;
  }
  const st::Metadata metadata{{"model_version", "7"}, {"note", "ünïcode ✓"}};
  TempDir dir;
  const std::string path = dir.file("model.safetensors");
  st::write_file(path, views(tensors), metadata);

  const st::File opened = st::File::open(path);
  EXPECT_EQ(opened.label(), path);
  expect_same_content(opened, tensors, metadata);

  const std::vector<uint8_t> serialized = st::serialize(views(tensors), metadata);
  EXPECT_EQ(serialized, read_file_bytes(path)) << "write_file and serialize must produce the same bytes";
  EXPECT_EQ(opened.size_bytes(), serialized.size());
  const st::File in_memory = st::File::from_bytes(serialized, "memory");
  EXPECT_EQ(in_memory.label(), "memory");
  expect_same_content(in_memory, tensors, metadata);
}

TEST(SafetensorsRoundTrip, EmptyFileWithZeroTensors) {
  TempDir dir;
  const std::string path = dir.file("empty.safetensors");
  st::write_file(path, {}, {});
  const auto bytes = read_file_bytes(path);
  // 8-byte length, then "{}" padded with spaces to 8 bytes.
  EXPECT_EQ(bytes, safetensors_bytes("{}      "));
  const st::File file = st::File::open(path);
  EXPECT_TRUE(file.tensors().empty());
  EXPECT_TRUE(file.metadata().empty());
  EXPECT_EQ(file.find("anything"), nullptr);
}

TEST(SafetensorsRoundTrip, ZeroElementAndScalarTensors) {
  std::vector<OwnedTensor> tensors = {
      random_tensor("before", DType::F32, {2}, 1),
      random_tensor("empty_matrix", DType::BF16, {3, 0}, 2),
      random_tensor("empty_vector", DType::F8_E5M2, {0}, 3),
      random_tensor("scalar", DType::F16, {}, 4),
      random_tensor("after", DType::U8, {5}, 5),
  };
  const auto serialized = st::serialize(views(tensors), {});
  const st::File file = st::File::from_bytes(serialized, "zero");
  expect_same_content(file, tensors, {});
  const st::TensorInfo& empty = file.at("empty_matrix");
  EXPECT_EQ(empty.begin, empty.end);
  EXPECT_EQ(empty.numel(), 0u);
  EXPECT_EQ(file.at("scalar").numel(), 1u);
  EXPECT_EQ(file.at("scalar").nbytes(), 2u);
}

TEST(SafetensorsRoundTrip, MetadataWithoutTensors) {
  const st::Metadata metadata{{"a", ""}, {"b", "{\"json\": [1, 2]}"}};
  const st::File file = st::File::from_bytes(st::serialize({}, metadata), "meta");
  EXPECT_TRUE(file.tensors().empty());
  EXPECT_EQ(file.metadata(), metadata);
}

TEST(SafetensorsRoundTrip, FileStaysReadableAfterMove) {
  std::vector<OwnedTensor> tensors = {random_tensor("w", DType::BF16, {64}, 9)};
  TempDir dir;
  const std::string path = dir.file("w.safetensors");
  st::write_file(path, views(tensors), {});
  st::File first = st::File::open(path);
  st::File moved = std::move(first);
  st::File assigned = st::File::from_bytes(st::serialize({}, {}), "other");
  assigned = std::move(moved);
  expect_same_content(assigned, tensors, {});
}

TEST(SafetensorsRoundTrip, AtNamesTheFileAndTheMissingTensor) {
  const st::File file = st::File::from_bytes(st::serialize({}, {}), "ckpt.safetensors");
  const std::string message = error_message([&] { file.at("lm_head.weight"); });
  EXPECT_EQ(message, "ckpt.safetensors: no tensor lm_head.weight");
}

// ---------------------------------------------------------------------------------------------
// Byte layout

TEST(SafetensorsLayout, HeaderIsCompactJsonPaddedToEightBytes) {
  const std::vector<uint8_t> a = {1, 2, 3, 4, 5, 6, 7, 8};
  const std::vector<uint8_t> b = {9, 10};
  const st::WriteTensor tensors[] = {{"b_first", DType::F32, {2}, a}, {"a_second", DType::U8, {1, 2}, b}};
  const auto bytes = st::serialize(tensors, {{"k", "v"}});

  // Metadata first, then tensors in the order given (not sorted), data laid out in that order.
  std::string header =
      R"({"__metadata__":{"k":"v"},"b_first":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("a_second":{"dtype":"U8","shape":[1,2],"data_offsets":[8,10]}})";
  header.append((8 - header.size() % 8) % 8, ' ');
  std::vector<uint8_t> data = a;
  data.insert(data.end(), b.begin(), b.end());
  EXPECT_EQ(bytes, safetensors_bytes(header, data));
  EXPECT_EQ((8 + header.size()) % 8, 0u);
}

TEST(SafetensorsLayout, NoMetadataKeyWhenMetadataIsEmpty) {
  const std::vector<uint8_t> a = {1};
  const st::WriteTensor tensors[] = {{"x", DType::I8, {1}, a}};
  const auto bytes = st::serialize(tensors, {});
  const std::string header(bytes.begin() + 8, bytes.end() - 1);
  EXPECT_EQ(header.find("__metadata__"), std::string::npos);
  EXPECT_EQ(header.substr(0, header.find_last_not_of(' ') + 1),
            R"({"x":{"dtype":"I8","shape":[1],"data_offsets":[0,1]}})");
}

TEST(SafetensorsLayout, SerializeRejectsInconsistentInput) {
  const std::vector<uint8_t> four(4), three(3);
  const st::WriteTensor duplicate[] = {{"w", DType::U8, {4}, four}, {"w", DType::U8, {4}, four}};
  EXPECT_NE(error_message([&] { st::serialize(duplicate, {}); }).find("\"w\" twice"), std::string::npos);
  const st::WriteTensor wrong_size[] = {{"w", DType::F16, {2}, three}};
  EXPECT_NE(error_message([&] { st::serialize(wrong_size, {}); }).find("3 bytes given but F16 [2] needs 4"),
            std::string::npos);
  const st::WriteTensor reserved[] = {{"__metadata__", DType::U8, {4}, four}};
  EXPECT_NE(error_message([&] { st::serialize(reserved, {}); }).find("__metadata__"), std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// Malformed files: one test per kind. Data bytes are sized so that only the named defect exists.

TEST(SafetensorsMalformed, FileShorterThanEightBytes) {
  expect_reason(parse_error(std::vector<uint8_t>{1, 2, 3, 4, 5}), "file is 5 bytes, shorter than the 8-byte header length");
  expect_reason(parse_error(std::vector<uint8_t>{}), "file is 0 bytes");
  // The same check through open(): a file too short to be mapped.
  TempDir dir;
  const std::string path = dir.file("short.safetensors");
  write_file_bytes(path, std::vector<uint8_t>{7, 0, 0});
  EXPECT_EQ(error_message([&] { st::File::open(path); }),
            path + ": file is 3 bytes, shorter than the 8-byte header length");
}

TEST(SafetensorsMalformed, HeaderLengthZero) {
  expect_reason(parse_error(std::vector<uint8_t>(16, 0)), "header length is 0");
}

TEST(SafetensorsMalformed, HeaderLengthOverLimit) {
  std::vector<uint8_t> bytes = safetensors_bytes("{}");
  const uint64_t too_long = st::kMaxHeaderBytes + 1;
  std::memcpy(bytes.data(), &too_long, 8);
  expect_reason(parse_error(bytes), "header length " + std::to_string(too_long) + " exceeds the limit");
}

TEST(SafetensorsMalformed, HeaderLengthBeyondFileEnd) {
  std::vector<uint8_t> bytes = safetensors_bytes("{}      ");
  bytes.resize(12);  // truncated inside the header
  expect_reason(parse_error(bytes), "header length 8 runs past the end of the 12-byte file");
}

TEST(SafetensorsMalformed, HeaderDoesNotStartWithBrace) {
  expect_reason(parse_error(" {}"), "header does not start with '{'");
}

TEST(SafetensorsMalformed, HeaderIsNotAnObject) {
  // A header that is valid JSON but a list: refused by the safetensors "starts with {" rule.
  expect_reason(parse_error("[1, 2]"), "header does not start with '{'");
}

TEST(SafetensorsMalformed, HeaderIsNotValidJson) {
  expect_reason(parse_error(R"({"w": {"dtype": "F32",)"), "header is not valid UTF-8 JSON");
  expect_reason(parse_error("{} trailing"), "header is not valid UTF-8 JSON");
}

TEST(SafetensorsMalformed, HeaderIsNotValidUtf8) {
  expect_reason(parse_error("{\"w\xff\": {}}"), "header is not valid UTF-8 JSON");
}

TEST(SafetensorsMalformed, HeaderNestedTooDeep) {
  // A 2 MB header of nested lists overflowed the stack inside the JSON parser (fuzz_safetensors on
  // a hand-made input: longer than the fuzzers' inputs).
  const std::string deep = std::string(1000000, '[') + std::string(1000000, ']');
  expect_reason(parse_error("{\"w\": {\"dtype\": \"F32\", \"shape\": [" + deep + "], \"data_offsets\": [0, 0]}}"),
                "header nests deeper than 8 levels");
  expect_reason(parse_error("{\"__metadata__\": {\"a\": " + deep + "}}"), "header nests deeper than 8 levels");
  // Real headers nest three levels.
  EXPECT_NO_THROW(st::File::from_bytes(safetensors_bytes(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})",
                                                        random_bytes(4, 7)),
                                      kLabel));
}

TEST(SafetensorsMalformed, TensorEntryIsNotAnObject) {
  expect_reason(parse_error(R"({"w": [0, 4]})"), "tensor \"w\": entry is not an object");
}

TEST(SafetensorsMalformed, TensorEntryMissingKey) {
  expect_reason(parse_error(R"({"w": {"dtype": "F32", "shape": [1]}})", 4), "tensor \"w\": missing key \"data_offsets\"");
}

TEST(SafetensorsMalformed, TensorEntryExtraKey) {
  expect_reason(parse_error(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "scale": 2}})", 4),
                "tensor \"w\": unexpected key \"scale\"");
}

TEST(SafetensorsMalformed, UnknownDtype) {
  expect_reason(parse_error(R"({"w": {"dtype": "F4", "shape": [1], "data_offsets": [0, 1]}})", 1),
                "tensor \"w\": unknown dtype \"F4\"");
  expect_reason(parse_error(R"({"w": {"dtype": 2, "shape": [1], "data_offsets": [0, 1]}})", 1),
                "tensor \"w\": dtype is not a string");
}

TEST(SafetensorsMalformed, ShapeNotAListOfNonNegativeIntegers) {
  expect_reason(parse_error(R"({"w": {"dtype": "U8", "shape": 4, "data_offsets": [0, 4]}})", 4),
                "tensor \"w\": shape is not a list");
  expect_reason(parse_error(R"({"w": {"dtype": "U8", "shape": [-4], "data_offsets": [0, 4]}})", 4),
                "tensor \"w\": shape entry -4 is not a non-negative integer");
  expect_reason(parse_error(R"({"w": {"dtype": "U8", "shape": [4.0], "data_offsets": [0, 4]}})", 4),
                "tensor \"w\": shape entry 4.0 is not a non-negative integer");
}

TEST(SafetensorsMalformed, ShapeProductOverflows) {
  expect_reason(parse_error(R"({"w": {"dtype": "U8", "shape": [4294967296, 4294967296], "data_offsets": [0, 0]}})"),
                "tensor \"w\": shape [4294967296, 4294967296] has more than 2^64 elements");
  // Fits in elements but not in bytes once multiplied by the width.
  expect_reason(parse_error(R"({"w": {"dtype": "F32", "shape": [4611686018427387904], "data_offsets": [0, 0]}})"),
                "has more than 2^64 bytes");
}

TEST(SafetensorsMalformed, DataOffsetsNotTwoIntegers) {
  const std::string reason = "tensor \"w\": data_offsets is not a list of 2 non-negative integers";
  expect_reason(parse_error(R"({"w": {"dtype": "U8", "shape": [4], "data_offsets": [4]}})", 4), reason);
  expect_reason(parse_error(R"({"w": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4, 8]}})", 4), reason);
  expect_reason(parse_error(R"({"w": {"dtype": "U8", "shape": [4], "data_offsets": [-1, 3]}})", 4), reason);
  expect_reason(parse_error(R"({"w": {"dtype": "U8", "shape": [4], "data_offsets": ["0", 4]}})", 4), reason);
}

TEST(SafetensorsMalformed, DataOffsetsBeginAfterEnd) {
  expect_reason(parse_error(R"({"w": {"dtype": "U8", "shape": [4], "data_offsets": [4, 0]}})", 4),
                "tensor \"w\": data_offsets begin 4 is after end 0");
}

TEST(SafetensorsMalformed, DataOffsetsEndBeyondDataSection) {
  expect_reason(parse_error(R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", 6),
                "tensor \"w\": data_offsets end 8 is beyond the data section of 6 bytes");
}

TEST(SafetensorsMalformed, DataOffsetsDisagreeWithDtypeAndShape) {
  expect_reason(parse_error(R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 6]}})", 6),
                "tensor \"w\": data_offsets span 6 bytes but F32 [2] needs 8");
}

TEST(SafetensorsMalformed, TensorsOverlap) {
  expect_reason(parse_error(R"({"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},)"
                            R"( "b": {"dtype": "U8", "shape": [8], "data_offsets": [4, 12]}})",
                            12),
                "tensor \"b\" overlaps tensor \"a\" at byte 4");
  // A zero-element tensor placed inside another tensor is an overlap too.
  expect_reason(parse_error(R"({"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},)"
                            R"( "z": {"dtype": "U8", "shape": [0], "data_offsets": [3, 3]}})",
                            8),
                "tensor \"z\" overlaps tensor \"a\" at byte 3");
}

TEST(SafetensorsMalformed, GapBetweenTensors) {
  expect_reason(parse_error(R"({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},)"
                            R"( "b": {"dtype": "U8", "shape": [4], "data_offsets": [8, 12]}})",
                            12),
                "data section bytes 4..8 belong to no tensor (gap before tensor \"b\")");
  expect_reason(parse_error(R"({"b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}})", 6),
                "data section bytes 0..2 belong to no tensor");
}

TEST(SafetensorsMalformed, TrailingBytesNotCovered) {
  expect_reason(parse_error(R"({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}})", 9),
                "data section bytes 4..9 belong to no tensor (trailing bytes)");
  expect_reason(parse_error("{}", 1), "data section bytes 0..1 belong to no tensor");
}

TEST(SafetensorsMalformed, DuplicateTensorName) {
  expect_reason(parse_error(R"({"w": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},)"
                            R"( "w": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]}})",
                            8),
                "header names tensor \"w\" twice");
}

TEST(SafetensorsMalformed, DuplicateKeyInsideEntry) {
  expect_reason(parse_error(R"({"w": {"dtype": "U8", "dtype": "F32", "shape": [4], "data_offsets": [0, 4]}})", 4),
                "header repeats key \"dtype\" inside an entry");
}

TEST(SafetensorsMalformed, MetadataNotAnObjectOfStrings) {
  expect_reason(parse_error(R"({"__metadata__": ["sparse", "True"]})"), "__metadata__ is not an object");
  expect_reason(parse_error(R"({"__metadata__": {"model_version": 3}})"),
                "__metadata__ value of \"model_version\" is not a string");
}

TEST(SafetensorsMalformed, OpenMissingFileOrFolder) {
  TempDir dir;
  const std::string missing = dir.file("missing.safetensors");
  EXPECT_EQ(error_message([&] { st::File::open(missing); }), missing + ": cannot open: No such file or directory");
  const std::string folder = dir.path().string();
  EXPECT_EQ(error_message([&] { st::File::open(folder); }), folder + ": not a regular file");
}

TEST(SafetensorsMalformed, OpenReportsThePathAsLabel) {
  TempDir dir;
  const std::string path = dir.file("corrupt.safetensors");
  write_file_bytes(path, safetensors_bytes("{\"w\": 1}"));
  EXPECT_EQ(error_message([&] { st::File::open(path); }), path + ": tensor \"w\": entry is not an object");
}

// ---------------------------------------------------------------------------------------------
// Atomic writes

TEST(SafetensorsAtomicWrite, MissingFolderThrowsAndLeavesNothing) {
  TempDir dir;
  const std::string path = dir.file("no-such-folder/out.safetensors");
  const std::string message = error_message([&] { st::write_file(path, {}, {}); });
  EXPECT_EQ(message.rfind(path + ": cannot create temporary file", 0), 0u) << message;
  EXPECT_TRUE(dir.entries().empty());
}

TEST(SafetensorsAtomicWrite, FailedRenameRemovesTemporaryFile) {
  // A folder where the output should go makes the final rename fail after the data was written.
  TempDir dir;
  const std::string path = dir.file("out.safetensors");
  std::filesystem::create_directory(path);
  std::filesystem::create_directory(dir.file("out.safetensors/keep"));  // rename can't replace a non-empty dir
  const std::vector<uint8_t> data = random_bytes(64, 3);
  const st::WriteTensor tensors[] = {{"w", DType::U8, {64}, data}};
  const std::string message = error_message([&] { st::write_file(path, tensors, {}); });
  EXPECT_EQ(message.rfind(path + ": cannot rename", 0), 0u) << message;
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"out.safetensors"});
  EXPECT_TRUE(std::filesystem::is_directory(path));
}

TEST(SafetensorsAtomicWrite, InvalidInputThrowsBeforeCreatingAnything) {
  TempDir dir;
  const std::string path = dir.file("out.safetensors");
  const std::vector<uint8_t> three(3);
  const st::WriteTensor tensors[] = {{"w", DType::F32, {1}, three}};
  const std::string message = error_message([&] { st::write_file(path, tensors, {}); });
  EXPECT_EQ(message.rfind(path + ": ", 0), 0u) << message;
  EXPECT_TRUE(dir.entries().empty());
}

TEST(SafetensorsAtomicWrite, OverwriteReplacesTheFile) {
  TempDir dir;
  const std::string path = dir.file("model.safetensors");
  const std::vector<OwnedTensor> old_tensors = {random_tensor("old", DType::F32, {100}, 1)};
  const std::vector<OwnedTensor> new_tensors = {random_tensor("new", DType::BF16, {3}, 2)};
  st::write_file(path, views(old_tensors), {{"version", "1"}});
  st::write_file(path, views(new_tensors), {{"version", "2"}});
  expect_same_content(st::File::open(path), new_tensors, {{"version", "2"}});
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"model.safetensors"});
}

TEST(SafetensorsAtomicWrite, ReaderOfTheOldFileKeepsItsBytes) {
  // Rename replaces the directory entry; a mapping of the old file stays intact.
  TempDir dir;
  const std::string path = dir.file("model.safetensors");
  const std::vector<OwnedTensor> old_tensors = {random_tensor("w", DType::U8, {4096}, 1)};
  st::write_file(path, views(old_tensors), {});
  const st::File mapped = st::File::open(path);
  st::write_file(path, views({random_tensor("w", DType::U8, {4096}, 2)}), {});
  expect_same_content(mapped, old_tensors, {});
}
