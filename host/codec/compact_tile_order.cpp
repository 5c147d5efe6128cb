// The reorderings of tiled tensors (compact_tile_order.hpp): no per-change division (Divider)
// and no per-change data-dependent branch.
#include "codec/compact_tile_order.hpp"

#include "codec/compact_block_simd.hpp"
#include "codec/compact_format.hpp"
#include "codec/compact_tile_order_simd.hpp"

#include <algorithm>
#include <array>
#include <bit>
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

constexpr uint64_t kBandPad = 72;  // elements between two bands' buffers (see split_stripe_w)

// Routes stripe s's changes to per-band buffers (see split_stripe). Per change, with
// u = p / band_width (one multiply, Divider; the columns are bands x band_width): band k = u mod
// bands, row = u / bands (a mask and a shift), coded position q = k * band_elements + row *
// band_width + p - u * band_width, and three stores at the band's next slot. The slot comes
// from eight 8-bit counters packed in one register, chunk by chunk (at most 255 changes), not
// from counters in memory (each store's slot waited on the previous store to the same
// counter); and bands and positions are found in a pass of their own first (with the
// multiply in the stores' address, every later load waited on it: ~20 cycles per change).
template <uint32_t W>
void split_stripe_w(const TileGeometry& g, uint64_t begin, uint64_t end, const int64_t* positions, const uint8_t* new_bits,
                    const uint8_t* base_bits, uint32_t block_elements, const BandBlock& block) {
  constexpr uint64_t kChunk = 255;
  const uint64_t bw = g.band_width(), be = g.band_elements(), band_mask = g.bands - 1;
  const int band_bits = std::countr_zero(g.bands);
  const Divider by_width(bw, g.rows * g.cols);
  const uint64_t capacity = std::min<uint64_t>(block_elements, end - begin);
  // Band k's buffer: a block, plus a chunk that may spill over it before the block is coded.
  const uint64_t stride = capacity + kChunk + kBandPad;
  thread_local std::vector<int64_t> coded_positions;
  thread_local std::vector<uint8_t> coded_new, coded_base;
  coded_positions.resize(stride * g.bands);
  coded_new.resize(stride * g.bands * W);
  coded_base.resize(stride * g.bands * W);
  int64_t* const q_at = coded_positions.data();
  uint8_t* const new_at = coded_new.data();
  uint8_t* const base_at = coded_base.data();
  std::array<uint64_t, kMaxTilesPerDim> fill{};
  // Band k's buffered changes as full blocks and, at the stripe's end (`last`), the short block
  // that ends its tile; what is left moves to the front.
  const auto flush = [&](uint32_t k, bool last) {
    int64_t* const q = q_at + k * stride;
    uint8_t* const n = new_at + k * stride * W;
    uint8_t* const b = base_at + k * stride * W;
    const auto emit = [&](uint64_t first, uint64_t count) {
      block(k, q + first, n + first * W, b + first * W, static_cast<uint32_t>(count));
    };
    uint64_t done = 0;
    for (; fill[k] - done >= capacity; done += capacity) emit(done, capacity);
    if (last && done < fill[k]) {
      emit(done, fill[k] - done);
      done = fill[k];
    }
    const uint64_t rest = fill[k] - done;
    std::memmove(q, q + done, rest * sizeof(int64_t));
    std::memmove(n, n + done * W, rest * W);
    std::memmove(b, b + done * W, rest * W);
    fill[k] = rest;
  };
  std::array<int64_t, kChunk> chunk_q;
  std::array<uint8_t, kChunk> chunk_band;
  // AVX-512 for the first pass while the positions are below its limit (compact_tile_order_simd.hpp).
  const bool simd = detail::simd_blocks_supported() && static_cast<uint64_t>(positions[end - 1]) < detail::kSimdSplitLimit;
  for (uint64_t from = begin; from < end; from += kChunk) {
    const uint64_t n = std::min(kChunk, end - from);
    const uint64_t vectored = simd ? n / 8 * 8 : 0;
    if (vectored != 0)
      detail::band_and_coded8(positions + from, vectored, g.bands, bw, be, chunk_band.data(), chunk_q.data());
    for (uint64_t j = vectored; j < n; ++j) {
      const auto p = static_cast<uint64_t>(positions[from + j]);
      const uint64_t u = by_width(p);
      const uint64_t k = u & band_mask;
      chunk_band[j] = static_cast<uint8_t>(k);
      chunk_q[j] = static_cast<int64_t>(k * be + (u >> band_bits) * bw + p - u * bw);
    }
    uint64_t packed = 0;  // changes of band k in this chunk so far: bits [8k, 8k + 8)
    for (uint64_t j = 0; j < n; ++j) {
      const uint32_t k = chunk_band[j];
      packed += uint64_t{1} << (8 * k);
      const uint64_t at = k * stride + fill[k] + ((packed >> (8 * k)) & 0xFF) - 1;
      q_at[at] = chunk_q[j];
      std::memcpy(new_at + at * W, new_bits + (from + j) * W, W);
      std::memcpy(base_at + at * W, base_bits + (from + j) * W, W);
    }
    for (uint32_t k = 0; k < g.bands; ++k) {
      fill[k] += (packed >> (8 * k)) & 0xFF;
      if (fill[k] >= capacity) flush(k, false);
    }
  }
  for (uint32_t k = 0; k < g.bands; ++k)
    if (fill[k] != 0) flush(k, true);
}

