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
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "codec/compact_block_index.hpp"
#include "codec/compact_format.hpp"
#include "codec/compact_symbols.hpp"
#include "codec/compact_table.hpp"
#include "format/delta_file.hpp"
#include "format/safetensors.hpp"
#include "core/sparse_delta.hpp"
#include "core/tensor.hpp"

namespace deltasync::compact {

// Encodes every tensor with at least one change (in `tensors` order). `delta` must come from an
// encode of `tensors` (same count, widths matching) and carry base_values. Throws Error.
std::vector<EncodedTensor> encode(std::span<const TensorMeta> tensors, const DeltaView& delta,
                                  const Options& options = {});

// Scratch of the decoder's stripe-by-stripe decode of tiled tensors (compact_codec.cpp): one
// buffer per stripe in flight, handed out and back under a lock. It lives with the decoded
// delta, so its memory is reused from delta to delta and freed with it (not held by worker
// threads for their lifetime): at most as many buffers as stripes decode at once, each as large
// as the largest stripe it served.
class StripeScratchPool {
 public:
  struct Buffer {
    std::vector<int64_t> positions;
    std::vector<uint8_t> values;
  };
  // A buffer holding at least `changes` positions and `value_bytes` bytes of values.
  std::unique_ptr<Buffer> take(size_t changes, size_t value_bytes);
  void give(std::unique_ptr<Buffer> buffer);

 private:
  std::mutex mutex_;
  std::vector<std::unique_ptr<Buffer>> free_;
};

// The result of a decode, laid out per BASE tensor (storage.offsets has base.size() + 1
// entries; unchanged tensors have count 0). storage.values are the new bits, storage.base_values
// the base bits gathered at the changed positions (empty after an unbased decode,
// compact_two_phase.hpp). `changed_names` lists the changed tensors in file order.
struct DecodedDelta {
  SparseDelta storage;
  std::vector<std::string> changed_names;
  DeltaInfo info;  // filled by decode_compact_delta (model_version, base_version, other keys in extra)
  std::shared_ptr<StripeScratchPool> stripe_scratch = std::make_shared<StripeScratchPool>();

  // patches[t] applies to base tensor t (count 0 where unchanged); valid while *this lives.
  std::vector<PatchRef> patches(std::span<const TensorMeta> base_meta) const;
};

// What every decoder (this one and its GPU twin) checks before any block is decoded: each
// encoded tensor names a base tensor (once) of a supported width, and its block index is valid
// (parse_block_index). `base` describes the base tensors (its data pointers are not read).
// Throws Error("LABEL: ...").
std::vector<ParsedBlockIndex> parse_encoded_tensors(std::span<const EncodedTensorView> encoded,
                                                    std::span<const TensorMeta> base_meta,
                                                    std::span<const ConstTensorRef> base, const std::string& label);
// The decoded delta's layout per base tensor: offsets and value offsets (T + 1 entries each).
void layout_offsets(std::span<const ParsedBlockIndex> parsed, std::span<const TensorMeta> base_meta,
                    std::vector<uint64_t>& offsets, std::vector<uint64_t>& value_offsets);

// Decodes encoded tensors against the base. base[t] holds base_meta[t]'s bits (host memory), or
// its data is nullptr: decoded against zeros (compact_two_phase.hpp's unbased decoding).
// Every position is validated (inside the tensor, strictly ascending) and every stream checked
// for truncation and trailing bytes; on any defect throws Error("LABEL: tensor NAME: reason")
// and leaves `out` in an unspecified state (the base is never written).
void decode(std::span<const EncodedTensorView> encoded, std::span<const TensorMeta> base_meta,
            std::span<const ConstTensorRef> base, const std::string& label, DecodedDelta& out,
            const Options& options = {});

// ---- safetensors container -------------------------------------------------------------------

// Metadata: sparse="True", format="compact", compact_version, compact_block_elements,
// compact_index_version (when 2: options that tile), model_version, base_version (when known), sparsity, changed_params, total_elements,
// total_changed_elements, tensor_shapes (same meaning as in the interoperable layout), plus
// info.extra verbatim.
std::vector<uint8_t> serialize_compact_delta(std::span<const TensorMeta> tensors, const DeltaView& delta,
                                             const DeltaInfo& info, const Options& options = {});
// Same bytes, written atomically (temp name + rename).
void write_compact_delta(const std::string& path, std::span<const TensorMeta> tensors, const DeltaView& delta,
                         const DeltaInfo& info, const Options& options = {});
// The same file from tensors already encoded with `options` (by this codec or its GPU twin, whose
// bytes are identical); `delta` is the change set they encode (for the metadata).
void write_compact_delta(const std::string& path, std::span<const TensorMeta> tensors, const DeltaView& delta,
                         const DeltaInfo& info, std::vector<EncodedTensor> encoded, const Options& options = {});

// serialize_compact_delta's bytes from tensors already encoded (see write_compact_delta above).
std::vector<uint8_t> serialize_compact_delta(std::span<const TensorMeta> tensors, const DeltaView& delta,
                                             const DeltaInfo& info, std::vector<EncodedTensor> encoded,
                                             const Options& options = {});

// True when the file's metadata says format="compact".
bool is_compact_delta(const st::File& file);

// The metadata's compact_index_version: 1 when absent, 1 or 2; anything else is refused
// (BadInputError "LABEL: unsupported compact_index_version 'X' ...").
inline constexpr std::string_view kIndexVersionKey = "compact_index_version";
uint32_t read_index_version(const st::Metadata& metadata, const std::string& label);

// A compact delta file read up to its blocks -- what every decoder (this one and its GPU twin)
// checks before decoding: format and compact_version, the delta's metadata, the encoded tensors
// (views into `file`: in layout 1 its NAME.cindex / NAME.cdata pairs in file order, their recorded
// dtypes and shapes equal to the base's; in the indexed layout its records in ordinal order, the
// file's tensor table equal to the base's, codec/compact_indexed.hpp). Throws Error("LABEL: ...").
struct CompactFile {
  DeltaInfo info;  // the indexed layout's digests typed (info.digests)
  std::vector<EncodedTensorView> tensors;
  std::shared_ptr<const TensorTable> table;  // the indexed layout's: the views' names point into it
};
CompactFile read_compact_file(const st::File& file, std::span<const TensorMeta> base_meta);
// After the blocks are decoded: the metadata's total_changed_elements (when recorded) must equal
// what they hold. Throws Error("LABEL: ...").
void check_total_changed(const st::File& file, uint64_t decoded_total);

// Reads a compact delta file and decodes it against the base (see decode()). Returns the
// patches for every base tensor, ready for cpu::apply(targets, patches); they point into `out`.
// Throws Error("LABEL: ...") for a file of another format or version, a tensor the base lacks,
// a dtype or shape that differs from the base, or any corrupt stream.
std::vector<PatchRef> decode_compact_delta(const st::File& file, std::span<const TensorMeta> base_meta,
                                           std::span<const ConstTensorRef> base, DecodedDelta& out,
                                           const Options& options = {});

}  // namespace deltasync::compact
