// The coder of one compact block (docs/compact-format.md, "Block payload").
//
// Each change contributes up to two integers: the gap to the previous position (not for the
// block's first change, whose position is in the record) and the value symbol. An integer v is
// split into a token and raw low bits ("hybrid integer"): v < 16 is its own token; otherwise,
// with n = floor(log2 v), the token is 16 + 4(n-4) + the two bits below the leading one, and
// the n-2 bits under those are written raw. Tokens carry nearly all the information and are
// entropy-coded with rANS against a per-block static table (12-bit precision); the raw bits are
// close to uniform, so storing them as they are costs almost nothing over their entropy.
//
// Why rANS with static tables instead of zstd: the symbols are far from byte-aligned (a ±1-ulp
// value change is ~1 bit), zstd's literal Huffman cannot go below 1 bit per byte and its
// matcher finds nothing in noise-like gaps; a static table per block is what a GPU thread can
// decode without shared state.
#include "codec/compact_codec_block.hpp"
#include "core/little_endian.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <type_traits>

#include "codec/compact_block_simd.hpp"
#include "codec/compact_codec.hpp"
#include "codec/compact_word_lanes.hpp"

namespace deltasync::compact::detail {
namespace {

constexpr uint32_t kGapTokens = 256;     // tokens of 64-bit integers

using ::deltasync::detail::load_le;
using ::deltasync::detail::store_le;

// ---- hybrid integers ----------------------------------------------------------------------

struct Split {
  uint32_t token;
  uint32_t extra_bits;
  uint64_t extra;
};

inline Split split(uint64_t v) {
  if (v < 16) return {static_cast<uint32_t>(v), 0, 0};
  const uint32_t n = 63u - static_cast<uint32_t>(std::countl_zero(v));
  const uint32_t top = static_cast<uint32_t>(v >> (n - 2)) & 3u;
  return {16u + 4u * (n - 4u) + top, n - 2u, v & ((uint64_t{1} << (n - 2)) - 1)};
}

// The same split without branches (v < 16 versus not is unpredictable for gaps): the token and
// the number of raw bits; the raw bits are the low `extra_bits` bits of v.
struct Token {
  uint32_t token;
  uint32_t extra_bits;
};
constexpr Token tokenize(uint64_t v) {
  const uint32_t log2 = 63u - static_cast<uint32_t>(std::countl_zero(v | 1));
  const uint32_t large = 0u - static_cast<uint32_t>(v >= 16);  // all ones iff v >= 16
  const uint32_t n = std::max(log2, 2u);                      // keeps the shift in range for small v
  const uint32_t token_large = 16u + 4u * (n - 4u) + (static_cast<uint32_t>(v >> (n - 2)) & 3u);
  return {(token_large & large) | (static_cast<uint32_t>(v) & ~large), (n - 2u) & large};
}

// Tokens of small integers from a table (gaps at >= 0.1% density and almost all value symbols
// are below it): one load instead of ~10 dependent operations. Entry: token | extra_bits << 8.
constexpr uint32_t kTokenLutSize = 4096;
struct TokenLut {
  std::array<uint16_t, kTokenLutSize> entry{};
};
constexpr TokenLut make_token_lut() {
  TokenLut lut;
  for (uint32_t v = 0; v < kTokenLutSize; ++v) {
    const Token t = tokenize(v);
    lut.entry[v] = static_cast<uint16_t>(t.token | t.extra_bits << 8);
  }
  return lut;
}
constexpr TokenLut kTokenLut = make_token_lut();
inline Token tokenize_fast(uint64_t v) {
  if (v < kTokenLutSize) [[likely]] {
    const uint32_t e = kTokenLut.entry[v];
    return {e & 0xFFu, e >> 8};
  }
  return tokenize(v);
}

// Decoder view of a token: v = base + (extra_bits raw bits).
struct TokenJoin {
  std::array<uint64_t, kGapTokens> base{};
  std::array<uint8_t, kGapTokens> extra_bits{};
};
constexpr TokenJoin make_token_join() {
  TokenJoin j;
  for (uint32_t t = 0; t < kGapTokens; ++t) {
    if (t < 16) {
      j.base[t] = t;
      j.extra_bits[t] = 0;
    } else {
      const uint32_t n = (t - 16) / 4 + 4;
      j.base[t] = uint64_t{4u | ((t - 16) & 3u)} << (n - 2);
      j.extra_bits[t] = static_cast<uint8_t>(n - 2);
    }
  }
  return j;
}
constexpr TokenJoin kTokenJoin = make_token_join();

// Highest token a value of `width` bytes can produce (its symbols are < 2^(8*width)).
uint32_t value_token_limit(uint32_t width) { return split(width_mask(width)).token + 1; }

// ---- raw bits, LSB first --------------------------------------------------------------------

// Branch-free writer: every put stores the whole 64-bit accumulator and advances by the complete
// bytes it holds (whether a byte completes is a coin flip per change, so a branch on it would be
// mispredicted half the time). The caller sizes the buffer for the worst case plus 8 bytes of
// slack for the last store.
class BitWriter {
 public:
  explicit BitWriter(uint8_t* out) : begin_(out), ptr_(out) {}
  void put(uint64_t v, uint32_t n) {  // n <= 64, v < 2^n
    if (n > kMaxPut) [[unlikely]] {
      put_small(static_cast<uint32_t>(v), 32);
      put_small(v >> 32, n - 32);
    } else {
      put_small(v, n);
    }
  }
  // Flushes the last partial byte; returns the bytes written.
  size_t finish() {
    if (count_ > 0) *ptr_++ = static_cast<uint8_t>(acc_);
    acc_ = 0;
    count_ = 0;
    return static_cast<size_t>(ptr_ - begin_);
  }

