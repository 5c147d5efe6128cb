// Strict safetensors reader, serializer and atomic writer (see safetensors.hpp for the contract).
//
// The reader checks the whole header before handing out any tensor: a delta arrives from an
// object store and is applied to live weights, so a truncated or hostile file must be refused
// up front with a reason, never half-used.
#include "format/safetensors.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>
#include <utility>

#include "format/atomic_file.hpp"
#include "core/error.hpp"

namespace deltasync::st {
namespace {

// The container stores the header length and all tensor data little-endian; we hand out the
// mapped bytes as they are, so the host must be little-endian too.
static_assert(std::endian::native == std::endian::little, "deltasync assumes a little-endian host");

// ordered_json keeps the header's key order, which is the tensor order a writer emitted.
using Json = nlohmann::ordered_json;

constexpr std::string_view kMetadataKey = "__metadata__";

[[noreturn]] void fail(const std::string& label, const std::string& reason) { throw BadInputError(label + ": " + reason); }

std::string errno_text(int err) { return std::strerror(err); }

std::optional<uint64_t> checked_mul(uint64_t a, uint64_t b) {
  uint64_t product = 0;
  if (__builtin_mul_overflow(a, b, &product)) return std::nullopt;
  return product;
}

std::optional<uint64_t> shape_numel(std::span<const uint64_t> shape) {
  uint64_t n = 1;
  for (uint64_t dim : shape) {
    auto next = checked_mul(n, dim);
    if (!next) return std::nullopt;
    n = *next;
  }
  return n;
}


// A JSON header parsed into an ordered DOM. Duplicate keys are refused at any depth: nlohmann
// keeps one of two equal keys silently, which would let a file carry a tensor the reader never
// sees (and safetensors forbids duplicate names).
struct DuplicateKey {
  std::string key;
};
// A header nests three levels ({name: {shape: [...]}}). Deeper is refused before the DOM is built: the
// callback parser copies nested values recursively, so a header of a few MB of '[' overflowed
// the stack (found running the fuzz harness on a hand-made deep header).
constexpr int kMaxHeaderDepth = 8;
struct TooDeep {};

// One SAX pass refuses deep nesting and duplicate keys and records the top level's key order;
// then the header is parsed into a sorted DOM (nlohmann::json, a std::map) and put in that order.
// Both steps are O(T log T) for T tensors: nlohmann's callback parser rescans a parent object at
// every nested object's end, and parsing into ordered_json inserts every key by a linear search,
// each O(T^2) (a 70k-tensor MoE delta part's header took 25 s).
struct HeaderChecker {
  std::vector<std::set<std::string>> keys_per_open_object;
  int open = 0;  // containers open
  std::vector<std::string> order;
  std::string error;
  bool enter() {
    if (open >= kMaxHeaderDepth) throw TooDeep{};
    ++open;
    return true;
  }
  bool null() { return true; }
  bool boolean(bool) { return true; }
  bool number_integer(int64_t) { return true; }
  bool number_unsigned(uint64_t) { return true; }
  bool number_float(double, const std::string&) { return true; }
  bool string(std::string&) { return true; }
  bool binary(nlohmann::json::binary_t&) { return true; }
  bool start_object(size_t) {
    keys_per_open_object.emplace_back();
    return enter();
  }
  bool key(std::string& key) {
    if (!keys_per_open_object.back().insert(key).second) throw DuplicateKey{key};
    if (keys_per_open_object.size() == 1) order.push_back(key);
    return true;
  }
  bool end_object() {
    keys_per_open_object.pop_back();
    --open;
    return true;
  }
  bool start_array(size_t) {
    keys_per_open_object.emplace_back();  // keeps back() the innermost open object's keys
    return enter();
  }
  bool end_array() {
    keys_per_open_object.pop_back();
    --open;
    return true;
  }
  bool parse_error(size_t, const std::string&, const nlohmann::json::exception& e) {
    error = e.what();
    return false;
  }
};

Json parse_header_json(std::string_view text, const std::string& label) {
  HeaderChecker checker;
  try {
    if (!nlohmann::json::sax_parse(text.begin(), text.end(), &checker))
      fail(label, "header is not valid UTF-8 JSON (" + checker.error + ")");
    nlohmann::json sorted = nlohmann::json::parse(text.begin(), text.end());
    if (!sorted.is_object()) return Json(sorted);
    Json out = Json::object();
    auto& entries = out.get_ref<Json::object_t&>();
    entries.reserve(checker.order.size());
    for (const std::string& key : checker.order) entries.push_back({key, Json(std::move(sorted[key]))});
    return out;
  } catch (const TooDeep&) {
    fail(label, "header nests deeper than " + std::to_string(kMaxHeaderDepth) + " levels");
  } catch (const DuplicateKey& dup) {
    if (checker.keys_per_open_object.size() == 1) fail(label, "header names tensor \"" + dup.key + "\" twice");
    fail(label, "header repeats key \"" + dup.key + "\" inside an entry");
  } catch (const nlohmann::json::exception& e) {
    fail(label, std::string("header is not valid UTF-8 JSON (") + e.what() + ")");
  }
}

std::vector<uint64_t> parse_shape(const Json& value, const std::string& where, const std::string& label) {
  if (!value.is_array()) fail(label, where + ": shape is not a list");
  std::vector<uint64_t> shape;
  shape.reserve(value.size());
  for (const Json& dim : value) {
    if (!dim.is_number_unsigned()) {
      fail(label, where + ": shape entry " + dim.dump() + " is not a non-negative integer");
    }
    shape.push_back(dim.get<uint64_t>());
  }
  return shape;
}

TensorInfo parse_tensor_entry(const std::string& name, const Json& entry, const std::string& label) {
  const std::string where = "tensor \"" + name + "\"";
  if (!entry.is_object()) fail(label, where + ": entry is not an object");
  for (const auto& [key, _] : entry.items()) {
    if (key != "dtype" && key != "shape" && key != "data_offsets") {
      fail(label, where + ": unexpected key \"" + key + "\" (allowed: dtype, shape, data_offsets)");
    }
  }
  for (const char* required : {"dtype", "shape", "data_offsets"}) {
    if (!entry.contains(required)) fail(label, where + ": missing key \"" + required + "\"");
  }

  const Json& dtype_json = entry["dtype"];
  if (!dtype_json.is_string()) fail(label, where + ": dtype is not a string");
  const auto dtype = dtype_from_name(dtype_json.get_ref<const std::string&>());
  if (!dtype) fail(label, where + ": unknown dtype \"" + dtype_json.get<std::string>() + "\"");

  std::vector<uint64_t> shape = parse_shape(entry["shape"], where, label);
  const auto numel = shape_numel(shape);
  if (!numel) fail(label, where + ": shape " + shape_text(shape) + " has more than 2^64 elements");
  const auto expected_bytes = checked_mul(*numel, dtype_width(*dtype));
  if (!expected_bytes) fail(label, where + ": shape " + shape_text(shape) + " has more than 2^64 bytes");

  const Json& offsets = entry["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
      !offsets[1].is_number_unsigned()) {
    fail(label, where + ": data_offsets is not a list of 2 non-negative integers");
  }
  TensorInfo info{name, *dtype, std::move(shape), offsets[0].get<uint64_t>(), offsets[1].get<uint64_t>()};
  if (info.begin > info.end) {
    fail(label, where + ": data_offsets begin " + std::to_string(info.begin) + " is after end " +
                    std::to_string(info.end));
  }
  if (info.nbytes() != *expected_bytes) {
    fail(label, where + ": data_offsets span " + std::to_string(info.nbytes()) + " bytes but " +
                    std::string(dtype_name(info.dtype)) + " " + shape_text(info.shape) + " needs " +
                    std::to_string(*expected_bytes));
  }
  return info;
}

Metadata parse_metadata(const Json& value, const std::string& label) {
  if (!value.is_object()) fail(label, "__metadata__ is not an object");
  Metadata metadata;
  for (const auto& [key, v] : value.items()) {
    if (!v.is_string()) fail(label, "__metadata__ value of \"" + key + "\" is not a string");
    metadata.emplace(key, v.get<std::string>());
  }
  return metadata;
}

// safetensors requires the tensors to tile the data section exactly: no overlaps (two tensors
// aliasing bytes) and no gaps (bytes no tensor accounts for, a place to hide data).
void check_data_coverage(const std::vector<TensorInfo>& tensors, uint64_t data_size, const std::string& label) {
  std::vector<const TensorInfo*> by_offset;
  by_offset.reserve(tensors.size());
  for (const TensorInfo& t : tensors) {
    if (t.end > data_size) {
      fail(label, "tensor \"" + t.name + "\": data_offsets end " + std::to_string(t.end) +
                      " is beyond the data section of " + std::to_string(data_size) + " bytes");
    }
    by_offset.push_back(&t);
  }
  std::sort(by_offset.begin(), by_offset.end(), [](const TensorInfo* a, const TensorInfo* b) {
    return std::pair(a->begin, a->end) < std::pair(b->begin, b->end);
  });
  uint64_t covered_to = 0;
  const TensorInfo* previous = nullptr;
  for (const TensorInfo* t : by_offset) {
    if (t->begin < covered_to) {
      fail(label, "tensor \"" + t->name + "\" overlaps tensor \"" + previous->name + "\" at byte " +
                      std::to_string(t->begin) + " of the data section");
    }
    if (t->begin > covered_to) {
      fail(label, "data section bytes " + std::to_string(covered_to) + ".." + std::to_string(t->begin) +
                      " belong to no tensor (gap before tensor \"" + t->name + "\")");
    }
    // Sorted by (begin, end) and begin == covered_to here, so ends never decrease.
    previous = t;
    covered_to = t->end;
  }
  if (covered_to != data_size) {
    fail(label, "data section bytes " + std::to_string(covered_to) + ".." + std::to_string(data_size) +
                    " belong to no tensor (trailing bytes)");
  }
}

struct ParsedHeader {
  std::vector<TensorInfo> tensors;
  Metadata metadata;
  uint64_t data_start = 0;
};

ParsedHeader parse_container(std::span<const uint8_t> file, const std::string& label) {
  if (file.size() < 8) {
    fail(label, "file is " + std::to_string(file.size()) + " bytes, shorter than the 8-byte header length");
  }
  uint64_t header_len = 0;
  std::memcpy(&header_len, file.data(), 8);
  if (header_len == 0) fail(label, "header length is 0");
  if (header_len > kMaxHeaderBytes) {
    fail(label, "header length " + std::to_string(header_len) + " exceeds the limit of " +
                    std::to_string(kMaxHeaderBytes) + " bytes");
  }
  if (header_len > file.size() - 8) {
    fail(label, "header length " + std::to_string(header_len) + " runs past the end of the " +
                    std::to_string(file.size()) + "-byte file (truncated?)");
  }
  const std::string_view text(reinterpret_cast<const char*>(file.data() + 8), header_len);
  if (text.front() != '{') fail(label, "header does not start with '{'");

  const Json header = parse_header_json(text, label);
  if (!header.is_object()) fail(label, "header is not a JSON object");

  ParsedHeader parsed;
  parsed.data_start = 8 + header_len;
  for (const auto& [key, value] : header.items()) {
    if (key == kMetadataKey) {
      parsed.metadata = parse_metadata(value, label);
    } else {
      parsed.tensors.push_back(parse_tensor_entry(key, value, label));
    }
  }
  check_data_coverage(parsed.tensors, file.size() - parsed.data_start, label);
  return parsed;
}

// Owns the file's bytes: either a read-only private mapping or a vector handed to from_bytes.
class Storage {
 public:
  Storage() = default;
  explicit Storage(std::vector<uint8_t> bytes) : owned_(std::move(bytes)), view_(owned_) {}
  static Storage mapped(void* address, size_t size) {
    Storage s;
    s.mapping_ = address;
    s.view_ = {static_cast<const uint8_t*>(address), size};
    return s;
  }
  Storage(Storage&& other) noexcept { *this = std::move(other); }
  Storage& operator=(Storage&& other) noexcept {
    if (this != &other) {
      release();
      // A moved vector keeps its heap buffer, so a view into it stays valid across the move.
      owned_ = std::move(other.owned_);
      mapping_ = std::exchange(other.mapping_, nullptr);
      view_ = std::exchange(other.view_, {});
    }
    return *this;
  }
  ~Storage() { release(); }
  std::span<const uint8_t> bytes() const { return view_; }