// ---- decoder: a stripe's bands put in flat order ---------------------------------------------
//
// Flat order is row by row, each row's runs band by band, and inside a (row, band) run coded
// and flat order agree (positions differ by a constant). Two passes, neither with a branch that
// depends on a change nor a chain from one change to the next:
//   1. each change stores where its run ends in its band (a plain store; the row is a multiply);
//   2. one walk over the runs in flat order copies each run from its band -- its length from
//      pass 1, with a running maximum over the empty runs -- kStep changes per step (the surplus
//      lands where the next run goes); with eight bands at low density, a row's eight runs at
//      once where the CPU has AVX-512 (compact_tile_order_simd.hpp: 6.3 -> 4.6 cycles per
//      change at 1%).
// Then, with a base, the base bits are gathered in ascending flat order (a stream the hardware
// prefetcher follows) and the new bits rebased onto them. (Finding each run's end by comparing
// the bands' heads chained every step on the previous step's comparisons; moving each change by
// its run's constant scattered stores over the stripe, one sweep per band: both ~2x slower.)

constexpr uint64_t kStep = 4;        // changes copied per step of a run
constexpr uint64_t kRebaseLag = 32;  // changes between a base line's prefetch and its gather
static_assert(kMergeSlack >= kStep - 1);

struct MergeOut {
  int64_t* positions;
  uint8_t* new_bits;
  uint8_t* base_bits;
  uint64_t count;
};