 private:
  static constexpr uint32_t kMaxPut = 56;  // fits beside < 8 pending bits
  void put_small(uint64_t v, uint32_t n) {  // n <= 56, v < 2^n
    acc_ |= v << count_;
    count_ += n;
    store_le<uint64_t>(ptr_, acc_);
    ptr_ += count_ >> 3;
    acc_ >>= count_ & ~7u;  // <= 56: count_ < 64
    count_ &= 7;
  }
  uint8_t* begin_;
  uint8_t* ptr_;
  uint64_t acc_ = 0;    // count_ < 8 pending bits
  uint32_t count_ = 0;
};

// ---- varints (tables only) ------------------------------------------------------------------

void put_varint(std::vector<uint8_t>& out, uint32_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<uint8_t>(v | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<uint8_t>(v));
}

uint32_t get_varint(const uint8_t*& p, const uint8_t* end) {
  uint32_t v = 0;
  for (uint32_t shift = 0; shift < 35; shift += 7) {
    if (p == end) throw BlockError("frequency table truncated");
    const uint8_t b = *p++;
    v |= static_cast<uint32_t>(b & 0x7F) << shift;
    if (!(b & 0x80)) return v;
  }
  throw BlockError("frequency table has an overlong number");
}

// ---- static rANS tables ---------------------------------------------------------------------

struct Model {
  uint32_t num_symbols = 0;  // table covers tokens [0, num_symbols)
  std::array<uint32_t, kGapTokens> freq{};
  std::array<uint32_t, kGapTokens> start{};
};

// Decoder view of a table: the symbol of every slot, and per symbol its frequency and start.
// Two small arrays (4 KiB + 1 KiB) rather than one 32-bit entry per slot (16 KiB): both
// tables are read at uniformly random slots, and two 16 KiB tables alone would fill a 32 KiB
// L1 that must also hold the prefetched base lines; the second, dependent load costs less.
struct SlotTable {
  std::array<uint8_t, kScale> symbol;          // slot -> symbol
  std::array<uint32_t, kGapTokens> freq_start;  // symbol -> freq | start << 13
};

// Quantizes a histogram to frequencies summing to kScale, every used symbol >= 1. Deterministic
// (integer arithmetic only) so that every implementation produces the same table.
void normalize(const std::array<uint32_t, kGapTokens>& counts, uint32_t limit, Model& m) {
  uint64_t total = 0;
  m.num_symbols = 0;
  for (uint32_t s = 0; s < limit; ++s) {
    total += counts[s];
    if (counts[s]) m.num_symbols = s + 1;
  }
  m.freq.fill(0);
  if (total == 0) return;
  int64_t sum = 0;
  uint32_t largest = 0;
  for (uint32_t s = 0; s < m.num_symbols; ++s) {
    if (!counts[s]) continue;
    const uint64_t f = (uint64_t{counts[s]} * kScale + total / 2) / total;
    m.freq[s] = static_cast<uint32_t>(std::max<uint64_t>(f, 1));
    sum += m.freq[s];
    if (m.freq[s] > m.freq[largest]) largest = s;
  }
  if (sum < kScale) {
    m.freq[largest] += static_cast<uint32_t>(kScale - sum);
  } else {
    // Take the excess from the currently largest frequency (first such symbol), at most half of
    // it at a time, so no used symbol drops below 1.
    while (sum > kScale) {
      uint32_t best = 0;
      for (uint32_t s = 0; s < m.num_symbols; ++s)
        if (m.freq[s] > m.freq[best]) best = s;
      const uint32_t take = static_cast<uint32_t>(std::min<int64_t>(sum - kScale, m.freq[best] / 2));
      m.freq[best] -= std::max<uint32_t>(take, 1);
      sum -= std::max<uint32_t>(take, 1);
    }
  }
  uint32_t acc = 0;
  for (uint32_t s = 0; s < m.num_symbols; ++s) {
    m.start[s] = acc;
    acc += m.freq[s];
  }
}

void write_model(const Model& m, std::vector<uint8_t>& out) {
  put_varint(out, m.num_symbols);
  for (uint32_t s = 0; s < m.num_symbols; ++s) put_varint(out, m.freq[s]);
}

// Reads a table (frequencies and starts into `m`). `required`: the block has symbols of this
// kind, so the table must not be empty.
void read_model(const uint8_t*& p, const uint8_t* end, uint32_t limit, bool required, Model& m, const char* kind) {
  m.num_symbols = get_varint(p, end);
  if (m.num_symbols > limit)
    throw BlockError(std::string(kind) + " table has " + std::to_string(m.num_symbols) + " symbols (at most " +
                     std::to_string(limit) + ")");
  if (m.num_symbols == 0) {
    if (required) throw BlockError(std::string(kind) + " table is empty");
    return;
  }
  uint32_t acc = 0;
  for (uint32_t s = 0; s < m.num_symbols; ++s) {
    const uint32_t f = get_varint(p, end);
    if (f > kScale - acc) throw BlockError(std::string(kind) + " table frequencies exceed the scale");
    m.freq[s] = f;
    m.start[s] = acc;
    acc += f;
  }
  if (acc != kScale) throw BlockError(std::string(kind) + " table frequencies do not sum to the scale");
}

// The slot lookups of a table read by read_model (an empty table builds nothing: it is never
// decoded from).
void build_slots(const Model& m, SlotTable& table) {
  for (uint32_t s = 0; s < m.num_symbols; ++s) {
    std::memset(table.symbol.data() + m.start[s], static_cast<int>(s), m.freq[s]);
    table.freq_start[s] = m.freq[s] | m.start[s] << 13;
  }
}
void build_slots(const Model& m, WordSlotTable& table) {
  for (uint32_t s = 0; s < m.num_symbols; ++s)
    for (uint32_t j = 0; j < m.freq[s]; ++j) table.entry[m.start[s] + j] = word_slot_entry(m.freq[s], j, s);
}

// Renormalization emits 0, 1 or 2 bytes (x < 2^31 and x_max >= 2^19). Branch-free: both
// candidate bytes are stored (as one 16-bit store) and the pointer moves by the count, because
// whether a symbol emits is close to a coin flip and a mispredicted branch per symbol would
// dominate. The buffer has slack in front, and stores below the final pointer are overwritten
// or ignored.
inline void rans_put(uint32_t& x, uint8_t*& ptr, const EncSymbol& e) {
  const uint32_t k = static_cast<uint32_t>(x >= e.x_max) + static_cast<uint32_t>(x >= e.x_max2);
  const uint8_t pair[2] = {static_cast<uint8_t>(x >> 8), static_cast<uint8_t>(x)};  // ptr[-2], ptr[-1]
  std::memcpy(ptr - 2, pair, 2);
  ptr -= k;
  x >>= 8 * k;
  const uint32_t q = static_cast<uint32_t>((static_cast<uint64_t>(x) * e.rcp_freq) >> e.rcp_shift);
  x += e.bias + q * e.cmpl_freq;
}

}  // namespace

namespace {

template <uint32_t W>
inline uint32_t load_w(const uint8_t* p) {
  if constexpr (W == 1) {
    return p[0];
  } else if constexpr (W == 2) {
    uint16_t v;
    std::memcpy(&v, p, 2);
    return v;
  } else {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
  }
}

template <uint32_t W>
inline void store_w(uint8_t* p, uint32_t v) {
  if constexpr (W == 1) {
    p[0] = static_cast<uint8_t>(v);
  } else if constexpr (W == 2) {
    const uint16_t h = static_cast<uint16_t>(v);
    std::memcpy(p, &h, 2);
  } else {
    std::memcpy(p, &v, 4);
  }
}

// compact_version 1's rANS pass: four lanes sharing a byte stream, written backwards from `end`
// in reverse decode order; returns the stream's first byte. Unrolled by pairs of changes (odd i,
// then the even i - 1 below it), so the lane choice is static: odd changes use lanes 3 (value)
// and 2 (gap), even ones lanes 1 and 0.
uint8_t* encode_byte_lanes(const uint8_t* gap_tokens, const uint8_t* value_tokens, uint32_t count,
                           const EncSymbol* gap_enc, const EncSymbol* value_enc, uint8_t* end) {
  uint8_t* ptr = end;
  uint32_t x0 = kRansLow, x1 = kRansLow, x2 = kRansLow, x3 = kRansLow;
  uint32_t i = count - 1;
  if ((i & 1) == 0 && i > 0) {  // the last change is even: code it alone, then pairs follow
    rans_put(x1, ptr, value_enc[value_tokens[i]]);
    rans_put(x0, ptr, gap_enc[gap_tokens[i]]);
    --i;
  }
  // Here i is odd, or i == 0 (a one-change block).
  for (; i >= 1; i -= 2) {
    rans_put(x3, ptr, value_enc[value_tokens[i]]);
    rans_put(x2, ptr, gap_enc[gap_tokens[i]]);
    rans_put(x1, ptr, value_enc[value_tokens[i - 1]]);
    if (i - 1 > 0) rans_put(x0, ptr, gap_enc[gap_tokens[i - 1]]);
    if (i == 1) break;
  }
  if (count == 1) rans_put(x1, ptr, value_enc[value_tokens[0]]);
  for (const uint32_t x : {x3, x2, x1, x0}) {
    ptr -= 4;
    store_le<uint32_t>(ptr, x);
  }
  return ptr;
}

template <uint32_t W>
void encode_block_w(const int64_t* positions, const uint8_t* new_bits, const uint8_t* base_bits, uint32_t count,
                    uint32_t version, std::vector<uint8_t>& out, BlockRecord& record) {
  // Scratch reused across blocks; raw pointers taken once, because stores through uint8_t*
  // may alias anything and would otherwise force reloads of the vectors' fields every element.
  thread_local std::vector<uint8_t> token_buffer, bits_buffer, rans_buffer;
  if (token_buffer.size() < size_t{count} * 2) token_buffer.resize(size_t{count} * 2);
  if (bits_buffer.size() < size_t{count} * 12 + 16) bits_buffer.resize(size_t{count} * 12 + 16);
  if (rans_buffer.size() < size_t{count} * 4 + kWordStateBytes + 16) rans_buffer.resize(size_t{count} * 4 + kWordStateBytes + 16);
  uint8_t* const gap_tokens = token_buffer.data();
  uint8_t* const value_tokens = token_buffer.data() + count;

  // Pass 1 (decode order): tokens, histograms, raw bits. One histogram per kind: consecutive
  // value tokens are usually equal (±1 ulp), so back-to-back increments of one counter chain
  // through store-to-load forwarding, but that chain (~5 cycles) is far shorter than a
  // change's work, and four interleaved sub-histograms measured ~20% slower on this pass (more
  // address arithmetic and L1 lines; CPUs with memory renaming resolve the chain anyway).
  std::array<uint32_t, kGapTokens> gap_counts{}, value_counts{};
  BitWriter writer(bits_buffer.data());
  // With AVX-512, groups of 16 changes after the first get their tokens and raw bits from
  // tokenize_groups (compact_block_simd.hpp), four changes' raw bits per writer step; the
  // scalar loop below codes the rest and is the reference.
  const bool simd = count > kSimdGroup && simd_blocks_supported();
  const uint32_t groups = simd ? (count - 1) / kSimdGroup : 0;
  // Without it, value symbols first, in a loop of their own: branch-free lane-wise arithmetic
  // that the compiler vectorizes (SSE2 is baseline), instead of ~16 scalar operations per change.
  using Symbol = std::conditional_t<W == 4, uint32_t, uint16_t>;
  thread_local std::vector<Symbol> symbol_buffer;
  if (!simd) {
    if (symbol_buffer.size() < count) symbol_buffer.resize(count);
    for (uint32_t i = 0; i < count; ++i)
      symbol_buffer[i] = static_cast<Symbol>(
          value_symbol(load_w<W>(new_bits + size_t{i} * W), load_w<W>(base_bits + size_t{i} * W), W));
  }
  const Symbol* const symbols = symbol_buffer.data();
  const auto value_of = [&](uint32_t i) __attribute__((always_inline)) {
    return simd ? value_symbol(load_w<W>(new_bits + size_t{i} * W), load_w<W>(base_bits + size_t{i} * W), W)
                : uint32_t{symbols[i]};
  };
  {
    const uint32_t sym = value_of(0);
    const Token v = tokenize_fast(sym);
    value_tokens[0] = static_cast<uint8_t>(v.token);
    ++value_counts[v.token];
    writer.put(sym & ((uint64_t{1} << v.extra_bits) - 1), v.extra_bits);
  }
  const auto code_change = [&](uint32_t i) __attribute__((always_inline)) {
    const uint64_t gap = static_cast<uint64_t>(positions[i] - positions[i - 1] - 1);
    const Token g = tokenize_fast(gap);
    gap_tokens[i] = static_cast<uint8_t>(g.token);
    ++gap_counts[g.token];
    const uint32_t sym = value_of(i);
    const Token v = tokenize_fast(sym);
    value_tokens[i] = static_cast<uint8_t>(v.token);
    ++value_counts[v.token];
    // Gap raw bits then value raw bits (decode order). Value symbols of 16 and more (the only
    // ones with raw bits) are rare, so that branch predicts well.
    writer.put(gap & ((uint64_t{1} << g.extra_bits) - 1), g.extra_bits);  // extra_bits <= 61
    if (v.extra_bits != 0) [[unlikely]] writer.put(sym & ((uint64_t{1} << v.extra_bits) - 1), v.extra_bits);
  };
  if (groups != 0) {
    const uint32_t quads = groups * (kSimdGroup / kQuadChanges);
    thread_local std::vector<uint64_t> quad_raw;
    thread_local std::vector<uint8_t> quad_bits;
    if (quad_raw.size() < quads) quad_raw.resize(quads);
    if (quad_bits.size() < quads + 4) quad_bits.resize(quads + 4);  // + the last group's 4-byte store
    // Value tokens in two part histograms: mostly 1 or 2 (±1 ulp), so one counter's increments
    // would often wait on each other (store-to-load forwarding); ~2% faster measured.
    std::array<std::array<uint32_t, kGapTokens>, 2> value_parts{};
    tokenize_groups(positions, new_bits, base_bits, W, 1, groups, gap_tokens, value_tokens, quad_raw.data(), quad_bits.data());
    for (uint32_t q = 0; q < quads; ++q) {
      const uint32_t i = 1 + q * kQuadChanges;
      if (quad_bits[q] == kQuadTooWide) [[unlikely]] {
        for (uint32_t k = 0; k < kQuadChanges; ++k) code_change(i + k);
        continue;
      }
      for (uint32_t k = 0; k < kQuadChanges; ++k) {
        ++gap_counts[gap_tokens[i + k]];
        ++value_parts[k & 1][value_tokens[i + k]];
      }
      writer.put(quad_raw[q], quad_bits[q]);
    }
    for (uint32_t t = 0; t < kGapTokens; ++t) value_counts[t] += value_parts[0][t] + value_parts[1][t];
  }
  for (uint32_t i = 1 + groups * kSimdGroup; i < count; ++i) code_change(i);
  const size_t bits_bytes = writer.finish();

  Model gap_model, value_model;
  normalize(gap_counts, kGapTokens, gap_model);
  normalize(value_counts, value_token_limit(W), value_model);
  const size_t before_tables = out.size();
  write_model(gap_model, out);
  write_model(value_model, out);
  record.table_bytes = static_cast<uint32_t>(out.size() - before_tables);
  std::array<EncSymbol, kGapTokens> gap_enc{}, value_enc{};  // all 256 entries initialized (packed by the SIMD encoder)
  const auto symbol_of = version == kFormatVersion2 ? enc_word_symbol : enc_symbol;
  for (uint32_t s = 0; s < gap_model.num_symbols; ++s) gap_enc[s] = symbol_of(gap_model.start[s], gap_model.freq[s]);
  for (uint32_t s = 0; s < value_model.num_symbols; ++s)
    value_enc[s] = symbol_of(value_model.start[s], value_model.freq[s]);

  // Pass 2: rANS in reverse decode order, written backwards (<= 4 bytes per change + states).
  uint8_t* const end = rans_buffer.data() + rans_buffer.size();
  uint8_t* const ptr = version == kFormatVersion2
                           ? encode_word_lanes(gap_tokens, value_tokens, count, gap_enc.data(), value_enc.data(), end)
                           : encode_byte_lanes(gap_tokens, value_tokens, count, gap_enc.data(), value_enc.data(), end);
  record.rans_bytes = static_cast<uint32_t>(end - ptr);
  record.bits_bytes = static_cast<uint32_t>(bits_bytes);
  out.insert(out.end(), ptr, end);
  out.insert(out.end(), bits_buffer.data(), bits_buffer.data() + bits_bytes);
}

// ---- decoder --------------------------------------------------------------------------------
//
// Changes are decoded in chunks, each in two tight passes:
//   1. rANS: the chunk's gap and value tokens (a "token source": ByteLanes for compact_version
//      1, chunks of 16 changes; WordLanes for version 2, one group of 32 changes, 32 lanes at
//      once). Nothing but the lane states, the stream pointer and the tables is live, so the
//      lanes stay in registers and their independent dependency chains overlap;
//   2. raw bits: positions (validated against the tensor before anything reads the base) and
//      value symbols, parked in new_bits, sixteen changes at a time with AVX-512
//      (compact_block_simd.hpp: decode_raw_group), else one by one; each position's base line
//      is prefetched, and the change kGatherLag before it gathers its base bits. After the
//      pass, the new bits of the gathered changes are computed in a loop of their own, which
//      vectorizes.
// The lag matters: at ~1% density every change reads a new cache line of the base (and every
// ~20 changes a new 4 KiB page), so the gather is a stream of misses. Spread evenly through
// the decode work, one prefetch per change, their latency overlaps it; gathering a whole
// chunk after decoding it (tried: 64..256 changes) overlapped far worse. 64 changes: with the
// SIMD raw-bit pass a change takes ~3 ns, and a lag of 32 measured 97-134 M changes/s against
// 137-140 (128: 132-138).
//
// Both streams are first copied into zero-padded scratch buffers, so the passes read without
// per-symbol bounds checks: a chunk reads at most kRansPad / kRawPad bytes past its stream's
// end, and whether it did is checked after every chunk (a truncated stream reads the padding
// and is then refused).
constexpr uint32_t kByteChunk = 16;          // even: every chunk starts at an odd change (lanes 2/3)
constexpr uint32_t kMaxChunk = kWordLanes;   // the largest chunk of either source
constexpr uint32_t kGatherLag = 64;          // changes between a position's prefetch and its gather
constexpr size_t kRansPad = std::max(4 * size_t{kByteChunk} + 16, kWordStreamPad);  // <= 4 bytes per change
constexpr size_t kRawPad = 12 * size_t{kMaxChunk} + 16;  // <= 61 + 29 raw bits per change

struct PaddedCopy {
  std::vector<uint8_t> bytes;
  const uint8_t* fill(const uint8_t* data, size_t size, size_t pad) {
    if (bytes.size() < size + pad) bytes.resize(size + pad);
    std::memcpy(bytes.data(), data, size);
    std::memset(bytes.data() + size, 0, pad);
    return bytes.data();
  }
};

inline uint64_t load_u64(const uint8_t* p) { return load_le<uint64_t>(p); }

// One rANS decode step of a lane; reads the (up to) two renormalization bytes without a branch.
inline uint32_t rans_get(uint32_t& x, const SlotTable& table, const uint8_t*& ptr) {
  const uint32_t slot = x & (kScale - 1);
  const uint32_t s = table.symbol[slot];
  const uint32_t fs = table.freq_start[s];
  uint32_t y = (fs & 0x1FFF) * (x >> kScaleBits) + slot - (fs >> 13);
  // y >= 2^11 here, so 0, 1 or 2 bytes come back in; both candidates are read as one
  // big-endian pair and shifted in by the count (which is a coin flip: no branch).
  const uint32_t k = static_cast<uint32_t>(y < kRansLow) + static_cast<uint32_t>(y < (kRansLow >> 8));
  const uint32_t pair = uint32_t{ptr[0]} << 8 | ptr[1];
  x = static_cast<uint32_t>(((uint64_t{y} << 16) | pair) >> (16 - 8 * k));
  ptr += k;
  return s;
}

// Up to 64 raw bits at bit offset `at` of a padded stream (two loads above 56 bits).
inline uint64_t raw_bits(const uint8_t* bits, uint64_t at, uint32_t n) {
  const uint64_t low = load_u64(bits + (at >> 3)) >> (at & 7);
  if (n <= 56) [[likely]] return low & ((uint64_t{1} << n) - 1);
  const uint64_t high = load_u64(bits + ((at + 32) >> 3)) >> ((at + 32) & 7);
  return (low & 0xFFFFFFFFu) | ((high & ((uint64_t{1} << (n - 32)) - 1)) << 32);
}

// Token source of compact_version 1: four lanes sharing a byte stream. Change 0 comes alone
// (its value token, lane 1), then chunks of 16 starting at odd changes: change i uses lanes 2/3
// (gap/value) when odd, 0/1 when even, like the encoder.
class ByteLanes {
 public:
  static constexpr uint32_t kStateBytes = 16;
  // Version 1's decoder checked change 0's raw bits before any rANS bound (kept: the GPU twin
  // reports the same first defect).
  static constexpr bool kCheckFirstChunk = false;
  static constexpr const char* kBadState = "rANS stream has an invalid initial state";