 private:
  void release() {
    if (mapping_ != nullptr) munmap(mapping_, view_.size());
    mapping_ = nullptr;
  }
  std::vector<uint8_t> owned_;
  void* mapping_ = nullptr;
  std::span<const uint8_t> view_;
};

class FileDescriptor {
 public:
  explicit FileDescriptor(int fd) : fd_(fd) {}
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  ~FileDescriptor() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  // Closes now and reports the result: close can surface a deferred write error.
  int close() { return ::close(std::exchange(fd_, -1)); }

 private:
  int fd_;
};

}  // namespace

uint64_t TensorInfo::numel() const {
  const auto n = shape_numel(shape);
  if (!n) throw BadInputError("tensor " + name + ": shape " + shape_text(shape) + " has more than 2^64 elements");
  return *n;
}

struct File::Impl {
  std::string label;
  Storage storage;
  uint64_t data_start = 0;
  std::vector<TensorInfo> tensors;
  std::map<std::string, size_t, std::less<>> index_by_name;
  Metadata metadata;

  Impl(std::string label_in, Storage storage_in) : label(std::move(label_in)), storage(std::move(storage_in)) {
    ParsedHeader parsed = parse_container(storage.bytes(), label);
    data_start = parsed.data_start;
    tensors = std::move(parsed.tensors);
    metadata = std::move(parsed.metadata);
    for (size_t i = 0; i < tensors.size(); ++i) index_by_name.emplace(tensors[i].name, i);
  }
};

File::File(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
File::File(File&&) noexcept = default;
File& File::operator=(File&&) noexcept = default;
File::~File() = default;

File File::open(const std::string& path) {
  FileDescriptor fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) fail(path, "cannot open: " + errno_text(errno));
  struct stat info {};
  if (fstat(fd.get(), &info) != 0) fail(path, "cannot stat: " + errno_text(errno));
  if (!S_ISREG(info.st_mode)) fail(path, "not a regular file");
  const auto size = static_cast<uint64_t>(info.st_size);
  // mmap refuses length 0, and a file this short is invalid anyway: let the parser say why.
  if (size < 8) return File(std::make_unique<Impl>(path, Storage(std::vector<uint8_t>(size, 0))));
  void* address = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd.get(), 0);
  if (address == MAP_FAILED) fail(path, "cannot map " + std::to_string(size) + " bytes: " + errno_text(errno));
  return File(std::make_unique<Impl>(path, Storage::mapped(address, size)));
}

