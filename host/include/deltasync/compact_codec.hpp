// The compact delta format: the same changes as the interoperable layout, entropy-coded close to
// the information they carry (docs/compact-format.md is the byte-level specification).
//
// Per changed tensor NAME the file holds two U8 tensors:
//   NAME.cindex  a 24-byte header and one 32-byte record per block (little-endian)
//   NAME.cdata   the blocks' payloads, back to back
// A block covers up to `block_elements` consecutive changes of one tensor. Positions are coded
// as gaps (position - previous - 1) after the block's first position; values as the zigzagged
// difference of *ordered* bit patterns between the new and the base bits, so ±1 ulp costs about
// one bit even across sign and exponent boundaries. Both are split into a token (coded with a
// static-table rANS coder, one table per block and stream kind) and raw low bits. Blocks are
// independent, so encode and decode run one block per task (a GPU twin can run one per thread).
//
// Because values are relative to the base, decoding needs the base tensors' bits: the decoder
// gathers them at the decoded positions and returns ready-to-apply patches, plus the base bits
// (DeltaView::base_values layout) that digest updates need.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "deltasync/delta_file.hpp"
#include "deltasync/safetensors.hpp"
#include "deltasync/sparse_delta.hpp"
#include "deltasync/tensor.hpp"

namespace deltasync::compact {

// Written as metadata "compact_version"; readers refuse other values.
inline constexpr uint32_t kFormatVersion = 1;
// Changes per block: large enough that the per-block tables cost < 1%, small enough that a
// 1%-dense 1B-element model gives thousands of blocks to spread over cores (or GPU threads).
inline constexpr uint32_t kDefaultBlockElements = 16384;

inline constexpr std::string_view kIndexSuffix = ".cindex";
inline constexpr std::string_view kDataSuffix = ".cdata";

// The value symbol of one change: the difference new - base of the elements' ORDERED bit
// patterns (an integer order in which floats sort numerically: sign set -> ~bits, else
// bits | sign), modulo 2^(8*width), zigzagged so that +1 -> 2, -1 -> 1. A ±1-ulp step is
// therefore 1 or 2 whatever the sign or exponent. Exposed for tests and entropy measurements.
inline uint32_t width_mask(uint32_t width) { return width >= 4 ? 0xFFFFFFFFu : (1u << (8 * width)) - 1u; }
// Written without conditionals: the sign of a changed weight is a coin flip, and compilers turn
// `sign ? a : b` into a branch that mispredicts on half of all changes.
inline uint32_t to_ordered(uint32_t bits, uint32_t width) {
  const uint32_t sign = 1u << (8 * width - 1);
  const uint32_t negative = 0u - ((bits >> (8 * width - 1)) & 1u);  // all ones iff the sign bit is set
  return bits ^ ((negative & width_mask(width)) | sign);  // negative: ~bits & mask; else bits | sign
}
inline uint32_t from_ordered(uint32_t ordered, uint32_t width) {
  const uint32_t sign = 1u << (8 * width - 1);
  const uint32_t was_negative = ((ordered >> (8 * width - 1)) & 1u) - 1u;  // all ones iff the top bit is clear
  return ordered ^ ((was_negative & width_mask(width)) | sign);
}
inline uint32_t value_symbol(uint32_t new_bits, uint32_t base_bits, uint32_t width) {
  const uint32_t mask = width_mask(width);
  const uint32_t diff = (to_ordered(new_bits, width) - to_ordered(base_bits, width)) & mask;
  const uint32_t negative = 0u - ((diff >> (8 * width - 1)) & 1u);
  return ((diff << 1) ^ negative) & mask;
}
inline uint32_t apply_value_symbol(uint32_t symbol, uint32_t base_bits, uint32_t width) {
  const uint32_t mask = width_mask(width);
  const uint32_t diff = ((symbol >> 1) ^ (0u - (symbol & 1u))) & mask;
  return from_ordered((to_ordered(base_bits, width) + diff) & mask, width);
}

struct Options {
  uint32_t block_elements = kDefaultBlockElements;  // 1 .. 2^24
  bool parallel = true;  // false: run on the calling thread only (per-core measurements)
};

// One changed tensor, encoded.
struct EncodedTensor {
  std::string name;                  // the model tensor's name
  uint64_t changed = 0;              // number of changed elements
  std::vector<uint8_t> block_index;  // content of NAME.cindex
  std::vector<uint8_t> payload;      // content of NAME.cdata
};

// A borrowed view of an encoded tensor (e.g. pointing into a mapped file).
struct EncodedTensorView {
  std::string_view name;
  std::span<const uint8_t> block_index;
  std::span<const uint8_t> payload;
};

// Encodes every tensor with at least one change (in `tensors` order). `delta` must come from an
// encode of `tensors` (same count, widths matching) and carry base_values. Throws Error.
std::vector<EncodedTensor> encode(std::span<const TensorMeta> tensors, const DeltaView& delta,
                                  const Options& options = {});

// The result of a decode, laid out per BASE tensor (storage.offsets has base.size() + 1
// entries; unchanged tensors have count 0). storage.values are the new bits, storage.base_values
// the base bits gathered at the changed positions. `changed_names` lists the changed tensors in
// file order.
struct DecodedDelta {
  SparseDelta storage;
  std::vector<std::string> changed_names;
  DeltaInfo info;  // filled by decode_compact_delta (model_version, base_version, other keys in extra)

  // patches[t] applies to base tensor t (count 0 where unchanged); valid while *this lives.
  std::vector<PatchRef> patches(std::span<const TensorMeta> base_meta) const;
};

// Decodes encoded tensors against the base. base[t] holds base_meta[t]'s bits (host memory).
// Every position is validated (inside the tensor, strictly ascending) and every stream checked
// for truncation and trailing bytes; on any defect throws Error("LABEL: tensor NAME: reason")
// and leaves `out` in an unspecified state (the base is never written).
void decode(std::span<const EncodedTensorView> encoded, std::span<const TensorMeta> base_meta,
            std::span<const ConstTensorRef> base, const std::string& label, DecodedDelta& out,
            const Options& options = {});

// ---- safetensors container -------------------------------------------------------------------

// Metadata: sparse="True", format="compact", compact_version, compact_block_elements,
// model_version, base_version (when known), sparsity, changed_params, total_elements,
// total_changed_elements, tensor_shapes (same meaning as in the interoperable layout), plus
// info.extra verbatim.
std::vector<uint8_t> serialize_compact_delta(std::span<const TensorMeta> tensors, const DeltaView& delta,
                                             const DeltaInfo& info, const Options& options = {});
// Same bytes, written atomically (temp name + rename).
void write_compact_delta(const std::string& path, std::span<const TensorMeta> tensors, const DeltaView& delta,
                         const DeltaInfo& info, const Options& options = {});

// True when the file's metadata says format="compact".
bool is_compact_delta(const st::File& file);

// Reads a compact delta file and decodes it against the base (see decode()). Returns the
// patches for every base tensor, ready for cpu::apply(targets, patches); they point into `out`.
// Throws Error("LABEL: ...") for a file of another format or version, a tensor the base lacks,
// a dtype or shape that differs from the base, or any corrupt stream.
std::vector<PatchRef> decode_compact_delta(const st::File& file, std::span<const TensorMeta> base_meta,
                                           std::span<const ConstTensorRef> base, DecodedDelta& out,
                                           const Options& options = {});

}  // namespace deltasync::compact
