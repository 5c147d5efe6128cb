#include "codec/compact_tile_order.hpp"

#include <algorithm>
#include <array>
#include <cstring>

namespace deltasync::compact {
namespace {

uint32_t load_bits(const uint8_t* p, uint32_t width) {
  uint32_t v = 0;
  std::memcpy(&v, p, width);
  return v;
}

}  // namespace

CodedOrder to_coded_order(const TileGeometry& g, std::span<const int64_t> positions, std::span<const uint8_t> new_bits,
                          std::span<const uint8_t> base_bits, uint32_t width) {
  CodedOrder out;
  const size_t n = positions.size();
  std::span<const int64_t> coded = positions;
  if (g.bands > 1) {
    // A stable partition by band: inside a band, flat order is coded order.
    const uint64_t w = g.band_width();
    std::array<uint64_t, 9> start{};
    for (const int64_t p : positions) ++start[1 + static_cast<uint64_t>(p) % g.cols / w];
    for (uint32_t k = 0; k < g.bands; ++k) start[k + 1] += start[k];
    out.positions.resize(n);
    out.new_bits.resize(n * width);
    out.base_bits.resize(n * width);
    for (size_t i = 0; i < n; ++i) {
      const auto p = static_cast<uint64_t>(positions[i]);
      const uint64_t at = start[p % g.cols / w]++;
      out.positions[at] = static_cast<int64_t>(g.coded(p));
      std::memcpy(out.new_bits.data() + at * width, new_bits.data() + i * width, width);
      std::memcpy(out.base_bits.data() + at * width, base_bits.data() + i * width, width);
    }
    coded = out.positions;
  }
  out.tile_starts.resize(g.tiles() + 1);
  for (uint32_t t = 0; t < g.tiles(); ++t)
    out.tile_starts[t] = static_cast<uint64_t>(
        std::lower_bound(coded.begin(), coded.end(), static_cast<int64_t>(g.tile_begin(t))) - coded.begin());
  out.tile_starts[g.tiles()] = n;
  return out;
}

void to_flat_order(const TileGeometry& g, std::span<int64_t> positions, std::span<uint8_t> new_bits,
                   std::span<uint8_t> base_bits, const uint8_t* base, uint32_t width) {
  if (g.bands == 1) return;
  const size_t n = positions.size();
  // Band k's changes are the run [at[k], end[k]) of the coded order, row-major: the flat order
  // takes, row after row, each band's changes of that row in band order.
  const auto band_start = [&](uint64_t k) {
    return static_cast<size_t>(std::lower_bound(positions.begin(), positions.end(), static_cast<int64_t>(k * g.band_elements())) -
                               positions.begin());
  };
  std::array<size_t, 8> at{}, end{};
  for (uint32_t k = 0; k < g.bands; ++k) {
    at[k] = band_start(k);
    end[k] = k + 1 < g.bands ? band_start(k + 1) : n;
  }
  const uint64_t w = g.band_width();
  const auto row = [&](size_t i) { return static_cast<uint64_t>(positions[i]) % g.band_elements() / w; };
  std::vector<int64_t> flat(n);
  std::vector<uint8_t> bits(n * width), bases(n * width);
  size_t next = 0;
  while (next < n) {
    uint64_t r = UINT64_MAX;
    for (uint32_t k = 0; k < g.bands; ++k)
      if (at[k] < end[k]) r = std::min(r, row(at[k]));
    for (uint32_t k = 0; k < g.bands; ++k) {
      for (; at[k] < end[k] && row(at[k]) == r; ++at[k], ++next) {
        const uint64_t p = g.flat(static_cast<uint64_t>(positions[at[k]]));
        const uint32_t real_base = load_bits(base + p * width, width);
        const uint32_t bits_now = rebase_value(load_bits(new_bits.data() + at[k] * width, width),
                                               load_bits(base_bits.data() + at[k] * width, width), real_base, width);
        flat[next] = static_cast<int64_t>(p);
        std::memcpy(bits.data() + next * width, &bits_now, width);
        std::memcpy(bases.data() + next * width, &real_base, width);
      }
    }
  }
  std::copy(flat.begin(), flat.end(), positions.begin());
  std::copy(bits.begin(), bits.end(), new_bits.begin());
  std::copy(bases.begin(), bases.end(), base_bits.begin());
}

}  // namespace deltasync::compact
