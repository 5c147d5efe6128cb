#include <cstring>

#include "codec/compact_two_phase.hpp"
#include "core/error.hpp"

namespace deltasync::compact {
namespace {

template <uint32_t W>
void rebase_w(const uint8_t* unbased, const uint8_t* base, uint8_t* out, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    uint32_t u = 0, b = 0;
    std::memcpy(&u, unbased + i * W, W);
    std::memcpy(&b, base + i * W, W);
    const uint32_t bits = rebase_value(u, 0, b, W);
    std::memcpy(out + i * W, &bits, W);
  }
}

}  // namespace

std::vector<PatchRef> decode_compact_delta_unbased(const st::File& file, std::span<const TensorMeta> base_meta,
                                                   DecodedDelta& out, const Options& options) {
  // No base bits: the decoder decodes against zeros and reads nothing (compact::decode).
  std::vector<ConstTensorRef> base;
  base.reserve(base_meta.size());
  for (const TensorMeta& m : base_meta) base.push_back(ConstTensorRef{m.name, nullptr, m.numel(), m.width()});
  return decode_compact_delta(file, base_meta, base, out, options);
}

void rebase_values(std::span<const uint8_t> unbased, std::span<const uint8_t> base_bits, uint32_t width,
                   std::span<uint8_t> new_bits) {
  if (unbased.size() != base_bits.size() || unbased.size() != new_bits.size())
    throw BadInputError("compact: rebase_values: " + std::to_string(unbased.size()) + " unbased bytes, " +
                std::to_string(base_bits.size()) + " base bytes, " + std::to_string(new_bits.size()) + " output bytes");
  if ((width != 1 && width != 2 && width != 4) || unbased.size() % width != 0)
    throw BadInputError("compact: rebase_values: width " + std::to_string(width) + " does not fit " +
                std::to_string(unbased.size()) + " bytes");
  const size_t n = unbased.size() / width;
  switch (width) {
    case 1: rebase_w<1>(unbased.data(), base_bits.data(), new_bits.data(), n); break;
    case 2: rebase_w<2>(unbased.data(), base_bits.data(), new_bits.data(), n); break;
    default: rebase_w<4>(unbased.data(), base_bits.data(), new_bits.data(), n); break;
  }
}

}  // namespace deltasync::compact
