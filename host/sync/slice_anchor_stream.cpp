#include "sync/slice_anchor_stream.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>

#include "codec/digest.hpp"
#include "core/error.hpp"
#include "core/placement.hpp"
#include "engine/integrity.hpp"
#include "format/model_version.hpp"
#include "format/sha256.hpp"
#include "sync/shard_parts.hpp"

namespace deltasync {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

struct Slice {
  size_t part = 0;
  uint64_t begin = 0, end = 0;  // in the part's data section
  Placement placement;
  uint64_t recorded = 0;  // its slice_digests entry
};

struct Whole {
  TensorMeta meta;
  std::vector<Slice> slices;
};

// One part as its header describes it; read front to back as the groups go by.
struct PartReader {
  std::string key, label;
  uint64_t data_start = 0, data_size = 0;
  uint64_t cursor = 0;               // data bytes read so far
  std::vector<size_t> order;         // its slices' tensors (indices into the wholes), by offset
  Sha256 sha;
};

std::vector<uint8_t> fetch_range(Store& store, const std::string& key, uint64_t offset, uint64_t length, const std::string& label,
                                 SliceStreamStats& stats) {
  const auto t0 = Clock::now();
  std::vector<uint8_t> bytes = store.get_range(key, offset, length);
  if (bytes.size() != length)
    throw BadInputError(label + ": ended at byte " + std::to_string(offset + bytes.size()) + ", its tensor table needs " +
                        std::to_string(offset + length));
  stats.bytes_fetched += length;
  stats.fetch_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
  return bytes;
}

std::vector<uint64_t> parse_shape(const json& j, const std::string& where) {
  if (!j.is_array()) throw BadInputError(where + " has a malformed shape");
  std::vector<uint64_t> out;
  for (const auto& d : j) {
    if (!d.is_number_unsigned()) throw BadInputError(where + " has a malformed shape");
    out.push_back(d.get<uint64_t>());
  }
  return out;
}

// Reads part `k`'s header and adds its slices to `wholes` (tensor name -> position in `at`).
PartReader read_part_header(Store& store, const protocol::Manifest& manifest, size_t k, std::vector<Whole>& wholes,
                            std::map<std::string, size_t, std::less<>>& at, SliceStreamStats& stats) {
  const protocol::ObjectRef& o = manifest.anchor_parts[k];
  PartReader r;
  r.key = o.key;
  r.label = store.describe(o.key);
  if (o.size < 8) throw BadInputError(r.label + ": size " + std::to_string(o.size) + " is too small for a safetensors file");
  const std::vector<uint8_t> head = fetch_range(store, o.key, 0, 8, r.label, stats);
  uint64_t n = 0;
  for (int b = 7; b >= 0; --b) n = (n << 8) | head[static_cast<size_t>(b)];
  if (n == 0 || n > o.size - 8 || n > (uint64_t{100} << 20)) throw BadInputError(r.label + ": bad safetensors header length");
  const std::vector<uint8_t> header = fetch_range(store, o.key, 8, n, r.label, stats);
  r.sha.update(head);
  r.sha.update(header);
  r.data_start = 8 + n;
  r.data_size = o.size - r.data_start;

  const json j = json::parse(header.begin(), header.end(), nullptr, false);
  if (!j.is_object()) throw BadInputError(r.label + ": header is not a JSON object");
  st::Metadata md;
  if (auto m = j.find("__metadata__"); m != j.end()) {
    if (!m->is_object()) throw BadInputError(r.label + ": __metadata__ is not an object");
    for (const auto& [key, value] : m->items()) {
      if (!value.is_string()) throw BadInputError(r.label + ": metadata " + key + " is not a string");
      md.emplace(key, value.get<std::string>());
    }
  }
  const std::optional<uint64_t> version = read_model_version(md, r.label);
  if (version != manifest.version)
    throw BadInputError(r.label + ": anchor part is for version " + (version ? std::to_string(*version) : std::string("unknown")) +
                        ", expected " + std::to_string(manifest.version));
  if (!md.count(shard_keys::kPlacements))
    throw Error(r.label + ": a part of whole tensors among parts of slices", ErrorKind::kUnsupported);
  const json placements = json::parse(md.at(shard_keys::kPlacements), nullptr, false);
  if (!placements.is_object()) throw BadInputError(r.label + ": metadata placements is not a JSON object");
  const auto recorded = integrity::read_digest_map(md, shard_keys::kSliceDigests, r.label);
  if (!recorded) throw BadInputError(r.label + ": anchor slices without slice_digests");

  struct Entry {
    Slice slice;
    TensorMeta meta;
  };
  std::vector<Entry> entries;
  for (const auto& [name, v] : j.items()) {
    if (name == "__metadata__") continue;
    const std::string where = r.label + ": tensor " + name;
    const bool ok = v.is_object() && v.contains("dtype") && v["dtype"].is_string() && v.contains("shape") &&
                    v.contains("data_offsets") && v["data_offsets"].is_array() && v["data_offsets"].size() == 2 &&
                    v["data_offsets"][0].is_number_unsigned() && v["data_offsets"][1].is_number_unsigned();
    if (!ok) throw BadInputError(where + " has a malformed header entry");
    const auto dtype = dtype_from_name(v["dtype"].get<std::string>());
    if (!dtype || !is_weight_dtype(*dtype)) throw BadInputError(where + " has no weight dtype");
    const std::vector<uint64_t> local_shape = parse_shape(v["shape"], where);
    uint64_t local = 1;
    for (uint64_t d : local_shape) local *= d;
    const auto e = placements.find(name);
    if (e == placements.end() || !e->is_object() || !e->contains("shape") || !e->contains("placement"))
      throw BadInputError(where + " has no placement entry");
    const TensorMeta meta{name, *dtype, parse_shape((*e)["shape"], where)};
    const std::optional<Placement> pl = placement_from_json((*e)["placement"]);
    if (!pl) throw BadInputError(where + " has a malformed placement");
    if (local != pl->numel())
      throw BadInputError(where + " holds " + std::to_string(local) + " elements, its placement " + placement_text(*pl) + " " +
                          std::to_string(pl->numel()));
    if (pl->numel() && (pl->run_length > meta.numel() || pl->end() > meta.numel() || (pl->run_count > 1 && pl->run_stride < pl->run_length)))
      throw BadInputError(where + ": placement " + placement_text(*pl) + " does not fit its " + std::to_string(meta.numel()) + " elements");
    Slice s{k, v["data_offsets"][0].get<uint64_t>(), v["data_offsets"][1].get<uint64_t>(), *pl, 0};
    if (s.end < s.begin || s.end - s.begin != local * meta.width() || s.end > r.data_size)
      throw BadInputError(where + ": data offsets [" + std::to_string(s.begin) + ", " + std::to_string(s.end) +
                          ") disagree with its dtype, shape or the part's size");
    const auto d = recorded->find(name);
    if (d == recorded->end()) throw BadInputError(where + " has no slice_digests entry");
    s.recorded = d->second;
    entries.push_back(Entry{s, meta});
  }
  // In data order (the JSON object iterates by name): the order tensors first appear in, and the
  // order the part is read in. Its data section is the slices, back to back: read front to back,
  // every byte is hashed once.
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) { return a.slice.begin < b.slice.begin; });
  uint64_t next = 0;
  for (const auto& [s, meta] : entries) {
    const std::string where = r.label + ": tensor " + meta.name;
    if (s.begin != next)
      throw BadInputError(where + " starts at data byte " + std::to_string(s.begin) + ", not " + std::to_string(next) +
                          " (the tensor table leaves a gap or overlaps)");
    next = s.end;
    auto [it, fresh] = at.emplace(meta.name, wholes.size());
    if (fresh) wholes.push_back(Whole{meta, {}});
    Whole& w = wholes[it->second];
    if (w.meta.dtype != meta.dtype || w.meta.shape != meta.shape)
      throw BadInputError(where + " is " + std::string(dtype_name(meta.dtype)) + shape_text(meta.shape) + " here, " +
                          std::string(dtype_name(w.meta.dtype)) + shape_text(w.meta.shape) + " in another part");
    w.slices.push_back(s);
    r.order.push_back(it->second);
  }
  if (next != r.data_size)
    throw BadInputError(r.label + ": its tensors end at data byte " + std::to_string(next) + ", the part at " + std::to_string(r.data_size));
  return r;
}

}  // namespace

