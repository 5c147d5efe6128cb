// TRL's later delta layout, NAME.idx + NAME.val with a `raw` or `gap_delta` index encoding
// (delta_file.hpp documents it; docs/trl-formats.md says where each fact comes from).
#include <algorithm>
#include <limits>

#include "core/error.hpp"
#include "core/little_endian.hpp"
#include "format/delta_file.hpp"
#include "format/delta_file_internal.hpp"

namespace deltasync {
namespace {

using detail::fail;

constexpr std::string_view kIdxSuffix = ".idx";
constexpr std::string_view kValSuffix = ".val";
constexpr std::string_view kFormat = "sparse_weight_patch";
constexpr std::string_view kLayoutVersion = "1";
constexpr uint64_t kI32Max = static_cast<uint64_t>(std::numeric_limits<int32_t>::max());

// One tensor's encoded positions.
struct IndexArray {
  DType dtype = DType::I32;
  std::vector<uint8_t> bytes;
};

template <typename T>
std::vector<uint8_t> little_endian_bytes(std::span<const uint64_t> words) {
  std::vector<uint8_t> bytes(words.size() * sizeof(T));
  for (size_t i = 0; i < words.size(); ++i) detail::store_le<T>(bytes.data() + i * sizeof(T), static_cast<T>(words[i]));
  return bytes;
}

// The writer's input comes from an encode (ascending, inside the tensor), but a wrong position
// would turn into a huge or negative gap silently, so it is checked here.
void check_writer_positions(std::span<const int64_t> positions, const TensorMeta& meta, const std::string& path) {
  const auto numel = static_cast<int64_t>(meta.numel());
  int64_t previous = -1;
  for (const int64_t p : positions) {
    if (p < 0 || p >= numel) {
      fail(path, "tensor " + meta.name + ": changed position " + std::to_string(p) + " is outside its " +
                     std::to_string(numel) + " elements");
    }
    if (p <= previous) {
      fail(path, "tensor " + meta.name + ": changed positions are not strictly ascending (" + std::to_string(p) +
                     " after " + std::to_string(previous) + ")");
    }
    previous = p;
  }
}

IndexArray encode_raw(std::span<const int64_t> positions, const TensorMeta& meta) {
  std::vector<uint64_t> words(positions.begin(), positions.end());
  // TRL writes int32 only; a tensor too large for it gets I64 (TRL's reader widens any dtype).
  if (meta.numel() > kI32Max) return {DType::I64, little_endian_bytes<uint64_t>(words)};
  return {DType::I32, little_endian_bytes<uint32_t>(words)};
}

IndexArray encode_gaps(std::span<const int64_t> positions, const TensorMeta& meta, const std::string& path) {
  std::vector<uint64_t> gaps(positions.size());
  int64_t previous = -1;
  uint64_t widest = 0;
  for (size_t k = 0; k < positions.size(); ++k) {
    gaps[k] = static_cast<uint64_t>(positions[k] - previous - 1);
    widest = std::max(widest, gaps[k]);
    previous = positions[k];
  }
  if (widest <= std::numeric_limits<uint16_t>::max()) return {DType::U16, little_endian_bytes<uint16_t>(gaps)};
  if (widest <= std::numeric_limits<uint32_t>::max()) return {DType::U32, little_endian_bytes<uint32_t>(gaps)};
  fail(path, "tensor " + meta.name + ": a gap of " + std::to_string(widest) +
                 " positions does not fit gap_delta's uint32; write it with the raw encoding (trl-idx-raw) or compact");
}

std::pair<std::vector<st::WriteTensor>, st::Metadata> trl_idx_layout(const std::string& path,
                                                                      std::span<const TensorMeta> tensors,
                                                                      const DeltaView& delta, const DeltaInfo& info,
                                                                      IndexEncoding encoding,
                                                                      std::vector<IndexArray>& storage) {
  detail::check_delta_for_write(path, tensors, delta);
  std::vector<detail::PendingTensor> pending;
  storage.reserve(tensors.size());  // no reallocation: tensors point into its elements
  uint64_t changed_tensors = 0;
  for (size_t t = 0; t < tensors.size(); ++t) {
    const TensorMeta& meta = tensors[t];
    const uint64_t count = delta.count(t);
    if (count == 0) continue;
    const auto positions = delta.indices.subspan(delta.offsets[t], count);
    check_writer_positions(positions, meta, path);
    storage.push_back(encoding == IndexEncoding::Raw ? encode_raw(positions, meta) : encode_gaps(positions, meta, path));
    const IndexArray& idx = storage.back();
    pending.push_back({{meta.name + std::string(kIdxSuffix), idx.dtype, {count}, idx.bytes}, dtype_width(idx.dtype)});
    pending.push_back({{meta.name + std::string(kValSuffix), meta.dtype, {count},
                        delta.values.subspan(delta.value_offsets[t], count * meta.width())},
                       meta.width()});
    ++changed_tensors;
  }
  st::Metadata md = delta_metadata(path, tensors, delta, info, kFormat);
  md["version"] = std::string(kLayoutVersion);
  md["num_changed_params"] = std::to_string(changed_tensors);
  md["encoding"] = std::string(index_encoding_name(encoding));
  return {detail::widest_first(std::move(pending)), std::move(md)};
}

IndexEncoding parse_encoding(const st::Metadata& md, const std::string& label) {
  const auto it = md.find("encoding");
  // TRL's reader takes a missing key as its default, gap_delta; the index dtypes still have to agree.
  if (it == md.end() || it->second == "gap_delta") return IndexEncoding::GapDelta;
  if (it->second == "raw") return IndexEncoding::Raw;
  if (it->second == "nvcomp_cascaded") {
    fail(label, "metadata encoding \"nvcomp_cascaded\" (nvCOMP's GPU bitstream) is not supported; "
                "write the delta with encoding raw or gap_delta");
  }
  fail(label, "metadata encoding \"" + it->second + "\" is unknown; expected \"raw\" or \"gap_delta\"");
}

void check_index_dtype(const std::string& label, const st::TensorInfo& idx, IndexEncoding encoding) {
  const bool ok = encoding == IndexEncoding::Raw ? (idx.dtype == DType::I32 || idx.dtype == DType::I64)
                                                 : (idx.dtype == DType::U16 || idx.dtype == DType::U32);
  if (ok) return;
  fail(label, "tensor " + idx.name + " has dtype " + std::string(dtype_name(idx.dtype)) + "; encoding " +
                  std::string(index_encoding_name(encoding)) +
                  (encoding == IndexEncoding::Raw ? " stores I32 (or I64) positions" : " stores U16 or U32 gaps"));
}

// Positions from gaps: p[k] = p[k-1] + g[k] + 1 from p[-1] = -1. A sum that leaves int64 can only
// come from a corrupt file; positions past the tensor are caught by check_patch_positions.
template <typename Gap>
void decode_gaps(const std::string& label, const st::TensorInfo& idx, std::span<const uint8_t> bytes, int64_t* out) {
  const uint64_t count = idx.shape[0];
  int64_t position = -1;
  constexpr int64_t kLimit = std::numeric_limits<int64_t>::max() - std::numeric_limits<uint32_t>::max() - 1;
  for (uint64_t k = 0; k < count; ++k) {
    position += static_cast<int64_t>(detail::load_le<Gap>(bytes.data() + k * sizeof(Gap))) + 1;
    if (position > kLimit) fail(label, "tensor " + idx.name + ": gaps add up past 2^63 at entry " + std::to_string(k));
    out[k] = position;
  }
}

}  // namespace

std::string_view index_encoding_name(IndexEncoding encoding) {
  return encoding == IndexEncoding::Raw ? "raw" : "gap_delta";
}

bool is_trl_idx_file(const st::File& file) {
  const auto format = file.metadata().find("format");
  return format != file.metadata().end() && format->second == kFormat;
}

void write_trl_idx_delta(const std::string& path, std::span<const TensorMeta> tensors, const DeltaView& delta,
                         const DeltaInfo& info, IndexEncoding encoding) {
  std::vector<IndexArray> storage;
  const auto [layout, md] = trl_idx_layout(path, tensors, delta, info, encoding, storage);
  st::write_file(path, layout, md);
}

std::vector<uint8_t> serialize_trl_idx_delta(std::span<const TensorMeta> tensors, const DeltaView& delta,
                                             const DeltaInfo& info, IndexEncoding encoding) {
  std::vector<IndexArray> storage;
  const auto [layout, md] = trl_idx_layout("delta", tensors, delta, info, encoding, storage);
  return st::serialize(layout, md);
}

void parse_trl_idx_delta(const st::File& file, ParsedTrlIdxDelta& out) {
  const std::string& label = file.label();
  const st::Metadata& md = file.metadata();
  detail::SparseMetadata sparse_md;
  detail::parse_sparse_metadata(file, kFormat, kFormat, sparse_md);
  if (const auto version = md.find("version"); version != md.end() && version->second != kLayoutVersion) {
    fail(label, "metadata version \"" + version->second + "\" of the sparse_weight_patch layout is not supported (known: " +
                    std::string(kLayoutVersion) + ")");
  }
  std::optional<uint64_t> declared_tensors;
  if (md.contains("num_changed_params")) declared_tensors = detail::metadata_u64(md, "num_changed_params", label);
  out.delta = ParsedDelta{};
  out.delta.sparse = sparse_md.sparse;
  out.delta.info = sparse_md.info;
  out.positions.clear();
  if (!out.delta.sparse) return;  // an anchor: the encoding does not apply
  out.encoding = parse_encoding(md, label);

  const std::vector<detail::TensorPair> pairs = detail::pair_tensors(file, kIdxSuffix, kValSuffix);
  uint64_t total_changed = 0;
  for (const detail::TensorPair& pair : pairs) {
    check_index_dtype(label, *pair.indices, out.encoding);
    total_changed += detail::check_pair_shapes(label, pair, sparse_md);
  }
  if (declared_tensors && *declared_tensors != pairs.size()) {
    fail(label, "metadata num_changed_params is " + std::to_string(*declared_tensors) + " but the file holds " +
                    std::to_string(pairs.size()) + " changed tensors");
  }
  detail::check_declared_totals(label, sparse_md, pairs, total_changed);

  if (out.encoding == IndexEncoding::GapDelta) out.positions.resize(total_changed);
  uint64_t decoded = 0;
  for (const detail::TensorPair& pair : pairs) {
    const st::TensorInfo& idx = *pair.indices;
    const st::TensorInfo& val = *pair.values;
    const uint64_t count = idx.shape[0];
    PatchRef patch{count, file.bytes(idx).data(), dtype_width(idx.dtype), file.bytes(val).data(), dtype_width(val.dtype)};
    if (out.encoding == IndexEncoding::GapDelta) {
      int64_t* positions = out.positions.data() + decoded;
      if (idx.dtype == DType::U16) {
        decode_gaps<uint16_t>(label, idx, file.bytes(idx), positions);
      } else {
        decode_gaps<uint32_t>(label, idx, file.bytes(idx), positions);
      }
      patch.indices = positions;
      patch.index_width = 8;
      decoded += count;
    }
    out.delta.entries.push_back(DeltaEntry{pair.name, val.dtype, patch});
  }
}

void check_patch_positions(std::span<const PatchRef> patches, std::span<const TensorMeta> base,
                           const std::string& label) {
  if (patches.size() != base.size()) {
    fail(label, std::to_string(patches.size()) + " patches for " + std::to_string(base.size()) + " tensors");
  }
  for (size_t t = 0; t < patches.size(); ++t) {
    const PatchRef& p = patches[t];
    const auto* bytes = static_cast<const uint8_t*>(p.indices);
    const uint64_t numel = base[t].numel();
    int64_t previous = -1;
    for (uint64_t k = 0; k < p.count; ++k) {
      const int64_t position = p.index_width == 4
                                   ? static_cast<int32_t>(detail::load_le<uint32_t>(bytes + 4 * k))
                                   : static_cast<int64_t>(detail::load_le<uint64_t>(bytes + 8 * k));
      if (position < 0 || static_cast<uint64_t>(position) >= numel) {
        fail(label, "tensor " + base[t].name + ": position " + std::to_string(position) + " (entry " +
                        std::to_string(k) + ") is outside its " + std::to_string(numel) + " elements");
      }
      if (position <= previous) {
        fail(label, "tensor " + base[t].name + ": positions are not strictly ascending at entry " + std::to_string(k) +
                        " (" + std::to_string(position) + " after " + std::to_string(previous) + ")");
      }
      previous = position;
    }
  }
}

}  // namespace deltasync