// Pass 2 of merge_w for kBands bands (a compile-time count, so that the bands' cursors and
// shifts stay in registers).
template <uint32_t W, int kMode, uint32_t kBands>
void walk_runs(const TileGeometry& g, uint64_t first_row, const std::array<uint64_t, kMaxTilesPerDim>& begin,
               const uint64_t* run_end, const int64_t* q, const uint8_t* new_bits, const uint8_t* base_bits, const MergeOut& out) {
  using Pair = int64_t __attribute__((vector_size(16)));  // two positions per add
  const uint64_t bw = g.band_width(), be = g.band_elements(), rows = g.stripe_rows();
  std::array<uint64_t, kBands> from;
  std::array<int64_t, kBands> band_shift;
  for (uint32_t k = 0; k < kBands; ++k) {
    from[k] = begin[k];
    band_shift[k] = static_cast<int64_t>(k * bw) - static_cast<int64_t>(k * be);
  }
  // Locals: the stores below could alias `out`'s fields and would reload them every change.
  int64_t* const out_positions = out.positions;
  uint8_t* const out_new = out.new_bits;
  uint8_t* const out_base = out.base_bits;
  const uint64_t out_count = out.count;
  uint64_t at = 0;
  // Eight bands at low density (runs of ~1 change): rows go to the AVX-512 walk while it takes
  // them (compact_tile_order_simd.hpp), the rest here.
  detail::RunWalk simd{};
  bool use_simd = false;
  if constexpr (kBands == detail::kSimdRunBands) {
    use_simd = detail::simd_blocks_supported() && out_count <= 2 * rows * kBands;
    simd = {run_end, q, new_bits, kMode == 0 ? base_bits : nullptr, static_cast<int64_t>(first_row * (g.cols - bw)),
            static_cast<int64_t>(g.cols - bw), {}, out_positions, out_new, kMode == 0 ? out_base : nullptr, out_count, g.rows * g.cols};
    std::copy(band_shift.begin(), band_shift.end(), simd.band_shift.begin());
  }
  for (uint64_t r = 0; r < rows; ++r) {
    if constexpr (kBands == detail::kSimdRunBands) {
      if (use_simd) {
        r = detail::walk_runs8(simd, W, r, rows, from.data(), at);
        if (r == rows) break;
      }
    }
    // flat position = coded + row * (cols - band_width) + k * (band_width - band_elements)
    const auto row_shift = static_cast<int64_t>((first_row + r) * (g.cols - bw));
#pragma GCC unroll 8
    for (uint32_t k = 0; k < kBands; ++k) {
      const uint64_t c = from[k];
      const uint64_t n = std::max(run_end[r * kBands + k], c) - c;
      const int64_t shift = row_shift + band_shift[k];
      if (at + n + kStep <= out_count) [[likely]] {
        const Pair shift2 = {shift, shift};
        uint64_t j = 0;
        do {
          Pair x0, x1;
          std::memcpy(&x0, q + c + j, sizeof x0);
          std::memcpy(&x1, q + c + j + 2, sizeof x1);
          x0 += shift2;
          x1 += shift2;
          std::memcpy(out_positions + at + j, &x0, sizeof x0);
          std::memcpy(out_positions + at + j + 2, &x1, sizeof x1);
          std::memcpy(out_new + (at + j) * W, new_bits + (c + j) * W, kStep * W);
          if constexpr (kMode == 0) std::memcpy(out_base + (at + j) * W, base_bits + (c + j) * W, kStep * W);
          j += kStep;
        } while (j < n);
      } else {  // the stripe's last changes: nothing written past them
        for (uint64_t j = 0; j < n; ++j) {
          out_positions[at + j] = q[c + j] + shift;
          std::memcpy(out_new + (at + j) * W, new_bits + (c + j) * W, W);
          if constexpr (kMode == 0) std::memcpy(out_base + (at + j) * W, base_bits + (c + j) * W, W);
        }
      }
      at += n;
      from[k] = c + n;
    }
  }
}