  ByteLanes(const Model& gap, const Model& value) {
    build_slots(gap, gap_table_);
    build_slots(value, value_table_);
  }
  const uint8_t* start(const uint8_t* ptr) {
    for (int lane = 0; lane < 4; ++lane, ptr += 4) {
      x_[lane] = load_le<uint32_t>(ptr);
      if (x_[lane] < kRansLow || x_[lane] >= (kRansLow << 8)) throw BlockError(kBadState);
    }
    return ptr;
  }
  uint32_t next(uint32_t begin, uint32_t count, const uint8_t*& stream, uint8_t* gap_tokens, uint8_t* value_tokens) {
    const uint8_t* ptr = stream;  // a local: the token stores (uint8_t) could alias the caller's pointer
    uint32_t x0 = x_[0], x1 = x_[1], x2 = x_[2], x3 = x_[3];
    const SlotTable& gap_slots = gap_table_;
    const SlotTable& value_slots = value_table_;
    uint32_t n = 1;
    if (begin == 0) {
      value_tokens[0] = static_cast<uint8_t>(rans_get(x1, value_slots, ptr));
    } else {
      n = std::min(kByteChunk, count - begin);
      uint32_t k = 0;
      for (; k + 1 < n; k += 2) {
        gap_tokens[k] = static_cast<uint8_t>(rans_get(x2, gap_slots, ptr));
        value_tokens[k] = static_cast<uint8_t>(rans_get(x3, value_slots, ptr));
        gap_tokens[k + 1] = static_cast<uint8_t>(rans_get(x0, gap_slots, ptr));
        value_tokens[k + 1] = static_cast<uint8_t>(rans_get(x1, value_slots, ptr));
      }
      if (k < n) {
        gap_tokens[k] = static_cast<uint8_t>(rans_get(x2, gap_slots, ptr));
        value_tokens[k] = static_cast<uint8_t>(rans_get(x3, value_slots, ptr));
      }
    }
    x_[0] = x0, x_[1] = x1, x_[2] = x2, x_[3] = x3;
    stream = ptr;
    return n;
  }
  bool finished() const { return x_[0] == kRansLow && x_[1] == kRansLow && x_[2] == kRansLow && x_[3] == kRansLow; }

