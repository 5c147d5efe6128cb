#include "baselines.hpp"

#include <zstd.h>

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <unordered_map>
#include <vector>

#include "codec/compact_codec.hpp"

namespace realistic {
namespace {

uint64_t zstd_size(std::span<const uint8_t> bytes, int level) {
  if (bytes.empty()) return 0;
  std::vector<uint8_t> out(ZSTD_compressBound(bytes.size()));
  const size_t n = ZSTD_compress(out.data(), out.size(), bytes.data(), bytes.size(), level);
  if (ZSTD_isError(n)) throw std::runtime_error(std::string("zstd: ") + ZSTD_getErrorName(n));
  return n;
}

template <typename T>
void append_le(std::vector<uint8_t>& out, T v) {
  const size_t at = out.size();
  out.resize(at + sizeof v);
  std::memcpy(out.data() + at, &v, sizeof v);
}

double entropy_bits(const std::unordered_map<uint64_t, uint64_t>& counts, uint64_t total) {
  double bits = 0;
  for (const auto& [symbol, c] : counts) bits -= static_cast<double>(c) * std::log2(static_cast<double>(c) / total);
  return bits;
}

}  // namespace

uint64_t interop_bytes(std::span<const deltasync::TensorMeta> tensors, const deltasync::DeltaView& delta) {
  uint64_t bytes = 0;
  for (size_t t = 0; t < tensors.size(); ++t) bytes += delta.count(t) * (4 + tensors[t].width());
  return bytes;
}

uint64_t interop_zstd_bytes(std::span<const deltasync::TensorMeta> tensors, const deltasync::DeltaView& delta,
                            int level) {
  uint64_t bytes = 0;
  std::vector<uint8_t> indices;
  for (size_t t = 0; t < tensors.size(); ++t) {
    if (delta.count(t) == 0) continue;
    indices.clear();
    for (uint64_t k = delta.offsets[t]; k < delta.offsets[t + 1]; ++k)
      append_le<int32_t>(indices, static_cast<int32_t>(delta.indices[k]));
    bytes += zstd_size(indices, level);
    bytes += zstd_size(delta.values.subspan(delta.value_offsets[t], delta.value_offsets[t + 1] - delta.value_offsets[t]),
                       level);
  }
  return bytes;
}

uint64_t pulse_bytes(std::span<const deltasync::TensorMeta> tensors, const deltasync::DeltaView& delta) {
  std::vector<uint8_t> stream;
  for (size_t t = 0; t < tensors.size(); ++t) {
    if (delta.count(t) == 0) continue;
    const uint64_t begin = delta.offsets[t], end = delta.offsets[t + 1];
    int64_t max_delta = 0, prev = 0;
    for (uint64_t k = begin; k < end; ++k) {
      max_delta = std::max(max_delta, delta.indices[k] - prev);
      prev = delta.indices[k];
    }
    prev = 0;
    for (uint64_t k = begin; k < end; ++k) {
      const uint64_t d = static_cast<uint64_t>(delta.indices[k] - prev);
      prev = delta.indices[k];
      if (max_delta <= 0xFF) {
        append_le<uint8_t>(stream, static_cast<uint8_t>(d));
      } else if (max_delta <= 0xFFFF) {
        append_le<uint16_t>(stream, static_cast<uint16_t>(d));
      } else {
        append_le<uint32_t>(stream, static_cast<uint32_t>(d));
      }
    }
    const auto values = delta.values.subspan(delta.value_offsets[t], delta.value_offsets[t + 1] - delta.value_offsets[t]);
    stream.insert(stream.end(), values.begin(), values.end());
  }
  return zstd_size(stream, 1);
}

EntropyBound order0_entropy(std::span<const deltasync::TensorMeta> tensors, const deltasync::DeltaView& delta) {
  std::unordered_map<uint64_t, uint64_t> gaps, values;
  for (size_t t = 0; t < tensors.size(); ++t) {
    const uint32_t w = tensors[t].width();
    int64_t prev = -1;
    for (uint64_t k = delta.offsets[t]; k < delta.offsets[t + 1]; ++k) {
      ++gaps[static_cast<uint64_t>(delta.indices[k] - prev - 1)];
      prev = delta.indices[k];
      uint32_t now = 0, before = 0;
      const uint64_t at = delta.value_offsets[t] + (k - delta.offsets[t]) * w;
      std::memcpy(&now, delta.values.data() + at, w);
      std::memcpy(&before, delta.base_values.data() + at, w);
      ++values[deltasync::compact::value_symbol(now, before, w)];
    }
  }
  const uint64_t n = delta.total_changed();
  if (n == 0) return {};
  return EntropyBound{entropy_bits(gaps, n) / 8.0, entropy_bits(values, n) / 8.0};
}

}  // namespace realistic
