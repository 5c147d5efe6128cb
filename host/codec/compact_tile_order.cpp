// Both reorderings are counting sorts (by band; by row and band): no per-change division
// (Divider) and no data-dependent branch.
#include "codec/compact_tile_order.hpp"

#include <algorithm>
#include <array>
#include <cstring>

namespace deltasync::compact {
namespace {

template <uint32_t W>
uint32_t load(const uint8_t* p) {
  uint32_t v = 0;
  std::memcpy(&v, p, W);
  return v;
}
template <uint32_t W>
void store(uint8_t* p, uint32_t v) {
  std::memcpy(p, &v, W);
}

template <uint32_t W>
void coded_order_w(const TileGeometry& g, std::span<const int64_t> positions, const uint8_t* new_bits, const uint8_t* base_bits,
                   CodedOrder& out) {
  const uint64_t bw = g.band_width(), be = g.band_elements(), numel = g.rows * g.cols;
  const Divider by_cols(g.cols, numel), by_width(bw, g.cols);
  const size_t n = positions.size();
  // Each change's band, then a stable partition by band: inside a band flat order is coded order.
  std::vector<uint8_t> band(n);
  std::array<uint64_t, 9> start{};
  for (size_t i = 0; i < n; ++i) {
    const auto p = static_cast<uint64_t>(positions[i]);
    const uint64_t k = by_width(p - by_cols(p) * g.cols);
    band[i] = static_cast<uint8_t>(k);
    ++start[k + 1];
  }
  for (uint32_t k = 0; k < g.bands; ++k) start[k + 1] += start[k];
  for (size_t i = 0; i < n; ++i) {
    const auto p = static_cast<uint64_t>(positions[i]);
    const uint64_t k = band[i], row = by_cols(p), at = start[k]++;
    out.positions[at] = static_cast<int64_t>(k * be + row * bw + (p - row * g.cols - k * bw));
    store<W>(out.new_bits.data() + at * W, load<W>(new_bits + i * W));
    store<W>(out.base_bits.data() + at * W, load<W>(base_bits + i * W));
  }
}

template <uint32_t W>
void flat_order_w(const TileGeometry& g, const CodedChanges& coded, const uint8_t* base, std::span<int64_t> out_positions,
                  std::span<uint8_t> out_new_bits, std::span<uint8_t> out_base_bits) {
  const size_t n = coded.positions.size();
  const uint64_t bw = g.band_width(), be = g.band_elements();
  const Divider by_band(be, g.rows * g.cols), by_width(bw, be);
  // A counting sort by (row, band) (the GPU's reorder, with counts from a histogram instead of
  // binary searches): segment (r, k) starts after every change of the rows before r and of the
  // bands before k in row r; inside a segment coded order is flat order.
  std::vector<uint64_t> next(g.rows * g.bands + 1, 0);
  for (const int64_t q : coded.positions) {
    const uint64_t k = by_band(static_cast<uint64_t>(q));
    ++next[by_width(static_cast<uint64_t>(q) - k * be) * g.bands + k + 1];
  }
  for (size_t s = 1; s < next.size(); ++s) next[s] += next[s - 1];
  for (size_t i = 0; i < n; ++i) {
    const auto q = static_cast<uint64_t>(coded.positions[i]);
    const uint64_t k = by_band(q), in_band = q - k * be, r = by_width(in_band);
    const uint64_t at = next[r * g.bands + k]++;
    out_positions[at] = static_cast<int64_t>(r * g.cols + k * bw + (in_band - r * bw));
    store<W>(out_new_bits.data() + at * W, load<W>(coded.new_bits.data() + i * W));
    store<W>(out_base_bits.data() + at * W, load<W>(coded.base_bits.data() + i * W));
  }
  if (base == nullptr) return;
  // Decoded without a base: the base bits in ascending flat order (a stream the hardware
  // prefetcher follows), the new bits rebased onto them.
  constexpr size_t kAhead = 32;
  for (size_t i = 0; i < n; ++i) {
    if (i + kAhead < n) __builtin_prefetch(base + static_cast<uint64_t>(out_positions[i + kAhead]) * W);
    const uint32_t real_base = load<W>(base + static_cast<uint64_t>(out_positions[i]) * W);
    uint8_t* bits = out_new_bits.data() + i * W;
    store<W>(bits, rebase_value(load<W>(bits), load<W>(out_base_bits.data() + i * W), real_base, W));
    store<W>(out_base_bits.data() + i * W, real_base);
  }
}

template <template <uint32_t> class Fn, typename... Args>
void by_width(uint32_t width, Args&&... args) {
  switch (width) {
    case 1: return Fn<1>::run(args...);
    case 2: return Fn<2>::run(args...);
    default: return Fn<4>::run(args...);
  }
}
template <uint32_t W>
struct CodedOrderW {
  static void run(const TileGeometry& g, std::span<const int64_t> p, const uint8_t* n, const uint8_t* b, CodedOrder& out) {
    coded_order_w<W>(g, p, n, b, out);
  }
};
template <uint32_t W>
struct FlatOrderW {
  static void run(const TileGeometry& g, const CodedChanges& c, const uint8_t* base, std::span<int64_t> p, std::span<uint8_t> n,
                  std::span<uint8_t> b) {
    flat_order_w<W>(g, c, base, p, n, b);
  }
};

}  // namespace

CodedOrder to_coded_order(const TileGeometry& g, std::span<const int64_t> positions, std::span<const uint8_t> new_bits,
                          std::span<const uint8_t> base_bits, uint32_t width) {
  CodedOrder out;
  const size_t n = positions.size();
  std::span<const int64_t> coded = positions;
  if (g.bands > 1) {
    out.positions.resize(n);
    out.new_bits.resize(n * width);
    out.base_bits.resize(n * width);
    by_width<CodedOrderW>(width, g, positions, new_bits.data(), base_bits.data(), out);
    coded = out.positions;
  }
  out.tile_starts.resize(g.tiles() + 1);
  for (uint32_t t = 0; t < g.tiles(); ++t)
    out.tile_starts[t] = static_cast<uint64_t>(
        std::lower_bound(coded.begin(), coded.end(), static_cast<int64_t>(g.tile_begin(t))) - coded.begin());
  out.tile_starts[g.tiles()] = n;
  return out;
}

void to_flat_order(const TileGeometry& g, const CodedChanges& coded, uint32_t width, std::span<int64_t> out_positions,
                   std::span<uint8_t> out_new_bits, std::span<uint8_t> out_base_bits, const uint8_t* base) {
  if (coded.positions.empty()) return;
  by_width<FlatOrderW>(width, g, coded, base, out_positions, out_new_bits, out_base_bits);
}

}  // namespace deltasync::compact