 private:
  static thread_local SlotTable gap_table_, value_table_;
  uint32_t x_[4];
};
thread_local SlotTable ByteLanes::gap_table_, ByteLanes::value_table_;

// Token source of compact_version 2: 32 lanes sharing a stream of 16-bit words, one group of 32
// changes per chunk (change i in lane i mod 32; change 0 has no gap token). Full groups run
// word_group_simd where the CPU has AVX2 or AVX-512, else word_round -- the same arithmetic.
class WordLanes {
 public:
  static constexpr uint32_t kStateBytes = kWordStateBytes;
  static constexpr bool kCheckFirstChunk = true;
  static constexpr const char* kBadState = "rANS stream has an invalid initial state";

  WordLanes(const Model& gap, const Model& value) : simd_(word_simd_level()) {
    build_slots(gap, gap_table_);
    build_slots(value, value_table_);
  }
  const uint8_t* start(const uint8_t* ptr) {
    for (uint32_t lane = 0; lane < kWordLanes; ++lane, ptr += 4) {
      x_[lane] = load_le<uint32_t>(ptr);
      if (x_[lane] < kWordRansLow || x_[lane] >= (kWordRansLow << 16)) throw BlockError(kBadState);
    }
    return ptr;
  }
  uint32_t next(uint32_t begin, uint32_t count, const uint8_t*& ptr, uint8_t* gap_tokens, uint8_t* value_tokens) {
    const uint32_t n = std::min(kWordLanes, count - begin);
    if (n == kWordLanes && begin != 0 && simd_ != WordSimd::kScalar) {
      word_group_simd(simd_, x_, gap_table_, value_table_, ptr, gap_tokens, value_tokens);
    } else {
      word_round(x_, gap_table_, ptr, gap_tokens, begin == 0 ? 1 : 0, n);
      word_round(x_, value_table_, ptr, value_tokens, 0, n);
    }
    return n;
  }
  bool finished() const {
    uint32_t differ = 0;
    for (uint32_t lane = 0; lane < kWordLanes; ++lane) differ |= x_[lane] ^ kWordRansLow;
    return differ == 0;
  }

