#include "codec/delta_io.hpp"

#include "core/error.hpp"

namespace deltasync {

DeltaFormat parse_delta_format(std::string_view name) {
  if (name == "trl") return DeltaFormat::Trl;
  if (name == "compact") return DeltaFormat::Compact;
  throw BadInputError("unknown delta format '" + std::string(name) + "' (choose trl or compact)");
}

std::string_view delta_format_name(DeltaFormat format) { return format == DeltaFormat::Trl ? "trl" : "compact"; }

std::vector<uint8_t> serialize_delta(DeltaFormat format, std::span<const TensorMeta> tensors, const DeltaView& delta,
                                     const DeltaInfo& info) {
  if (format == DeltaFormat::Compact) return compact::serialize_compact_delta(tensors, delta, info);
  return serialize_trl_delta(tensors, delta, info);
}

void write_delta(const std::string& path, DeltaFormat format, std::span<const TensorMeta> tensors,
                 const DeltaView& delta, const DeltaInfo& info) {
  if (format == DeltaFormat::Compact) return compact::write_compact_delta(path, tensors, delta, info);
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
  out.format = DeltaFormat::Trl;
  out.changed_names.clear();
  ParsedDelta parsed = parse_trl_delta(file);
  if (!parsed.sparse) throw BadInputError(file.label() + ": is an anchor (sparse=\"False\"), not a delta");
  out.patches = resolve_patches(parsed, base_meta, file.label());
  out.info = std::move(parsed.info);
  for (const auto& e : parsed.entries) out.changed_names.push_back(e.name);
}

}  // namespace deltasync