SliceStreamStats stream_slice_anchor(Store& store, const protocol::Manifest& manifest, uint64_t group_bytes,
                                     const TensorGroupWriter& write) {
  const std::string label = "anchor of version " + std::to_string(manifest.version);
  SliceStreamStats stats;
  std::vector<Whole> wholes;  // tensors in first appearance order: the order they go out in
  std::map<std::string, size_t, std::less<>> at;
  std::vector<PartReader> parts;
  for (size_t k = 0; k < manifest.anchor_parts.size(); ++k) parts.push_back(read_part_header(store, manifest, k, wholes, at, stats));

  // The whole anchor checked from its headers before a tensor byte moves.
  for (const Whole& w : wholes) {
    std::vector<Placement> pls;
    std::vector<std::string> names;
    for (const Slice& s : w.slices) {
      pls.push_back(s.placement);
      names.push_back("part " + parts[s.part].label);
    }
    check_tiling(pls, names, w.meta.numel(), w.meta.name, label);
    if (manifest.digests.empty()) continue;
    uint64_t sum = 0;
    for (const Slice& s : w.slices) sum += s.recorded;
    const auto it = manifest.digests.find(w.meta.name);
    if (it == manifest.digests.end()) throw BadInputError(label + ": tensor " + w.meta.name + " is not part of version " + std::to_string(manifest.version));
    if (it->second != digest_to_hex(sum))
      throw BadInputError(label + ": anchor does not match its manifest: tensor " + w.meta.name + " slices add up to digest " +
                          digest_to_hex(sum) + ", version " + std::to_string(manifest.version) + "'s is " + it->second);
  }
  if (!manifest.digests.empty() && wholes.size() != manifest.digests.size())
    throw BadInputError(label + ": holds " + std::to_string(wholes.size()) + " tensors, its manifest " + std::to_string(manifest.digests.size()));
  for (const PartReader& p : parts)
    for (size_t i = 1; i < p.order.size(); ++i)
      if (p.order[i] < p.order[i - 1])
        throw Error(p.label + ": holds tensors " + wholes[p.order[i - 1]].meta.name + " and " + wholes[p.order[i]].meta.name +
                        " in another order than the parts before it (not streamed)",
                    ErrorKind::kUnsupported);

  // Groups in that order; each part's share of a group is its next run of slices.
  std::vector<size_t> position(parts.size(), 0);  // next index into parts[k].order
  for (size_t first = 0; first < wholes.size();) {
    size_t last = first;
    uint64_t bytes = 0;
    auto size_of = [&](size_t t) { return wholes[t].meta.numel() * wholes[t].meta.width(); };
    while (last < wholes.size() && (last == first || bytes + size_of(last) <= group_bytes)) bytes += size_of(last++);
    std::vector<std::vector<uint8_t>> full(last - first);
    for (size_t t = first; t < last; ++t) full[t - first].resize(wholes[t].meta.numel() * wholes[t].meta.width());
    std::vector<uint64_t> digests(last - first, 0);
    for (size_t k = 0; k < parts.size(); ++k) {
      PartReader& p = parts[k];
      size_t end = position[k];
      while (end < p.order.size() && p.order[end] < last) ++end;
      if (end == position[k]) continue;
      // The slices of tensors [position, end) of this part are the bytes from its cursor on.
      std::vector<const Slice*> mine;
      for (size_t i = position[k]; i < end; ++i)
        for (const Slice& s : wholes[p.order[i]].slices)
          if (s.part == k) mine.push_back(&s);
      const uint64_t length = mine.back()->end - p.cursor;
      const std::vector<uint8_t> chunk = fetch_range(store, p.key, p.data_start + p.cursor, length, p.label, stats);
      p.sha.update(chunk);
      std::vector<ConstTensorRef> refs;
      std::vector<Placement> pls;
      for (const Slice* s : mine) {
        const Whole& w = wholes[p.order[position[k] + refs.size()]];
        refs.push_back(ConstTensorRef{w.meta.name, chunk.data() + (s->begin - p.cursor), s->placement.numel(), w.meta.width()});
        pls.push_back(s->placement);
      }
      const std::vector<uint64_t> partials = digest_placed_tensors(refs, pls);
      for (size_t i = 0; i < mine.size(); ++i) {
        const size_t t = p.order[position[k] + i];
        if (partials[i] != mine[i]->recorded)
          throw BadInputError(p.label + ": slice of tensor " + wholes[t].meta.name + " does not match its recorded digest");
        const Placement& pl = mine[i]->placement;
        const uint32_t width = wholes[t].meta.width();
        const uint8_t* src = static_cast<const uint8_t*>(refs[i].data);
        uint8_t* dst = full[t - first].data();
        for (uint64_t run = 0; run < pl.run_count; ++run)
          std::memcpy(dst + (pl.first + run * pl.run_stride) * width, src + run * pl.run_length * width, pl.run_length * width);
        digests[t - first] += partials[i];  // the slices tile the tensor: their partials add up to its digest
      }
      p.cursor = mine.back()->end;
      position[k] = end;
    }
    std::vector<TensorMeta> meta;
    std::vector<std::span<const uint8_t>> spans;
    for (size_t t = first; t < last; ++t) {
      meta.push_back(wholes[t].meta);
      spans.emplace_back(full[t - first]);
      stats.elements += wholes[t].meta.numel();
    }
    write(meta, spans, digests);
    first = last;
  }
  // Every byte of every part has now been read once: the parts are what the manifest names.
  for (size_t k = 0; k < parts.size(); ++k) {
    PartReader& p = parts[k];
    if (p.cursor != p.data_size) throw BadInputError(p.label + ": " + std::to_string(p.data_size - p.cursor) + " data bytes never read");
    if (to_hex(p.sha.finish()) != manifest.anchor_parts[k].sha256)
      throw BadInputError(p.label + ": sha256 differs from the manifest's (corrupt object)");
  }
  return stats;
}

}  // namespace deltasync