File File::from_bytes(std::vector<uint8_t> bytes, std::string label) {
  return File(std::make_unique<Impl>(std::move(label), Storage(std::move(bytes))));
}

const std::string& File::label() const { return impl_->label; }
const std::vector<TensorInfo>& File::tensors() const { return impl_->tensors; }

const TensorInfo* File::find(std::string_view name) const {
  const auto it = impl_->index_by_name.find(name);
  return it == impl_->index_by_name.end() ? nullptr : &impl_->tensors[it->second];
}

const TensorInfo& File::at(std::string_view name) const {
  const TensorInfo* t = find(name);
  if (t == nullptr) fail(impl_->label, "no tensor " + std::string(name));
  return *t;
}

std::span<const uint8_t> File::bytes(const TensorInfo& t) const {
  return impl_->storage.bytes().subspan(impl_->data_start + t.begin, t.nbytes());
}

const Metadata& File::metadata() const { return impl_->metadata; }
uint64_t File::size_bytes() const { return impl_->storage.bytes().size(); }

// ---------------------------------------------------------------------------------------------
// Writing

namespace {

// The 8-byte length followed by the JSON header, padded with spaces so the data section starts
// 8-byte aligned (as the reference implementation does).
std::string header_block(std::span<const WriteTensor> tensors, const Metadata& metadata) {
  for (const WriteTensor& t : tensors) {
    const auto numel = shape_numel(t.shape);
    const auto expected = numel ? checked_mul(*numel, dtype_width(t.dtype)) : std::nullopt;
    if (!expected || *expected != t.bytes.size()) {
      throw BadInputError("tensor \"" + t.name + "\": " + std::to_string(t.bytes.size()) + " bytes given but " +
                  std::string(dtype_name(t.dtype)) + " " + shape_text(t.shape) + " needs " +
                  (expected ? std::to_string(*expected) : std::string("more than 2^64")));
    }
  }
  std::vector<TensorMeta> meta;
  meta.reserve(tensors.size());
  for (const WriteTensor& t : tensors) meta.push_back({t.name, t.dtype, t.shape});
  return header_of(meta, metadata);
}

}  // namespace