// kMode: 0 the bits move as they are, 1 new bits move and base bits are zeros, 2 new bits are
// rebased onto `base` gathered at the flat positions.
template <uint32_t W, int kMode>
void merge_w(const TileGeometry& g, uint32_t s, const uint64_t* tile_starts, const int64_t* q, const uint8_t* new_bits,
             const uint8_t* base_bits, const uint8_t* base, const MergeOut& out) {
  const uint64_t bands = g.bands, bw = g.band_width(), be = g.band_elements(), rows = g.stripe_rows();
  const uint64_t first_row = s * rows;
  const Divider by_width(bw, be);
  std::array<uint64_t, kMaxTilesPerDim> begin{}, end{};
  for (uint64_t k = 0; k < bands; ++k) {
    begin[k] = tile_starts[k * g.stripes + s];
    end[k] = tile_starts[k * g.stripes + s + 1];
  }
  thread_local std::vector<uint64_t> run_ends;  // (row - first_row) * bands + band: index in the band's tile
  run_ends.assign(rows * bands, 0);
  uint64_t* const run_end = run_ends.data();
  for (uint64_t k = 0; k < bands; ++k)
    for (uint64_t i = begin[k]; i < end[k]; ++i)
      run_end[(by_width(static_cast<uint64_t>(q[i]) - k * be) - first_row) * bands + k] = i + 1;
  switch (bands) {
    case 1: walk_runs<W, kMode, 1>(g, first_row, begin, run_end, q, new_bits, base_bits, out); break;
    case 2: walk_runs<W, kMode, 2>(g, first_row, begin, run_end, q, new_bits, base_bits, out); break;
    case 4: walk_runs<W, kMode, 4>(g, first_row, begin, run_end, q, new_bits, base_bits, out); break;
    default: walk_runs<W, kMode, 8>(g, first_row, begin, run_end, q, new_bits, base_bits, out); break;
  }
  if constexpr (kMode == 1)
    if (out.base_bits != nullptr) std::memset(out.base_bits, 0, out.count * W);
  if constexpr (kMode == 2)
    for (uint64_t i = 0; i < out.count; ++i) {
      if (i + kRebaseLag < out.count) __builtin_prefetch(base + static_cast<uint64_t>(out.positions[i + kRebaseLag]) * W);
      const uint32_t real = load<W>(base + static_cast<uint64_t>(out.positions[i]) * W);
      store<W>(out.new_bits + i * W, rebase_value(load<W>(out.new_bits + i * W), 0, real, W));
      store<W>(out.base_bits + i * W, real);
    }
}

template <uint32_t W>
void merge_width(const TileGeometry& g, uint32_t s, const uint64_t* tile_starts, const CodedChanges& coded, const uint8_t* base,
                 const MergeOut& out) {
  const int64_t* q = coded.positions.data();
  const uint8_t* n = coded.new_bits.data();
  if (base != nullptr)
    merge_w<W, 2>(g, s, tile_starts, q, n, nullptr, base, out);
  else if (coded.base_bits.empty())
    merge_w<W, 1>(g, s, tile_starts, q, n, nullptr, nullptr, out);
  else
    merge_w<W, 0>(g, s, tile_starts, q, n, coded.base_bits.data(), nullptr, out);
}

}  // namespace

std::vector<uint64_t> stripe_starts(const TileGeometry& g, std::span<const int64_t> positions) {
  std::vector<uint64_t> starts(g.stripes + 1);
  for (uint32_t s = 0; s < g.stripes; ++s) {
    const auto begin = static_cast<int64_t>(s * g.stripe_rows() * g.cols);
    starts[s] = static_cast<uint64_t>(std::lower_bound(positions.begin(), positions.end(), begin) - positions.begin());
  }
  starts[g.stripes] = positions.size();
  return starts;
}

void split_stripe(const TileGeometry& g, uint32_t stripe, std::span<const int64_t> positions, const uint8_t* new_bits,
                  const uint8_t* base_bits, uint32_t width, uint32_t block_elements, const BandBlock& block) {
  const auto begin = static_cast<int64_t>(stripe * g.stripe_rows() * g.cols), end = begin + static_cast<int64_t>(g.stripe_rows() * g.cols);
  const auto first = static_cast<uint64_t>(std::lower_bound(positions.begin(), positions.end(), begin) - positions.begin());
  const auto last = static_cast<uint64_t>(std::lower_bound(positions.begin() + first, positions.end(), end) - positions.begin());
  if (first == last) return;
  switch (width) {
    case 1: return split_stripe_w<1>(g, first, last, positions.data(), new_bits, base_bits, block_elements, block);
    case 2: return split_stripe_w<2>(g, first, last, positions.data(), new_bits, base_bits, block_elements, block);
    default: return split_stripe_w<4>(g, first, last, positions.data(), new_bits, base_bits, block_elements, block);
  }
}