 private:
  static thread_local WordSlotTable gap_table_, value_table_;
  WordSimd simd_;
  alignas(64) uint32_t x_[kWordLanes];
};
thread_local WordSlotTable WordLanes::gap_table_, WordLanes::value_table_;

// kBased false: no base (decoded against zeros; nothing is gathered or prefetched).
template <uint32_t W, class Lanes, bool kBased>
void decode_block_w(const BlockRecord& record, std::span<const uint8_t> payload, const uint8_t* base, uint64_t numel,
                    int64_t* positions, uint8_t* new_bits, uint8_t* base_bits) {
  const uint32_t count = record.count;
  const uint8_t* p = payload.data();
  const uint8_t* const tables_end = p + record.table_bytes;
  Model gap_model, value_model;
  read_model(p, tables_end, kGapTokens, count > 1, gap_model, "gap");
  read_model(p, tables_end, value_token_limit(W), true, value_model, "value");
  if (p != tables_end) throw BlockError("frequency tables have trailing bytes");

  if (record.rans_bytes < Lanes::kStateBytes) throw BlockError("rANS stream truncated");
  thread_local PaddedCopy rans_copy, raw_copy;
  const uint8_t* const rans_begin = rans_copy.fill(tables_end, record.rans_bytes, kRansPad);
  const uint8_t* const rans_end = rans_begin + record.rans_bytes;
  const uint8_t* const bits = raw_copy.fill(tables_end + record.rans_bytes, record.bits_bytes, kRawPad);
  const uint64_t bits_total = uint64_t{record.bits_bytes} * 8;

  Lanes lanes(gap_model, value_model);
  const uint8_t* ptr = lanes.start(rans_begin);

  uint64_t bit_at = 0;
  uint64_t position = record.first_position;
  const bool simd = simd_blocks_supported();
  alignas(64) std::array<uint8_t, kMaxChunk> gap_tokens, value_tokens;

  // Change j's base bits, prefetched kGatherLag changes ago. Without a base they are zeros
  // (written once here, when asked for at all).
  if (!kBased && base_bits != nullptr) std::memset(base_bits, 0, size_t{count} * W);
  const auto gather = [&](uint32_t j) __attribute__((always_inline)) {
    if constexpr (kBased) store_w<W>(base_bits + size_t{j} * W, load_w<W>(base + static_cast<uint64_t>(positions[j]) * W));
  };
  const auto prefetch = [&](uint64_t at) __attribute__((always_inline)) {
    if constexpr (kBased) __builtin_prefetch(base + at * W);
  };
  // New bits of the gathered changes [applied, to) from the value symbols parked in new_bits:
  // a loop of its own, because this lane-wise arithmetic vectorizes (the gather cannot).
  uint32_t applied = 0;
  const auto apply_until = [&](uint32_t to) {
    uint8_t* __restrict out = new_bits;
    const uint8_t* __restrict old = base_bits;
    for (uint32_t j = applied; j < to; ++j)
      store_w<W>(out + size_t{j} * W, apply_value_symbol(load_w<W>(out + size_t{j} * W), kBased ? load_w<W>(old + size_t{j} * W) : 0u, W));
    applied = to;
  };
  const auto check_raw = [&] {
    if (bit_at > bits_total) throw BlockError("raw bit stream truncated");
  };

  for (uint32_t begin = 0; begin < count;) {
    // Pass 1: tokens.
    const uint32_t n = lanes.next(begin, count, ptr, gap_tokens.data(), value_tokens.data());
    if ((begin != 0 || Lanes::kCheckFirstChunk) && ptr > rans_end) throw BlockError("rANS stream truncated");
    // Pass 2: raw bits, positions, value symbols (parked in new_bits until the change's gather).
    int64_t* const chunk_positions = positions + begin;
    uint8_t* const chunk_symbols = new_bits + size_t{begin} * W;
    uint32_t k = 0;
    if (begin == 0) {  // change 0: its position is the record's; only a value token
      const uint32_t vt = value_tokens[0];
      const uint32_t value_n = kTokenJoin.extra_bits[vt];
      const uint64_t symbol = kTokenJoin.base[vt] + raw_bits(bits, bit_at, value_n);
      bit_at += value_n;
      positions[0] = static_cast<int64_t>(position);
      prefetch(position);
      store_w<W>(new_bits, static_cast<uint32_t>(symbol));
      k = 1;
    }
    while (k < n) {
      // Sixteen changes at once where the CPU has AVX-512 (compact_block_simd.hpp); the loop
      // below is the reference, and codes what the group declines (its refusals included).
      if (simd && k + kSimdGroup <= n &&
          decode_raw_group(gap_tokens.data() + k, value_tokens.data() + k, bits, bit_at, position, numel, W, chunk_positions + k,
                           chunk_symbols + size_t{k} * W)) {
        for (const uint32_t end = k + kSimdGroup; k < end; ++k) {
          prefetch(static_cast<uint64_t>(chunk_positions[k]));
          if (begin + k >= kGatherLag) gather(begin + k - kGatherLag);
        }
        continue;
      }
      const uint32_t gt = gap_tokens[k], vt = value_tokens[k];
      const uint32_t gap_n = kTokenJoin.extra_bits[gt], value_n = kTokenJoin.extra_bits[vt];
      uint64_t gap_raw, value_raw;
      if (gap_n + value_n <= 56) [[likely]] {  // one load serves both (gaps below ~2^45)
        const uint64_t word = load_u64(bits + (bit_at >> 3)) >> (bit_at & 7);
        gap_raw = word & ((uint64_t{1} << gap_n) - 1);
        value_raw = (word >> gap_n) & ((uint64_t{1} << value_n) - 1);
      } else {
        gap_raw = raw_bits(bits, bit_at, gap_n);
        value_raw = raw_bits(bits, bit_at + gap_n, value_n);
      }
      bit_at += gap_n + value_n;
      const uint64_t gap = kTokenJoin.base[gt] + gap_raw;
      // position + 1 + gap < numel, written so that nothing can overflow.
      if (gap >= numel - position - 1) [[unlikely]] {
        check_raw();  // a gap read from past the end is a truncation, as a sequential reader saw it
        throw BlockError("gap after position " + std::to_string(position) + " leads outside the tensor (" +
                         std::to_string(numel) + " elements)");
      }
      position += gap + 1;
      chunk_positions[k] = static_cast<int64_t>(position);
      prefetch(position);
      store_w<W>(chunk_symbols + size_t{k} * W, static_cast<uint32_t>(kTokenJoin.base[vt] + value_raw));
      if (begin + k >= kGatherLag) gather(begin + k - kGatherLag);
      ++k;
    }
    check_raw();
    if (begin + n > kGatherLag) apply_until(begin + n - kGatherLag);
    begin += n;
  }
  for (uint32_t j = count > kGatherLag ? count - kGatherLag : 0; j < count; ++j) gather(j);
  apply_until(count);
  if (ptr != rans_end || !lanes.finished()) throw BlockError("rANS stream has trailing bytes or a bad final state");
  // Everything consumed but < 8 zero padding bits.
  if (bits_total - bit_at >= 8 || (bit_at < bits_total && (bits[bit_at >> 3] >> (bit_at & 7)) != 0))
    throw BlockError("raw bit stream has trailing bytes");
}

template <uint32_t W, bool kBased>
void decode_block_version(const BlockRecord& record, std::span<const uint8_t> payload, const uint8_t* base, uint64_t numel,
                          uint32_t version, int64_t* positions, uint8_t* new_bits, uint8_t* base_bits) {
  if (version == kFormatVersion2)
    decode_block_w<W, WordLanes, kBased>(record, payload, base, numel, positions, new_bits, base_bits);
  else
    decode_block_w<W, ByteLanes, kBased>(record, payload, base, numel, positions, new_bits, base_bits);
}

template <uint32_t W>
void decode_block_width(const BlockRecord& record, std::span<const uint8_t> payload, const uint8_t* base, uint64_t numel,
                        uint32_t version, int64_t* positions, uint8_t* new_bits, uint8_t* base_bits) {
  if (base == nullptr)
    decode_block_version<W, false>(record, payload, base, numel, version, positions, new_bits, base_bits);
  else
    decode_block_version<W, true>(record, payload, base, numel, version, positions, new_bits, base_bits);
}

}  // namespace

BlockRecord encode_block(const int64_t* positions, const uint8_t* new_bits, const uint8_t* base_bits,
                         uint32_t count, uint32_t width, uint32_t version, std::vector<uint8_t>& out) {
  BlockRecord record;
  record.first_position = static_cast<uint64_t>(positions[0]);
  record.payload_offset = out.size();
  record.count = count;
  switch (width) {
    case 1: encode_block_w<1>(positions, new_bits, base_bits, count, version, out, record); break;
    case 2: encode_block_w<2>(positions, new_bits, base_bits, count, version, out, record); break;
    case 4: encode_block_w<4>(positions, new_bits, base_bits, count, version, out, record); break;
    default: throw BlockError("unsupported element width " + std::to_string(width));
  }
  return record;
}

void decode_block(const BlockRecord& record, std::span<const uint8_t> payload, const uint8_t* base,
                  uint64_t numel, uint32_t width, uint32_t version, int64_t* positions, uint8_t* new_bits,
                  uint8_t* base_bits) {
  if (record.count == 0) throw BlockError("block has no changes");
  if (record.first_position >= numel)
    throw BlockError("first position " + std::to_string(record.first_position) + " is outside the tensor (" +
                     std::to_string(numel) + " elements)");
  switch (width) {
    case 1: decode_block_width<1>(record, payload, base, numel, version, positions, new_bits, base_bits); break;
    case 2: decode_block_width<2>(record, payload, base, numel, version, positions, new_bits, base_bits); break;
    case 4: decode_block_width<4>(record, payload, base, numel, version, positions, new_bits, base_bits); break;
    default: throw BlockError("unsupported element width " + std::to_string(width));
  }
}

}  // namespace deltasync::compact::detail
