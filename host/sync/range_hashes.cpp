#include "sync/range_hashes.hpp"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "codec/compact_indexed.hpp"
#include "core/error.hpp"
#include "core/parse_number.hpp"
#include "format/sha256.hpp"
#include "sync/range_chunks.hpp"

namespace deltasync::ranged {
namespace {

uint64_t read_le64(const uint8_t* p) {
  uint64_t n = 0;
  for (int b = 7; b >= 0; --b) n = (n << 8) | p[b];
  return n;
}

ChunkHash chunk_hash(std::span<const uint8_t> chunk) {
  const auto full = sha256(chunk);
  ChunkHash out;
  std::copy(full.begin(), full.begin() + out.size(), out.begin());
  return out;
}

ChunkHash hex_digest(std::string_view hex) {
  auto nibble = [](char c) -> int { return c >= '0' && c <= '9' ? c - '0' : (c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1); };
  ChunkHash out{};
  for (size_t i = 0; i < out.size(); ++i) {
    const int hi = nibble(hex[2 * i]), lo = nibble(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) throw BadInputError("not lowercase hex");
    out[i] = static_cast<uint8_t>(hi * 16 + lo);
  }
  return out;
}

// range_chunk_sizes: positive decimal sizes, comma-separated, adding up to the data section.
std::vector<uint64_t> chunk_ends_of_sizes(std::string_view text, uint64_t data_bytes, const std::string& label) {
  const std::string what = label + ": metadata " + kChunkSizesKey;
  std::vector<uint64_t> ends;
  uint64_t at = 0;
  for (size_t from = 0; from <= text.size() && data_bytes > 0;) {
    const size_t comma = std::min(text.find(',', from), text.size());
    const uint64_t size = parse_decimal(text.substr(from, comma - from), data_bytes, what);
    if (size == 0 || size > data_bytes - at) throw BadInputError(what + " does not tile the " + std::to_string(data_bytes) + "-byte data section");
    at += size;
    ends.push_back(at);
    from = comma + 1;
  }
  if (at != data_bytes || (data_bytes == 0 && !text.empty()))
    throw BadInputError(what + " does not tile the " + std::to_string(data_bytes) + "-byte data section");
  return ends;
}

// range_chunk_bytes (objects sealed before range_chunk_sizes): one size, the last chunk shorter.
std::vector<uint64_t> chunk_ends_of_size(std::string_view text, uint64_t data_bytes, const std::string& label) {
  const uint64_t size = parse_decimal(text, uint64_t{1} << 30, label + ": metadata " + kChunkBytesKey);
  if (size == 0) throw BadInputError(label + ": metadata " + kChunkBytesKey + " is 0");
  std::vector<uint64_t> ends;
  for (uint64_t at = 0; at < data_bytes; at += size) ends.push_back(std::min(data_bytes, at + size));
  return ends;
}

}  // namespace

const st::TensorInfo* SealedHeader::find(std::string_view name) const {
  const auto it = std::lower_bound(by_name.begin(), by_name.end(), name,
                                   [&](uint32_t i, std::string_view n) { return std::string_view(tensors[i].name) < n; });
  return it != by_name.end() && tensors[*it].name == name ? &tensors[*it] : nullptr;
}

uint64_t header_prefix_bytes(std::span<const uint8_t> first8, uint64_t object_size, const std::string& label) {
  if (first8.size() < 8 || object_size < 8) throw BadInputError(label + ": shorter than a safetensors header length");
  const uint64_t n = read_le64(first8.data());
  if (n == 0 || n > object_size - 8 || n > st::kMaxHeaderBytes) throw BadInputError(label + ": bad safetensors header length");
  return 8 + n;
}

uint64_t chunk_bytes_for(uint64_t data_bytes) {
  uint64_t chunk = kMinChunkBytes;
  while (chunk * kTargetChunks < data_bytes) chunk *= 2;
  return chunk;
}

std::vector<uint8_t> seal(std::span<const uint8_t> file, const std::string& label, uint64_t chunk_bytes) {
  const uint64_t prefix = header_prefix_bytes(file, file.size(), label);
  if (chunk_bytes == 0) chunk_bytes = chunk_bytes_for(file.size() - prefix);
  // ordered_json: the tensors keep the writer's order (readers list them in header order).
  auto header = nlohmann::ordered_json::parse(file.begin() + 8, file.begin() + static_cast<std::ptrdiff_t>(prefix), nullptr, false);
  if (!header.is_object()) throw BadInputError(label + ": safetensors header is not a JSON object");
  // An indexed compact delta is sealed as written: its records and entries hash what they name.
  if (const auto md = header.find("__metadata__"); md != header.end() && md->is_object()) {
    const auto layout = md->find(compact::indexed::kLayoutKey);
    if (layout != md->end() && layout->is_string() && layout->get<std::string>() == std::to_string(compact::kLayout2))
      return std::vector<uint8_t>(file.begin(), file.end());
  }
  const std::span<const uint8_t> data = file.subspan(prefix);
  const std::vector<uint64_t> ends =
      chunk_ends(st::File::from_bytes(std::vector<uint8_t>(file.begin(), file.end()), label), data.size(), chunk_bytes);
  std::string sizes, hashes;
  hashes.reserve(ends.size() * kChunkHashBytes * 2);
  for (size_t c = 0; c < ends.size(); ++c) {
    const uint64_t begin = c == 0 ? 0 : ends[c - 1];
    sizes += (c == 0 ? "" : ",") + std::to_string(ends[c] - begin);
    hashes += to_hex(chunk_hash(data.subspan(begin, ends[c] - begin)));
  }
  auto& metadata = header["__metadata__"];
  if (!metadata.is_object() && !metadata.is_null()) throw BadInputError(label + ": __metadata__ is not a JSON object");
  metadata[kChunkSizesKey] = std::move(sizes);
  metadata[kChunkSha256Key] = std::move(hashes);
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // padded as every writer here pads
  std::vector<uint8_t> out(8 + text.size() + data.size());
  for (int b = 0; b < 8; ++b) out[b] = static_cast<uint8_t>(uint64_t{text.size()} >> (8 * b));
  std::copy(text.begin(), text.end(), out.begin() + 8);
  std::copy(data.begin(), data.end(), out.begin() + 8 + static_cast<std::ptrdiff_t>(text.size()));
  return out;
}

protocol::ObjectRef put_sealed_object(Store& store, const std::string& key, std::span<const uint8_t> bytes) {
  const std::vector<uint8_t> sealed = seal(bytes, store.describe(key));
  protocol::ObjectRef ref = protocol::put_object(store, key, sealed);
  ref.header_sha256 = sha256_hex(std::span<const uint8_t>(sealed).first(header_prefix_bytes(sealed, sealed.size(), key)));
  return ref;
}

protocol::ObjectRef put_delta_object(Store& store, const std::string& key, std::span<const uint8_t> bytes, DeltaFormat format) {
  return format == DeltaFormat::Compact ? put_sealed_object(store, key, bytes) : protocol::put_object(store, key, bytes);
}

SealedHeader read_sealed_header(std::span<const uint8_t> prefix, const protocol::ObjectRef& ref, const std::string& label) {
  if (prefix.size() != header_prefix_bytes(prefix, ref.size, label)) throw BadInputError(label + ": header fetched incompletely");
  // Nothing of the header is read before it matches what the manifest recorded.
  if (sha256_hex(prefix) != ref.header_sha256) throw BadInputError(label + ": header sha256 differs from the manifest's (corrupt object)");
  const auto j = nlohmann::json::parse(prefix.begin() + 8, prefix.end(), nullptr, false);
  if (!j.is_object()) throw BadInputError(label + ": header is not a JSON object");
  SealedHeader h;
  h.object_size = ref.size;
  h.data_offset = prefix.size();
  for (const auto& [name, v] : j.items()) {
    if (name == "__metadata__") {
      if (!v.is_object()) throw BadInputError(label + ": __metadata__ is not a JSON object");
      for (const auto& [k, value] : v.items()) {
        if (!value.is_string()) throw BadInputError(label + ": metadata " + k + " is not a string");
        h.metadata[k] = value.get<std::string>();
      }
      continue;
    }
    const bool ok = v.is_object() && v.contains("dtype") && v["dtype"].is_string() && v.contains("shape") && v["shape"].is_array() &&
                    v.contains("data_offsets") && v["data_offsets"].is_array() && v["data_offsets"].size() == 2 &&
                    v["data_offsets"][0].is_number_unsigned() && v["data_offsets"][1].is_number_unsigned();
    if (!ok) throw BadInputError(label + ": tensor " + name + " has a malformed header entry");
    const auto dtype = dtype_from_name(v["dtype"].get<std::string>());
    if (!dtype) throw BadInputError(label + ": tensor " + name + " has an unknown dtype");
    st::TensorInfo t{name, *dtype, {}, v["data_offsets"][0].get<uint64_t>(), v["data_offsets"][1].get<uint64_t>()};
    for (const auto& d : v["shape"]) {
      if (!d.is_number_unsigned()) throw BadInputError(label + ": tensor " + name + " has a malformed shape");
      t.shape.push_back(d.get<uint64_t>());
    }
    if (t.begin > t.end || t.end > h.data_bytes()) throw BadInputError(label + ": tensor " + name + " lies outside the data section");
    h.tensors.push_back(std::move(t));
  }
  std::sort(h.tensors.begin(), h.tensors.end(), [](const auto& a, const auto& b) { return a.begin < b.begin; });
  h.by_name.resize(h.tensors.size());
  for (uint32_t i = 0; i < h.by_name.size(); ++i) h.by_name[i] = i;
  std::sort(h.by_name.begin(), h.by_name.end(), [&](uint32_t a, uint32_t b) { return h.tensors[a].name < h.tensors[b].name; });
  // The indexed layout carries its own hash chain (codec/compact_indexed.hpp): no chunks.
  if (compact::indexed::read_layout_version(h.metadata, label) == compact::kLayout2) return h;
  const auto sizes_it = h.metadata.find(kChunkSizesKey);
  const auto size_it = h.metadata.find(kChunkBytesKey);
  const auto hashes_it = h.metadata.find(kChunkSha256Key);
  if (hashes_it == h.metadata.end() || (sizes_it == h.metadata.end()) == (size_it == h.metadata.end()))
    throw BadInputError(label + ": header has no " + kChunkSha256Key + " with either " + kChunkSizesKey + " or " + kChunkBytesKey +
                        " (not sealed for ranged reads)");
  h.chunk_ends = sizes_it != h.metadata.end() ? chunk_ends_of_sizes(sizes_it->second, h.data_bytes(), label)
                                              : chunk_ends_of_size(size_it->second, h.data_bytes(), label);
  const uint64_t chunks = h.chunk_ends.size();
  const std::string& hex = hashes_it->second;
  if (hex.size() != chunks * kChunkHashBytes * 2)
    throw BadInputError(label + ": " + kChunkSha256Key + " holds " + std::to_string(hex.size() / (kChunkHashBytes * 2)) + " hashes for " +
                        std::to_string(chunks) + " chunks");
  h.chunk_sha256.reserve(chunks);
  try {
    for (uint64_t c = 0; c < chunks; ++c)
      h.chunk_sha256.push_back(hex_digest(std::string_view(hex).substr(c * kChunkHashBytes * 2, kChunkHashBytes * 2)));
  } catch (const BadInputError&) {
    throw BadInputError(label + ": " + kChunkSha256Key + " is not lowercase hex");
  }
  h.metadata.erase(kChunkSizesKey);
  h.metadata.erase(kChunkBytesKey);
  h.metadata.erase(kChunkSha256Key);
  return h;
}

void verify_chunks(const SealedHeader& header, uint64_t data_begin, std::span<const uint8_t> bytes, const std::string& label) {
  const uint64_t end = data_begin + bytes.size();
  const auto& ends = header.chunk_ends;
  // The chunk that starts at data_begin, and the one that ends at `end`.
  const auto first = std::lower_bound(ends.begin(), ends.end(), data_begin + 1);
  const bool whole = first != ends.end() && header.chunk_begin(static_cast<size_t>(first - ends.begin())) == data_begin &&
                     std::binary_search(ends.begin(), ends.end(), end);
  if (!whole || bytes.empty())
    throw BadInputError(label + ": data range [" + std::to_string(data_begin) + ", " + std::to_string(end) + ") is not whole chunks");
  for (auto c = static_cast<size_t>(first - ends.begin()); c < ends.size() && ends[c] <= end; ++c) {
    const uint64_t at = header.chunk_begin(c);
    if (chunk_hash(bytes.subspan(at - data_begin, ends[c] - at)) != header.chunk_sha256[c])
      throw BadInputError(label + ": data chunk " + std::to_string(c) + " sha256 differs from its header's (corrupt object)");
  }
}

}  // namespace deltasync::ranged
