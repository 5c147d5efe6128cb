// One entry point for writing and reading deltas whatever their layout: the interoperable TRL
// layouts (NAME.indices + NAME.values, or TRL's later NAME.idx + NAME.val) or the compact codec. Readers tell the two apart by the file's
// `format` metadata, so callers never need to know which one a producer chose.
#pragma once
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "codec/compact_codec.hpp"
#include "format/delta_file.hpp"
#include "format/safetensors.hpp"

namespace deltasync {

// Trl: NAME.indices/NAME.values (TRL's blog layout). TrlIdx / TrlIdxRaw: TRL's later
// NAME.idx/NAME.val layout with gap_delta (TRL's default) or raw index encoding.
enum class DeltaFormat { Trl, Compact, TrlIdx, TrlIdxRaw };

// "trl", "trl-idx", "trl-idx-raw" or "compact"; throws Error for anything else.
DeltaFormat parse_delta_format(std::string_view name);
std::string_view delta_format_name(DeltaFormat format);

// Serializes `delta` (from an encode of `tensors`) in the given layout (`compact_options` for
// the compact one: its block size).
std::vector<uint8_t> serialize_delta(DeltaFormat format, std::span<const TensorMeta> tensors, const DeltaView& delta,
                                     const DeltaInfo& info, const compact::Options& compact_options = {});
// Same, written atomically to `path`.
void write_delta(const std::string& path, DeltaFormat format, std::span<const TensorMeta> tensors,
                 const DeltaView& delta, const DeltaInfo& info);

// A delta file matched against a base model: patches[t] changes base tensor t (count 0 where
// unchanged). Patches point into `file` (TRL), into `decoded` (compact) or into
// `decoded_positions` (gap_delta), so the file and this object must outlive them.
struct ResolvedDelta {
  DeltaFormat format = DeltaFormat::Trl;
  DeltaInfo info;
  std::vector<std::string> changed_names;
  std::vector<PatchRef> patches;
  compact::DecodedDelta decoded;  // storage for compact deltas
  std::vector<int64_t> decoded_positions;  // storage for gap_delta positions
  uint64_t total_changed() const;
};

// Reads any delta and resolves it against the base (names, dtypes, shapes). `base` holds the
// base tensors' current bits: the compact layout stores values relative to them. Throws
// Error("LABEL: reason") for an anchor, a corrupt file or a delta made for another model.
void resolve_delta(const st::File& file, std::span<const TensorMeta> base_meta, std::span<const ConstTensorRef> base,
                   ResolvedDelta& out);
// The interoperable (TRL layouts) branch of resolve_delta alone: needs no base bits, and the patches
// point into `file` (host memory), ready to be uploaded by an engine whose weights live elsewhere.
void resolve_trl_delta(const st::File& file, std::span<const TensorMeta> base_meta, ResolvedDelta& out);
// Any delta resolved without the base's bits, for a reader whose weights are not in memory as a
// whole: the TRL layouts as resolve_trl_delta, the compact layout decoded "unbased"
// (compact_two_phase.hpp; returns true: the values are to be rebased on the base bits at their
// positions).
bool resolve_delta_unbased(const st::File& file, std::span<const TensorMeta> base_meta, ResolvedDelta& out);

}  // namespace deltasync
