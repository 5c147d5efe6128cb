// Tensor-level compact encode/decode: splits every changed tensor into blocks, runs the block
// coder one block per task, and validates a block index before any block is decoded.
#include <algorithm>
#include <string>
#include <unordered_map>

#include "codec/compact_codec_block.hpp"
#include "codec/compact_codec.hpp"
#include "codec/compact_tile_order.hpp"
#include "core/error.hpp"
#include "core/parallel.hpp"
#include "core/scratch.hpp"

namespace deltasync::compact {
namespace {

using detail::BlockError;

void run_tasks(size_t n, const Options& options, const std::function<void(size_t)>& fn) {
  if (options.parallel && n > 1) {
    parallel_for(n, fn);
  } else {
    for (size_t i = 0; i < n; ++i) fn(i);
  }
}

void check_options(const Options& options) {
  if (options.block_elements == 0 || options.block_elements > (1u << 24))
    throw BadInputError("compact: block_elements must be in 1..16777216, got " + std::to_string(options.block_elements));
  if (!is_known_version(options.version))
    throw BadInputError("compact: unknown compact_version " + std::to_string(options.version) + " (1 or 2)");
  if (!is_tile_count(options.max_tiles))
    throw BadInputError("compact: max_tiles must be 1, 2, 4 or 8, got " + std::to_string(options.max_tiles));
}

}  // namespace

std::vector<EncodedTensor> encode(std::span<const TensorMeta> tensors, const DeltaView& delta,
                                  const Options& options) {
  check_options(options);
  if (delta.num_tensors() != tensors.size())
    throw BadInputError("compact: delta has " + std::to_string(delta.num_tensors()) + " tensors, model has " +
                std::to_string(tensors.size()));
  if (tensors.empty()) return {};
  if (delta.value_offsets.size() != delta.offsets.size() || delta.values.size() != delta.value_offsets.back() ||
      delta.indices.size() != delta.total_changed())
    throw BadInputError("compact: delta arrays do not match their offsets");
  if (delta.total_changed() > 0 && delta.base_values.size() != delta.values.size())
    throw BadInputError("compact: delta lacks the base values the compact format encodes against");

  std::vector<TileGeometry> tiles(tensors.size());
  for (size_t t = 0; t < tensors.size(); ++t) {
    const uint64_t n = delta.count(t);
    const uint32_t width = tensors[t].width();
    if (n == 0) continue;
    if (width != 1 && width != 2 && width != 4)
      throw BadInputError("compact: tensor " + tensors[t].name + ": unsupported element width " + std::to_string(width));
    if (delta.value_offsets[t + 1] - delta.value_offsets[t] != n * width)
      throw BadInputError("compact: tensor " + tensors[t].name + ": value bytes do not match " + std::to_string(n) +
                  " changes of width " + std::to_string(width));
    tiles[t] = choose_tiles(tensors[t].shape, n, options.block_elements, options.max_tiles);
  }

  // Tasks: a block of a tensor without bands (its changes are in coded order where they are),
  // or a stripe of a banded tensor, whose changes split_stripe routes to its bands' blocks
  // (compact_tile_order.hpp). Each block lands in its tile's list, in order.
  struct Block {
    BlockRecord record;
    std::vector<uint8_t> payload;
  };
  struct Task {
    size_t tensor;
    uint32_t tile;   // the block's tile; a banded stripe task: the stripe
    uint64_t first;  // the block's first change in the tensor (coded order = flat order)
    uint32_t count;  // 0: a banded stripe task
    size_t block;    // the block's place in its tile
  };
  std::vector<std::vector<std::vector<Block>>> blocks(tensors.size());  // tensor -> tile -> blocks
  std::vector<Task> tasks;
  for (size_t t = 0; t < tensors.size(); ++t) {
    const uint64_t n = delta.count(t);
    if (n == 0) continue;
    const TileGeometry& g = tiles[t];
    blocks[t].resize(g.tiles());
    if (g.bands > 1) {
      for (uint32_t s = 0; s < g.stripes; ++s) tasks.push_back({t, s, 0, 0, 0});
      continue;
    }
    // Blocks of block_elements changes, none crossing a tile (here: stripe) boundary.
    const std::vector<uint64_t> starts = stripe_starts(g, delta.indices.subspan(delta.offsets[t], n));
    for (uint32_t tile = 0; tile < g.tiles(); ++tile) {
      size_t in_tile = 0;
      for (uint64_t first = starts[tile]; first < starts[tile + 1]; first += options.block_elements)
        tasks.push_back(
            {t, tile, first, static_cast<uint32_t>(std::min<uint64_t>(options.block_elements, starts[tile + 1] - first)), in_tile++});
      blocks[t][tile].resize(in_tile);
    }
  }
  run_tasks(tasks.size(), options, [&](size_t i) {
    const Task& task = tasks[i];
    const size_t t = task.tensor;
    const TileGeometry& g = tiles[t];
    const uint32_t width = tensors[t].width();
    const int64_t* positions = delta.indices.data() + delta.offsets[t];
    const uint8_t* new_bits = delta.values.data() + delta.value_offsets[t];
    const uint8_t* base_bits = delta.base_values.data() + delta.value_offsets[t];
    if (task.count == 0) {
      split_stripe(g, task.tile, delta.indices.subspan(delta.offsets[t], delta.count(t)), new_bits, base_bits, width,
                   options.block_elements, [&](uint32_t k, const int64_t* q, const uint8_t* n, const uint8_t* b, uint32_t count) {
                     Block& block = blocks[t][k * g.stripes + task.tile].emplace_back();
                     block.record = detail::encode_block(q, n, b, count, width, options.version, block.payload);
                   });
      return;
    }
    Block& block = blocks[t][task.tile][task.block];
    block.record = detail::encode_block(positions + task.first, new_bits + task.first * width, base_bits + task.first * width,
                                        task.count, width, options.version, block.payload);
  });

  std::vector<EncodedTensor> out;
  for (size_t t = 0; t < tensors.size(); ++t) {
    if (blocks[t].empty()) continue;
    EncodedTensor& e = out.emplace_back();
    e.name = tensors[t].name;
    e.changed = delta.count(t);
    e.version = options.version;
    e.index_version = options.index_version();
    BlockRecords index;
    index.index_version = e.index_version;
    index.block_elements = options.block_elements;
    index.tiles = tiles[t];
    uint64_t offset = 0;
    for (const std::vector<Block>& tile : blocks[t])
      for (const Block& block : tile) {
        BlockRecord r = block.record;
        r.payload_offset = offset;
        offset += r.payload_bytes();
        index.blocks.push_back(r);
      }
    e.block_index = write_block_index(index);
    e.payload.reserve(offset);
    for (std::vector<Block>& tile : blocks[t])
      for (Block& block : tile) {
        e.payload.insert(e.payload.end(), block.payload.begin(), block.payload.end());
        std::vector<uint8_t>().swap(block.payload);
      }
  }
  return out;
}

std::vector<ParsedBlockIndex> parse_encoded_tensors(std::span<const EncodedTensorView> encoded,
                                                    std::span<const TensorMeta> base_meta,
                                                    std::span<const ConstTensorRef> base, const std::string& label) {
  if (base.size() != base_meta.size())
    throw BadInputError(label + ": " + std::to_string(base.size()) + " base tensors for " + std::to_string(base_meta.size()) +
                " descriptions");
  std::unordered_map<std::string_view, size_t> by_name;
  for (size_t t = 0; t < base_meta.size(); ++t) {
    if (base[t].numel != base_meta[t].numel() || base[t].width != base_meta[t].width())
      throw BadInputError(label + ": base tensor " + base_meta[t].name + " does not match its description");
    by_name.emplace(base_meta[t].name, t);
  }

  std::vector<ParsedBlockIndex> parsed;
  std::vector<bool> seen(base_meta.size(), false);
  parsed.reserve(encoded.size());
  for (const EncodedTensorView& e : encoded) {
    const std::string where = label + ": tensor " + std::string(e.name);
    const auto it = by_name.find(e.name);
    if (it == by_name.end()) throw BadInputError(where + " is not in the base model");
    const size_t t = it->second;
    if (seen[t]) throw BadInputError(where + " appears twice");
    seen[t] = true;
    const uint32_t width = base_meta[t].width();
    if (width != 1 && width != 2 && width != 4)
      throw BadInputError(where + ": unsupported element width " + std::to_string(width));
    if (!is_known_version(e.version)) throw BadInputError(where + ": unknown compact_version " + std::to_string(e.version));
    parsed.push_back(parse_block_index(e.block_index, e.payload, t, base_meta[t].shape, e.index_version, where));
    parsed.back().version = e.version;
  }

  return parsed;
}

void layout_offsets(std::span<const ParsedBlockIndex> parsed, std::span<const TensorMeta> base_meta,
                    std::vector<uint64_t>& offsets, std::vector<uint64_t>& value_offsets) {
  const size_t T = base_meta.size();
  std::vector<uint64_t> changed(T, 0);
  for (const ParsedBlockIndex& p : parsed) changed[p.base_index] = p.changed;
  offsets.assign(T + 1, 0);
  value_offsets.assign(T + 1, 0);
  for (size_t t = 0; t < T; ++t) {
    offsets[t + 1] = offsets[t] + changed[t];
    value_offsets[t + 1] = value_offsets[t] + changed[t] * base_meta[t].width();
  }
}

void decode(std::span<const EncodedTensorView> encoded, std::span<const TensorMeta> base_meta,
            std::span<const ConstTensorRef> base, const std::string& label, DecodedDelta& out,
            const Options& options) {
  const std::vector<ParsedBlockIndex> parsed = parse_encoded_tensors(encoded, base_meta, base, label);
  SparseDelta& s = out.storage;
  layout_offsets(parsed, base_meta, s.offsets, s.value_offsets);
  const size_t T = base_meta.size();
  resize_scratch(s.indices, s.offsets[T]);
  resize_scratch(s.values, s.value_offsets[T]);
  // Decoding against no base at all (compact_two_phase.hpp) has no base bits to give: none are
  // written (they would be zeros), which spares a receiver a pass over 2 bytes per change.
  const bool unbased = std::all_of(base.begin(), base.end(), [](const ConstTensorRef& b) { return b.data == nullptr; });
  if (unbased)
    s.base_values.clear();
  else
    resize_scratch(s.base_values, s.value_offsets[T]);
  out.changed_names.clear();
  for (const EncodedTensorView& e : encoded) out.changed_names.emplace_back(e.name);

  // Tasks: one block of an untiled tensor, decoded where the layout puts it; or one row stripe of
  // a banded tensor: the blocks of the stripe's tiles (one per band) decoded in coded order into
  // a scratch buffer from the pool, checked, and merged into flat order (merge_stripe) while the
  // scratch is still in cache. A stripe at 15% changed of a 2048 x 1024 projection is ~40K changes
  // (~400 KB of scratch): decoding all of a tensor's blocks first and merging afterwards moved
  // the whole tensor's coded changes through memory twice more.
  struct Task {
    size_t parsed;
    uint32_t stripe;  // banded tensors: the stripe; else the block
  };
  std::vector<Task> tasks;
  for (size_t i = 0; i < parsed.size(); ++i) {
    const uint32_t n = parsed[i].tiles.bands > 1 ? parsed[i].tiles.stripes : static_cast<uint32_t>(parsed[i].blocks.size());
    for (uint32_t k = 0; k < n; ++k) tasks.push_back({i, k});
  }
  // Per banded tensor: each tile's first block and first change (in coded order, from the block
  // records, whose first positions parse_block_index found strictly ascending: so are their tiles).
  // Per untiled tensor: each block's first change.
  std::vector<std::vector<uint64_t>> tile_block(parsed.size()), tile_starts(parsed.size()), block_first(parsed.size());
  for (size_t i = 0; i < parsed.size(); ++i) {
    const ParsedBlockIndex& p = parsed[i];
    std::vector<uint64_t>& firsts = block_first[i];
    firsts.assign(p.blocks.size() + 1, 0);
    for (size_t b = 0; b < p.blocks.size(); ++b) firsts[b + 1] = firsts[b] + p.blocks[b].count;
    if (p.tiles.bands == 1) continue;
    tile_block[i].assign(p.tiles.tiles() + 1, p.blocks.size());
    tile_starts[i].assign(p.tiles.tiles() + 1, p.changed);
    size_t b = 0;
    for (uint32_t tile = 0; tile < p.tiles.tiles(); ++tile) {
      while (b < p.blocks.size() && p.tiles.tile_of(p.blocks[b].first_position) < tile) ++b;
      tile_block[i][tile] = b;
      tile_starts[i][tile] = firsts[b];
    }
  }
  // Each block's positions ascend (decode_block); across blocks, and inside tiles, they are checked
  // here. `previous_last`: the last position of the block before in the same tile (nullptr for a
  // tile's first block: tiles are disjoint, and the blocks' first positions, hence their tiles,
  // ascend). Returns the refusal, or an empty string.
  const auto check_block = [&](const ParsedBlockIndex& p, size_t b, const int64_t* positions, const int64_t* previous_last) {
    const auto block = [&] { return label + ": tensor " + base_meta[p.base_index].name + ": block " + std::to_string(b); };
    if (previous_last != nullptr && positions[0] <= *previous_last)
      return block() + " starts at position " + std::to_string(positions[0]) + ", not after the previous block's last (" +
             std::to_string(*previous_last) + ")";
    const auto first = static_cast<uint64_t>(positions[0]);
    const auto last = static_cast<uint64_t>(positions[p.blocks[b].count - 1]);
    if (p.tiles.tiles() > 1 && p.tiles.tile_of(first) != p.tiles.tile_of(last))
      return block() + " crosses a tile boundary (positions " + std::to_string(first) + " to " + std::to_string(last) + ")";
    return std::string();
  };
  // Refusals are recorded per block and reported after every task, as one decoder running the
  // blocks in order would (and the GPU decoder does): the first block that fails to decode, else
  // the first that fails its checks -- the same refusal whatever the threads did.
  std::vector<std::vector<std::string>> decode_fault(parsed.size()), check_fault(parsed.size());
  for (size_t i = 0; i < parsed.size(); ++i) {
    decode_fault[i].resize(parsed[i].blocks.size());
    if (parsed[i].tiles.bands > 1) check_fault[i].resize(parsed[i].blocks.size());
  }
  const auto decode_one = [&](const ParsedBlockIndex& p, size_t i, size_t b, const uint8_t* block_base, int64_t* positions,
                              uint8_t* values, uint8_t* base_values) {
    const size_t t = p.base_index;
    const BlockRecord& r = p.blocks[b];
    try {
      detail::decode_block(r, p.payload.subspan(r.payload_offset, r.payload_bytes()), block_base, base[t].numel,
                           base_meta[t].width(), p.version, positions, values, base_values);
      return true;
    } catch (const BlockError& e) {
      decode_fault[i][b] = label + ": tensor " + base_meta[t].name + ": block " + std::to_string(b) + ": " + e.what();
      return false;
    }
  };
  // Untiled tensors: each block's last position, for the check against the next block afterwards.
  std::vector<std::vector<int64_t>> block_last(parsed.size());
  for (size_t i = 0; i < parsed.size(); ++i)
    if (parsed[i].tiles.bands == 1) block_last[i].assign(parsed[i].blocks.size(), 0);
  StripeScratchPool& pool = *out.stripe_scratch;
  run_tasks(tasks.size(), options, [&](size_t k) {
    const Task& task = tasks[k];
    const ParsedBlockIndex& p = parsed[task.parsed];
    const size_t t = p.base_index;
    const uint32_t width = base_meta[t].width();
    if (p.tiles.bands == 1) {
      const size_t b = task.stripe;
      const uint64_t first = block_first[task.parsed][b];
      int64_t* positions = s.indices.data() + s.offsets[t] + first;
      if (decode_one(p, task.parsed, b, static_cast<const uint8_t*>(base[t].data), positions,
                     s.values.data() + s.value_offsets[t] + first * width,
                     unbased ? nullptr : s.base_values.data() + s.value_offsets[t] + first * width))
        block_last[task.parsed][b] = positions[p.blocks[b].count - 1];
      return;
    }
    // The stripe's tiles in coded order (band by band), decoded without a base into scratch with
    // the merge's slack; their tile starts relative to the scratch at the slots merge_stripe reads.
    const TileGeometry& g = p.tiles;
    const std::vector<uint64_t>& starts = tile_starts[task.parsed];
    std::vector<uint64_t> local_starts(g.tiles() + 1, 0);
    uint64_t changes = 0;
    for (uint32_t band = 0; band < g.bands; ++band) {
      const uint32_t tile = band * g.stripes + task.stripe;
      local_starts[tile] = changes;
      changes += starts[tile + 1] - starts[tile];
      local_starts[tile + 1] = changes;
    }
    std::unique_ptr<StripeScratchPool::Buffer> scratch = pool.take(changes + kMergeSlack, (changes + kMergeSlack) * width);
    struct GiveBack {
      StripeScratchPool& pool;
      std::unique_ptr<StripeScratchPool::Buffer>& buffer;
      ~GiveBack() { pool.give(std::move(buffer)); }
    } give_back{pool, scratch};
    // Blocks in increasing order. A decode failure ends the stripe (no later block of it can be
    // the first); after a failed check the rest still decode (a decode failure outranks it) but
    // are not checked; a stripe with either is not merged.
    bool refused = false;
    for (uint32_t band = 0; band < g.bands; ++band) {
      const uint32_t tile = band * g.stripes + task.stripe;
      uint64_t at = local_starts[tile];
      const int64_t* previous_last = nullptr;
      for (size_t b = tile_block[task.parsed][tile]; b < tile_block[task.parsed][tile + 1]; ++b) {
        int64_t* positions = scratch->positions.data() + at;
        if (!decode_one(p, task.parsed, b, nullptr, positions, scratch->values.data() + at * width, nullptr)) return;
        if (!refused) {
          check_fault[task.parsed][b] = check_block(p, b, positions, previous_last);
          refused = !check_fault[task.parsed][b].empty();
        }
        previous_last = positions + p.blocks[b].count - 1;
        at += p.blocks[b].count;
      }
    }
    if (refused) return;
    uint64_t stripe_first = 0;  // the stripe's first change in flat order: the changes of the stripes before
    for (uint32_t st = 0; st < task.stripe; ++st)
      for (uint32_t band = 0; band < g.bands; ++band) stripe_first += starts[band * g.stripes + st + 1] - starts[band * g.stripes + st];
    const CodedChanges coded{{scratch->positions.data(), changes + kMergeSlack}, {scratch->values.data(), (changes + kMergeSlack) * width}, {}};
    const uint64_t at = s.offsets[t] + stripe_first;
    merge_stripe(g, task.stripe, local_starts, coded, width, std::span(s.indices).subspan(at, changes),
                 std::span(s.values).subspan(s.value_offsets[t] + stripe_first * width, changes * width),
                 unbased ? std::span<uint8_t>() : std::span(s.base_values).subspan(s.value_offsets[t] + stripe_first * width, changes * width),
                 static_cast<const uint8_t*>(base[t].data));
  });
  for (size_t i = 0; i < parsed.size(); ++i)
    for (const std::string& fault : decode_fault[i])
      if (!fault.empty()) throw BadInputError(fault);
  for (size_t i = 0; i < parsed.size(); ++i) {
    const ParsedBlockIndex& p = parsed[i];
    const int64_t* positions = s.indices.data() + s.offsets[p.base_index];
    for (size_t b = 0; b < p.blocks.size(); ++b) {
      const std::string fault = p.tiles.bands > 1 ? check_fault[i][b]
                                                  : check_block(p, b, positions + block_first[i][b], b > 0 ? &block_last[i][b - 1] : nullptr);
      if (!fault.empty()) throw BadInputError(fault);
    }
  }
}

std::unique_ptr<StripeScratchPool::Buffer> StripeScratchPool::take(size_t changes, size_t value_bytes) {
  std::unique_ptr<Buffer> buffer;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // The smallest buffer that is large enough, else the largest (grown below): big buffers stay
    // as few as big stripes in flight.
    size_t pick = free_.size();
    for (size_t k = 0; k < free_.size(); ++k) {
      const bool fits = free_[k]->positions.size() >= changes && free_[k]->values.size() >= value_bytes;
      const bool pick_fits = pick < free_.size() && free_[pick]->positions.size() >= changes && free_[pick]->values.size() >= value_bytes;
      if (pick == free_.size() || (fits && (!pick_fits || free_[k]->positions.size() < free_[pick]->positions.size())) ||
          (!fits && !pick_fits && free_[k]->positions.size() > free_[pick]->positions.size()))
        pick = k;
    }
    if (pick < free_.size()) {
      buffer = std::move(free_[pick]);
      free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(pick));
    }
  }
  if (!buffer) buffer = std::make_unique<Buffer>();
  // Grown only (a smaller stripe uses it as it is), without copying what it held.
  if (buffer->positions.size() < changes) resize_scratch(buffer->positions, changes);
  if (buffer->values.size() < value_bytes) resize_scratch(buffer->values, value_bytes);
  return buffer;
}

void StripeScratchPool::give(std::unique_ptr<Buffer> buffer) {
  if (!buffer) return;
  std::lock_guard<std::mutex> lock(mutex_);
  free_.push_back(std::move(buffer));
}

std::vector<PatchRef> DecodedDelta::patches(std::span<const TensorMeta> base_meta) const {
  std::vector<PatchRef> out(base_meta.size());
  const DeltaView view = storage.view();
  for (size_t t = 0; t < base_meta.size(); ++t) out[t] = view.patch(t, base_meta[t].width());
  return out;
}

}  // namespace deltasync::compact