std::string header_of(std::span<const TensorMeta> tensors, const Metadata& metadata) {
  Json header = Json::object();
  if (!metadata.empty()) {
    Json meta = Json::object();
    for (const auto& [key, value] : metadata) meta[key] = value;
    header[std::string(kMetadataKey)] = std::move(meta);
  }
  std::set<std::string_view> seen;
  uint64_t offset = 0;
  // Appended, not assigned by key: ordered_json's operator[] searches its entries linearly, which
  // made a header of T tensors cost O(T^2) (a 70k-tensor MoE delta part: minutes). `seen` already
  // refuses a repeated name.
  auto& entries = header.get_ref<Json::object_t&>();
  for (const TensorMeta& t : tensors) {
    if (t.name == kMetadataKey) throw BadInputError("cannot write a tensor named __metadata__");
    if (!seen.insert(t.name).second) throw BadInputError("cannot write tensor \"" + t.name + "\" twice");
    const auto numel = shape_numel(t.shape);
    const auto expected = numel ? checked_mul(*numel, dtype_width(t.dtype)) : std::nullopt;
    if (!expected) throw BadInputError("tensor \"" + t.name + "\": " + shape_text(t.shape) + " needs more than 2^64 bytes");
    entries.push_back({t.name, Json{{"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + *expected}}}});
    offset += *expected;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& e) {
    throw BadInputError(std::string("tensor name or metadata is not valid UTF-8 (") + e.what() + ")");
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  if (text.size() > kMaxHeaderBytes) {
    throw BadInputError("header of " + std::to_string(text.size()) + " bytes exceeds the limit of " +
                std::to_string(kMaxHeaderBytes));
  }
  const uint64_t length = text.size();
  std::string block(8, '\0');
  std::memcpy(block.data(), &length, 8);
  return block + text;
}

std::vector<uint8_t> serialize(std::span<const WriteTensor> tensors, const Metadata& metadata) {
  const std::string block = header_block(tensors, metadata);
  size_t total = block.size();
  for (const WriteTensor& t : tensors) total += t.bytes.size();
  std::vector<uint8_t> out;
  out.reserve(total);
  out.insert(out.end(), block.begin(), block.end());
  for (const WriteTensor& t : tensors) out.insert(out.end(), t.bytes.begin(), t.bytes.end());
  return out;
}

void write_file(const std::string& path, std::span<const WriteTensor> tensors, const Metadata& metadata) {
  std::string block;
  try {
    block = header_block(tensors, metadata);
  } catch (const Error& e) {
    fail(path, e.what());
  }
  write_file_atomic(path, [&](const auto& write) {
    write({reinterpret_cast<const uint8_t*>(block.data()), block.size()});
    for (const WriteTensor& t : tensors) write(t.bytes);
  });
}

}  // namespace deltasync::st
