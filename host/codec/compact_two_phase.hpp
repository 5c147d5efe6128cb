// Two-phase decoding of compact deltas, for receivers whose base bits are not in host memory
// (a GPU-resident model, a tensor-parallel shard). compact_codec.hpp's decoder reads the base
// bits while it decodes, because values are coded relative to them; here that is split:
//   1. decode_compact_delta_unbased(): positions and values decoded against an all-zero base
//      ("unbased" bits) -- no base needed, memory O(changed);
//   2. the caller gathers the base bits at the decoded positions (e.g. with a device gather),
//   3. rebase_values(): new bits from the unbased bits and the base bits, O(changed).
// The result is bit-identical to decode_compact_delta() with the real base (the value symbol is
// a difference of ordered bit patterns; decoding it over base 0 keeps the difference intact).
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "codec/compact_codec.hpp"

namespace deltasync::compact {

// Like decode_compact_delta() with every base tensor all zeros. out.storage.values hold the
// unbased bits; out.storage.base_values is empty (there are none). Same validation and errors (except that nothing
// about the base's contents is known).
std::vector<PatchRef> decode_compact_delta_unbased(const st::File& file, std::span<const TensorMeta> base_meta,
                                                   DecodedDelta& out, const Options& options = {});

// new_bits[i] = the element whose ordered pattern is ordered(base_bits[i]) plus the difference
// coded in unbased[i] (elements of `width` bytes, little-endian; all three spans the same size;
// new_bits may alias unbased). Throws Error when sizes disagree or width is not 1, 2 or 4.
void rebase_values(std::span<const uint8_t> unbased, std::span<const uint8_t> base_bits, uint32_t width,
                   std::span<uint8_t> new_bits);

}  // namespace deltasync::compact
