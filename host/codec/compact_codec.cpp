// Tensor-level compact encode/decode: splits every changed tensor into blocks, runs the block
// coder one block per task, and validates a block index before any block is decoded.
#include <algorithm>
#include <string>
#include <unordered_map>

#include "codec/compact_codec_block.hpp"
#include "codec/compact_codec.hpp"
#include "core/error.hpp"
#include "core/parallel.hpp"

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

void check_block_elements(const Options& options) {
  if (options.block_elements == 0 || options.block_elements > (1u << 24))
    throw BadInputError("compact: block_elements must be in 1..16777216, got " + std::to_string(options.block_elements));
  if (!is_known_version(options.version))
    throw BadInputError("compact: unknown compact_version " + std::to_string(options.version) + " (1 or 2)");
}

}  // namespace

std::vector<EncodedTensor> encode(std::span<const TensorMeta> tensors, const DeltaView& delta,
                                  const Options& options) {
  check_block_elements(options);
  if (delta.num_tensors() != tensors.size())
    throw BadInputError("compact: delta has " + std::to_string(delta.num_tensors()) + " tensors, model has " +
                std::to_string(tensors.size()));
  if (tensors.empty()) return {};
  if (delta.value_offsets.size() != delta.offsets.size() || delta.values.size() != delta.value_offsets.back() ||
      delta.indices.size() != delta.total_changed())
    throw BadInputError("compact: delta arrays do not match their offsets");
  if (delta.total_changed() > 0 && delta.base_values.size() != delta.values.size())
    throw BadInputError("compact: delta lacks the base values the compact format encodes against");

  struct Task {
    size_t tensor;
    uint64_t first;  // index of the block's first change within the tensor
    uint32_t count;
  };
  std::vector<Task> tasks;
  std::vector<size_t> first_task(tensors.size() + 1, 0);
  for (size_t t = 0; t < tensors.size(); ++t) {
    first_task[t] = tasks.size();
    const uint64_t n = delta.count(t);
    const uint32_t width = tensors[t].width();
    if (n == 0) continue;
    if (width != 1 && width != 2 && width != 4)
      throw BadInputError("compact: tensor " + tensors[t].name + ": unsupported element width " + std::to_string(width));
    if (delta.value_offsets[t + 1] - delta.value_offsets[t] != n * width)
      throw BadInputError("compact: tensor " + tensors[t].name + ": value bytes do not match " + std::to_string(n) +
                  " changes of width " + std::to_string(width));
    for (uint64_t first = 0; first < n; first += options.block_elements)
      tasks.push_back({t, first, static_cast<uint32_t>(std::min<uint64_t>(options.block_elements, n - first))});
  }
  first_task[tensors.size()] = tasks.size();

  std::vector<std::vector<uint8_t>> payloads(tasks.size());
  std::vector<BlockRecord> records(tasks.size());
  run_tasks(tasks.size(), options, [&](size_t i) {
    const Task& task = tasks[i];
    const uint32_t width = tensors[task.tensor].width();
    const uint64_t at = delta.offsets[task.tensor] + task.first;
    const uint64_t byte_at = delta.value_offsets[task.tensor] + task.first * width;
    records[i] = detail::encode_block(delta.indices.data() + at, delta.values.data() + byte_at,
                                      delta.base_values.data() + byte_at, task.count, width, options.version,
                                      payloads[i]);
  });

  std::vector<EncodedTensor> out;
  for (size_t t = 0; t < tensors.size(); ++t) {
    if (first_task[t] == first_task[t + 1]) continue;
    EncodedTensor& e = out.emplace_back();
    e.name = tensors[t].name;
    e.changed = delta.count(t);
    e.version = options.version;
    const size_t num_blocks = first_task[t + 1] - first_task[t];
    e.block_index.resize(kIndexHeaderBytes + num_blocks * kRecordBytes);
    uint64_t offset = 0;
    for (size_t i = first_task[t]; i < first_task[t + 1]; ++i) {
      BlockRecord r = records[i];
      r.payload_offset = offset;
      offset += r.payload_bytes();
      write_record(r, e.block_index.data() + kIndexHeaderBytes + (i - first_task[t]) * kRecordBytes);
    }
    e.payload.reserve(offset);
    for (size_t i = first_task[t]; i < first_task[t + 1]; ++i) {
      e.payload.insert(e.payload.end(), payloads[i].begin(), payloads[i].end());
      std::vector<uint8_t>().swap(payloads[i]);
    }
    write_header(IndexHeader{e.changed, offset, options.block_elements, static_cast<uint32_t>(num_blocks)},
                         e.block_index.data());
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
    parsed.push_back(parse_block_index(e.block_index, e.payload, t, base_meta[t].numel(), where));
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
  s.indices.resize(s.offsets[T]);
  s.values.resize(s.value_offsets[T]);
  s.base_values.resize(s.value_offsets[T]);
  out.changed_names.clear();
  for (const EncodedTensorView& e : encoded) out.changed_names.emplace_back(e.name);

  struct Task {
    size_t parsed;
    size_t block;
    uint64_t first;  // index of the block's first change within the tensor
  };
  std::vector<Task> tasks;
  for (size_t i = 0; i < parsed.size(); ++i) {
    uint64_t first = 0;
    for (size_t b = 0; b < parsed[i].blocks.size(); ++b) {
      tasks.push_back({i, b, first});
      first += parsed[i].blocks[b].count;
    }
  }
  run_tasks(tasks.size(), options, [&](size_t k) {
    const Task& task = tasks[k];
    const ParsedBlockIndex& p = parsed[task.parsed];
    const size_t t = p.base_index;
    const uint32_t width = base_meta[t].width();
    const BlockRecord& r = p.blocks[task.block];
    const uint64_t at = s.offsets[t] + task.first;
    const uint64_t byte_at = s.value_offsets[t] + task.first * width;
    try {
      detail::decode_block(r, p.payload.subspan(r.payload_offset, r.payload_bytes()),
                           static_cast<const uint8_t*>(base[t].data), base[t].numel, width, p.version, s.indices.data() + at,
                           s.values.data() + byte_at, s.base_values.data() + byte_at);
    } catch (const BlockError& e) {
      throw BadInputError(label + ": tensor " + base_meta[t].name + ": block " + std::to_string(task.block) + ": " + e.what());
    }
  });

  // Blocks were decoded independently: positions must also ascend across their boundaries.
  for (const Task& task : tasks) {
    if (task.block == 0) continue;
    const size_t t = parsed[task.parsed].base_index;
    const uint64_t at = s.offsets[t] + task.first;
    if (s.indices[at] <= s.indices[at - 1])
      throw BadInputError(label + ": tensor " + base_meta[t].name + ": block " + std::to_string(task.block) +
                  " starts at position " + std::to_string(s.indices[at]) + ", not after the previous block's last (" +
                  std::to_string(s.indices[at - 1]) + ")");
  }
}

std::vector<PatchRef> DecodedDelta::patches(std::span<const TensorMeta> base_meta) const {
  std::vector<PatchRef> out(base_meta.size());
  const DeltaView view = storage.view();
  for (size_t t = 0; t < base_meta.size(); ++t) out[t] = view.patch(t, base_meta[t].width());
  return out;
}

}  // namespace deltasync::compact