CodedOrder to_coded_order(const TileGeometry& g, std::span<const int64_t> positions, std::span<const uint8_t> new_bits,
                          std::span<const uint8_t> base_bits, uint32_t width) {
  CodedOrder out;
  if (g.bands == 1) {
    const std::vector<uint64_t> stripes = stripe_starts(g, positions);
    out.tile_starts = stripes;
    return out;
  }
  // Each stripe's bands in one block each, kept per tile, then laid out in coded order.
  std::vector<CodedOrder> tiles(g.tiles());
  for (uint32_t s = 0; s < g.stripes; ++s)
    split_stripe(g, s, positions, new_bits.data(), base_bits.data(), width, UINT32_MAX,
                 [&](uint32_t k, const int64_t* q, const uint8_t* n, const uint8_t* b, uint32_t count) {
                   CodedOrder& tile = tiles[k * g.stripes + s];
                   tile.positions.assign(q, q + count);
                   tile.new_bits.assign(n, n + size_t{count} * width);
                   tile.base_bits.assign(b, b + size_t{count} * width);
                 });
  for (const CodedOrder& tile : tiles) {
    out.tile_starts.push_back(out.positions.size());
    out.positions.insert(out.positions.end(), tile.positions.begin(), tile.positions.end());
    out.new_bits.insert(out.new_bits.end(), tile.new_bits.begin(), tile.new_bits.end());
    out.base_bits.insert(out.base_bits.end(), tile.base_bits.begin(), tile.base_bits.end());
  }
  out.tile_starts.push_back(out.positions.size());
  return out;
}

void merge_stripe(const TileGeometry& g, uint32_t stripe, std::span<const uint64_t> tile_starts, const CodedChanges& coded,
                  uint32_t width, std::span<int64_t> out_positions, std::span<uint8_t> out_new_bits,
                  std::span<uint8_t> out_base_bits, const uint8_t* base) {
  const MergeOut out{out_positions.data(), out_new_bits.data(), out_base_bits.data(), out_positions.size()};
  if (out.count == 0) return;
  switch (width) {
    case 1: return merge_width<1>(g, stripe, tile_starts.data(), coded, base, out);
    case 2: return merge_width<2>(g, stripe, tile_starts.data(), coded, base, out);
    default: return merge_width<4>(g, stripe, tile_starts.data(), coded, base, out);
  }
}

void to_flat_order(const TileGeometry& g, const CodedChanges& coded, uint32_t width, std::span<int64_t> out_positions,
                   std::span<uint8_t> out_new_bits, std::span<uint8_t> out_base_bits, const uint8_t* base) {
  const size_t n = coded.positions.size();
  if (n == 0) return;
  std::vector<uint64_t> tile_starts(g.tiles() + 1);
  for (uint32_t t = 0; t <= g.tiles(); ++t)
    tile_starts[t] = t == g.tiles() ? n
                                    : static_cast<uint64_t>(std::lower_bound(coded.positions.begin(), coded.positions.end(),
                                                                             static_cast<int64_t>(g.tile_begin(t))) -
                                                            coded.positions.begin());
  // The merge reads past a tile's last change: padded copies.
  std::vector<int64_t> positions(coded.positions.begin(), coded.positions.end());
  positions.resize(n + kMergeSlack);
  std::vector<uint8_t> new_bits(coded.new_bits.begin(), coded.new_bits.end()), base_bits(coded.base_bits.begin(), coded.base_bits.end());
  new_bits.resize((n + kMergeSlack) * width);
  if (!base_bits.empty()) base_bits.resize((n + kMergeSlack) * width);
  const CodedChanges padded{positions, new_bits, base_bits};
  uint64_t at = 0;
  for (uint32_t s = 0; s < g.stripes; ++s) {
    uint64_t count = 0;
    for (uint32_t k = 0; k < g.bands; ++k) count += tile_starts[k * g.stripes + s + 1] - tile_starts[k * g.stripes + s];
    merge_stripe(g, s, tile_starts, padded, width, out_positions.subspan(at, count), out_new_bits.subspan(at * width, count * width),
                 out_base_bits.empty() ? out_base_bits : out_base_bits.subspan(at * width, count * width), base);
    at += count;
  }
}

}  // namespace deltasync::compact
