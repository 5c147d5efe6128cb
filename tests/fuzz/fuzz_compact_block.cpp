// Fuzzes the compact codec's block decoder on its own, below the safetensors container: one
// encoded tensor (NAME.cindex and NAME.cdata bytes) decoded against a fixed base tensor, through
// compact::decode (parse_encoded_tensors, parse_block_index, then decode_block per block).
// Input: byte 0 picks the base tensor (low 6 bits), the compact_version (top bit set: 2, else 1)
// and the block index version (bit 6 set: 2, with tiles, else 1), bytes 1-4 the index length
// (little-endian, cut to what is there), then the index, then the payload.
// An accepted input must decode to what the codec promises: positions strictly ascending inside
// the tensor, and base bits equal to the base's at those positions.
#include <algorithm>
#include <cstring>

#include "codec/compact_codec.hpp"
#include "core/error.hpp"
#include "fuzz_model.hpp"

using namespace deltasync;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const HostModel* base = new HostModel(fuzz::base_model());
  if (size < 5) return 0;
  const size_t t = (data[0] & 0x3F) % base->tensors.size();
  const uint32_t version = (data[0] & 0x80) ? compact::kFormatVersion2 : compact::kFormatVersion1;
  const uint32_t index_version = (data[0] & 0x40) ? compact::kIndexVersion2 : compact::kIndexVersion1;
  uint32_t index_len = 0;
  std::memcpy(&index_len, data + 1, 4);
  const size_t rest = size - 5;
  const size_t n = std::min<size_t>(index_len, rest);
  // Copies of exactly the input's length, so ASan sees any read past either stream.
  const std::vector<uint8_t> index(data + 5, data + 5 + n);
  const std::vector<uint8_t> payload(data + 5 + n, data + size);
  const compact::EncodedTensorView view{base->tensors[t].name, index, payload, version, index_version};
  const std::vector<ConstTensorRef> refs = base->const_refs();
  compact::DecodedDelta out;
  try {
    compact::decode({&view, 1}, base->tensors, refs, "fuzz block", out);
  } catch (const Error& e) {
    fuzz::note("refused", e.what());
    return 0;
  }
  const uint32_t w = base->tensors[t].width();
  const uint64_t numel = base->tensors[t].numel();
  const auto& s = out.storage;
  if (s.offsets.size() != base->tensors.size() + 1) fuzz::fail("decoded offsets do not cover the base tensors");
  for (size_t u = 0; u < base->tensors.size(); ++u)
    if (u != t && s.offsets[u + 1] != s.offsets[u]) fuzz::fail("changes decoded into a tensor the input did not name");
  for (uint64_t k = s.offsets[t]; k < s.offsets[t + 1]; ++k) {
    const int64_t p = s.indices[k];
    if (p < 0 || static_cast<uint64_t>(p) >= numel) fuzz::fail("decoded position outside the tensor");
    if (k > s.offsets[t] && p <= s.indices[k - 1]) fuzz::fail("decoded positions not strictly ascending");
    const uint64_t j = s.value_offsets[t] + (k - s.offsets[t]) * w;
    if (std::memcmp(s.base_values.data() + j, base->data[t].data() + uint64_t(p) * w, w) != 0)
      fuzz::fail("decoded base bits differ from the base");
  }
  fuzz::note("accepted");
  return 0;
}
