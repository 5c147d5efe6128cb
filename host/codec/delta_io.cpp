#include "codec/delta_io.hpp"

#include <utility>

#include "codec/compact_two_phase.hpp"
#include "core/error.hpp"

namespace deltasync {

namespace {

constexpr std::pair<std::string_view, DeltaFormat> kFormatNames[] = {
    {"trl", DeltaFormat::Trl},
    {"compact", DeltaFormat::Compact},
    {"trl-idx", DeltaFormat::TrlIdx},
    {"trl-idx-raw", DeltaFormat::TrlIdxRaw},
};

IndexEncoding trl_idx_encoding(DeltaFormat format) {
  return format == DeltaFormat::TrlIdxRaw ? IndexEncoding::Raw : IndexEncoding::GapDelta;
}

bool is_trl_idx(DeltaFormat format) { return format == DeltaFormat::TrlIdx || format == DeltaFormat::TrlIdxRaw; }

}  // namespace

DeltaFormat parse_delta_format(std::string_view name) {
  for (const auto& [known, format] : kFormatNames)
    if (name == known) return format;
  throw BadInputError("unknown delta format '" + std::string(name) + "' (choose compact, trl, trl-idx or trl-idx-raw)");
}

std::string_view delta_format_name(DeltaFormat format) {
  for (const auto& [name, known] : kFormatNames)
    if (format == known) return name;
  throw Error("unknown delta format value");
}

std::vector<uint8_t> serialize_delta(DeltaFormat format, std::span<const TensorMeta> tensors, const DeltaView& delta,
                                     const DeltaInfo& info, const compact::Options& compact_options) {
  if (format == DeltaFormat::Compact) return compact::serialize_compact_delta(tensors, delta, info, compact_options);
  if (is_trl_idx(format)) return serialize_trl_idx_delta(tensors, delta, info, trl_idx_encoding(format));
  return serialize_trl_delta(tensors, delta, info);
}

void write_delta(const std::string& path, DeltaFormat format, std::span<const TensorMeta> tensors,
                 const DeltaView& delta, const DeltaInfo& info) {
  if (format == DeltaFormat::Compact) return compact::write_compact_delta(path, tensors, delta, info);
  if (is_trl_idx(format)) return write_trl_idx_delta(path, tensors, delta, info, trl_idx_encoding(format));
  write_trl_delta(path, tensors, delta, info);
}

uint64_t ResolvedDelta::total_changed() const {
  uint64_t n = 0;
  for (const auto& p : patches) n += p.count;
  return n;
}

void resolve_delta(const st::File& file, std::span<const TensorMeta> base_meta, std::span<const ConstTensorRef> base,
                   ResolvedDelta& out) {
  out.changed_names.clear();
  if (compact::is_compact_delta(file)) {
    out.format = DeltaFormat::Compact;
    out.patches = compact::decode_compact_delta(file, base_meta, base, out.decoded);
    out.info = out.decoded.info;
    out.changed_names = out.decoded.changed_names;
    return;
  }
  resolve_trl_delta(file, base_meta, out);
}

void resolve_trl_delta(const st::File& file, std::span<const TensorMeta> base_meta, ResolvedDelta& out) {
  out.changed_names.clear();
  if (is_trl_idx_file(file)) {
    ParsedTrlIdxDelta parsed;
    parse_trl_idx_delta(file, parsed);
    if (!parsed.delta.sparse) throw BadInputError(file.label() + ": is an anchor (sparse=\"False\"), not a delta");
    out.format = parsed.encoding == IndexEncoding::Raw ? DeltaFormat::TrlIdxRaw : DeltaFormat::TrlIdx;
    out.patches = resolve_patches(parsed.delta, base_meta, file.label());
    // Decoded or foreign positions: a bad file is named here, before any weight is written.
    check_patch_positions(out.patches, base_meta, file.label());
    out.info = std::move(parsed.delta.info);
    out.decoded_positions = std::move(parsed.positions);  // the patches point into its buffer
    for (const auto& e : parsed.delta.entries) out.changed_names.push_back(e.name);
    return;
  }
  out.format = DeltaFormat::Trl;
  ParsedDelta parsed = parse_trl_delta(file);
  if (!parsed.sparse) throw BadInputError(file.label() + ": is an anchor (sparse=\"False\"), not a delta");
  out.patches = resolve_patches(parsed, base_meta, file.label());
  out.info = std::move(parsed.info);
  for (const auto& e : parsed.entries) out.changed_names.push_back(e.name);
}

bool resolve_delta_unbased(const st::File& file, std::span<const TensorMeta> base_meta, ResolvedDelta& out) {
  if (!compact::is_compact_delta(file)) {
    resolve_trl_delta(file, base_meta, out);
    return false;
  }
  out.format = DeltaFormat::Compact;
  out.patches = compact::decode_compact_delta_unbased(file, base_meta, out.decoded);
  out.info = out.decoded.info;
  out.changed_names = out.decoded.changed_names;
  return true;
}

}  // namespace deltasync
