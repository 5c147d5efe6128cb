#include "sync/mapped_receiver.hpp"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "codec/compact_codec.hpp"
#include "codec/compact_two_phase.hpp"
#include "codec/digest.hpp"
#include "core/error.hpp"
#include "format/delta_file.hpp"

namespace deltasync {
namespace {

int64_t index_at(const PatchRef& p, uint64_t k) {
  return p.index_width == 4 ? static_cast<const int32_t*>(p.indices)[k] : static_cast<const int64_t*>(p.indices)[k];
}

// One runtime write: parameter position `rt`, from value row `row` of the delta.
struct Write {
  int64_t rt;
  uint64_t row;
};

// A delta resolved against the map: what to write where, the bits it replaces, and the rows'
// HF coordinates for the digests.
struct Prepared {
  integrity::DeltaDigests expected;
  std::vector<uint32_t> row_tensor;     // per value row: its HF tensor
  std::vector<int64_t> row_index;       // per value row: its HF flat index
  std::vector<uint64_t> tensor_rows;    // first row of each HF tensor (T + 1)
  std::vector<uint8_t> new_rows;        // per row: the new bits (width of its tensor)
  std::vector<uint64_t> row_offset;     // byte offset of each row in new_rows / old_rows
  std::vector<uint8_t> old_rows;        // per held row: the bits before (from its first write)
  std::vector<bool> row_held;           // the row is written somewhere on this rank
  // Per runtime parameter with writes: positions ascending, their new and old bits.
  std::vector<uint32_t> params;
  std::vector<std::vector<int64_t>> positions;
  std::vector<std::vector<uint8_t>> new_bits, old_bits;
  uint64_t elements = 0;
};

}  // namespace

MappedReceiver::MappedReceiver(MappedModel model, engine::SyncEngine& engine, CombinePartials combine, LoadFull load_full)
    : model_(std::move(model)), engine_(engine), combine_(std::move(combine)), load_full_(std::move(load_full)) {
  const size_t T = model_.hf.size(), P = model_.params.size();
  if (model_.params_meta.size() != P) throw Error("mapped receiver: parameters and their descriptions differ in number");
  targets_.assign(T, {});
  for (const MappedRuns& r : model_.runs) {
    if (r.hf_tensor >= T || r.param >= P) throw Error("mapped receiver: a run names a tensor or parameter that does not exist");
    const TensorMeta& hf = model_.hf[r.hf_tensor];
    const TensorMeta& pm = model_.params_meta[r.param];
    if (hf.dtype != pm.dtype)
      throw BadInputError("mapped receiver: tensor " + hf.name + " is published as " + std::string(dtype_name(hf.dtype)) +
                          " but served in parameter " + pm.name + " as " + std::string(dtype_name(pm.dtype)) +
                          "; deltas write published bits as they are");
    if (r.hf_start.size() != r.length.size() || r.rt_start.size() != r.length.size())
      throw Error("mapped receiver: runs of " + hf.name + " have arrays of different lengths");
    for (size_t k = 0; k < r.length.size(); ++k) {
      if (r.length[k] <= 0 || r.hf_start[k] < 0 || r.rt_start[k] < 0 ||
          static_cast<uint64_t>(r.hf_start[k] + r.length[k]) > hf.numel() ||
          static_cast<uint64_t>(r.rt_start[k] + r.length[k]) > pm.numel())
        throw Error("mapped receiver: a run of " + hf.name + " in " + pm.name + " leaves one of the two tensors");
      if (k && r.hf_start[k] < r.hf_start[k - 1] + r.length[k - 1])
        throw Error("mapped receiver: runs of " + hf.name + " in " + pm.name + " are not sorted and disjoint");
    }
    targets_[r.hf_tensor].push_back(&r);
  }
  for (const OwnedRanges& o : model_.owned)
    if (o.hf_tensor >= T || o.start.size() != o.length.size()) throw Error("mapped receiver: bad ownership ranges");
  served_.assign(T, true);
  for (uint32_t t : model_.unserved) {
    if (t >= T) throw Error("mapped receiver: bad unserved tensor index");
    if (!targets_[t].empty()) throw Error("mapped receiver: tensor " + model_.hf[t].name + " is marked unserved but has runs on this rank");
    served_[t] = false;
  }
}

uint64_t MappedReceiver::map_runs() const {
  uint64_t n = 0;
  for (const auto& r : model_.runs) n += r.length.size();
  return n;
}

void MappedReceiver::recompute_digests() {
  const size_t T = model_.hf.size();
  std::vector<uint64_t> partial(T, 0);
  std::vector<uint8_t> buffer;
  for (const OwnedRanges& o : model_.owned) {
    const uint32_t t = o.hf_tensor;
    const uint32_t w = model_.hf[t].width();
    for (size_t k = 0; k < o.start.size(); ++k) {
      // Each owned range is read from the runtime runs that hold it (any one: they hold the same bits).
      int64_t at = o.start[k];
      const int64_t end = o.start[k] + o.length[k];
      while (at < end) {
        const MappedRuns* holder = nullptr;
        size_t run = 0;
        for (const MappedRuns* r : targets_[t]) {
          auto it = std::upper_bound(r->hf_start.begin(), r->hf_start.end(), at);
          if (it == r->hf_start.begin()) continue;
          const size_t j = static_cast<size_t>(it - r->hf_start.begin()) - 1;
          if (at < r->hf_start[j] + r->length[j]) {
            holder = r;
            run = j;
            break;
          }
        }
        if (!holder) throw Error("mapped receiver: tensor " + model_.hf[t].name + " element " + std::to_string(at) + " is owned but held nowhere on this rank");
        const int64_t n = std::min(end, holder->hf_start[run] + holder->length[run]) - at;
        const int64_t rt = holder->rt_start[run] + (at - holder->hf_start[run]);
        buffer.resize(static_cast<size_t>(n) * w);
        const TensorRef& p = model_.params[holder->param];
        engine_.read(ConstTensorRef{p.name, p.data, p.numel, p.width}, static_cast<uint64_t>(rt) * w, buffer);
        partial[t] += digest_slice(w, buffer.data(), static_cast<uint64_t>(at), static_cast<uint64_t>(n));
        at += n;
      }
    }
  }
  if (combine_) combine_(partial);
  // Unserved tensors keep the digests last promised for them (none yet: zero until an anchor).
  for (size_t t = 0; t < T; ++t)
    if (!served_[t]) partial[t] = digests_.size() == T ? digests_[t] : 0;
  digests_ = std::move(partial);
}

void MappedReceiver::load_anchor(std::span<const TensorMeta> meta, std::span<const std::span<const uint8_t>> bytes,
                                 std::span<const uint64_t> digests, uint64_t version) {
  if (meta.size() != model_.hf.size()) throw BadInputError("anchor of version " + std::to_string(version) + ": holds " + std::to_string(meta.size()) + " tensors, the model maps " + std::to_string(model_.hf.size()));
  for (size_t t = 0; t < meta.size(); ++t)
    if (meta[t].name != model_.hf[t].name || meta[t].dtype != model_.hf[t].dtype || meta[t].shape != model_.hf[t].shape)
      throw BadInputError("anchor of version " + std::to_string(version) + ": tensor " + meta[t].name + " differs from the mapped model's " + model_.hf[t].name);
  version_.reset();
  digests_.clear();
  load_full_(meta, bytes);
  recompute_digests();
  for (size_t t = 0; t < digests.size(); ++t) {
    if (!served_[t]) digests_[t] = digests[t];
    if (digests_[t] != digests[t])
      throw Error("anchor of version " + std::to_string(version) + ": after loading, tensor " + model_.hf[t].name + " hashes to " +
                      digest_to_hex(digests_[t]) + " in the runtime parameters, the anchor to " + digest_to_hex(digests[t]) +
                      " (the index map or the loader does not reproduce the published bits)",
                  ErrorKind::kIntegrity);
  }
  version_ = version;
}

namespace {

// Resolves the file, checks the base, maps every change onto the runtime parameters and
// gathers the bits it replaces. Nothing is written.
Prepared prepare(const engine::DeltaToApply& delta, const MappedModel& model,
                 const std::vector<std::vector<const MappedRuns*>>& targets, const std::optional<uint64_t>& version,
                 const std::vector<uint64_t>& digests, engine::SyncEngine& engine, engine::TransferCounters& transfer) {
  const st::File& file = *delta.file;
  const std::string& label = file.label();
  const size_t T = model.hf.size();
  Prepared p;
  std::vector<PatchRef> patches;
  compact::DecodedDelta decoded;
  ParsedDelta parsed;
  bool relative = false;
  DeltaInfo info;
  if (compact::is_compact_delta(file)) {
    // Values are relative to base bits that live in the runtime parameters: decode positions
    // and unbased values first, gather the base where it is, rebase below.
    patches = compact::decode_compact_delta_unbased(file, model.hf, decoded);
    info = decoded.info;
    relative = true;
  } else {
    parsed = parse_trl_delta(file);
    if (!parsed.sparse) throw BadInputError(label + ": is an anchor (sparse=\"False\"), not a delta");
    patches = resolve_patches(parsed, model.hf, label);
    info = parsed.info;
  }
  p.expected = engine::delta_promises(delta, info);
  integrity::DigestMap current;
  if (digests.size() == T)
    for (size_t t = 0; t < T; ++t) current.emplace(model.hf[t].name, digests[t]);
  for (size_t t = 0; t < T; ++t)
    if (patches[t].count && !(p.expected.base.contains(model.hf[t].name) && p.expected.result.contains(model.hf[t].name)))
      throw BadInputError(label + ": delta " + std::to_string(p.expected.model_version) + " changes tensor " + model.hf[t].name +
                          " but records no base/result digest for it");
  integrity::check_base(p.expected, version, current);

  // Value rows: every change of every HF tensor, in tensor order.
  p.tensor_rows.assign(1, 0);
  p.row_offset.clear();
  uint64_t bytes = 0;
  for (size_t t = 0; t < T; ++t) {
    const uint32_t w = model.hf[t].width();
    for (uint64_t k = 0; k < patches[t].count; ++k) {
      p.row_tensor.push_back(static_cast<uint32_t>(t));
      p.row_index.push_back(index_at(patches[t], k));
      p.row_offset.push_back(bytes);
      bytes += w;
    }
    if (patches[t].count) {
      const size_t at = p.new_rows.size();
      p.new_rows.resize(at + patches[t].count * w);
      std::memcpy(p.new_rows.data() + at, patches[t].values, patches[t].count * w);
    }
    p.tensor_rows.push_back(p.row_index.size());
  }
  const uint64_t rows = p.row_index.size();

  // Map: per HF tensor and target, a sweep of its ascending indices against its sorted runs.
  std::vector<std::vector<Write>> writes(model.params.size());
  for (size_t t = 0; t < T; ++t) {
    for (const MappedRuns* r : targets[t]) {
      size_t run = 0;
      for (uint64_t row = p.tensor_rows[t]; row < p.tensor_rows[t + 1]; ++row) {
        const int64_t i = p.row_index[row];
        while (run < r->hf_start.size() && r->hf_start[run] + r->length[run] <= i) ++run;
        if (run == r->hf_start.size()) break;
        if (i < r->hf_start[run]) continue;
        writes[r->param].push_back(Write{r->rt_start[run] + (i - r->hf_start[run]), row});
      }
    }
  }
  for (size_t k = 0; k < writes.size(); ++k) {
    auto& w = writes[k];
    if (w.empty()) continue;
    // Fused parameters receive several HF tensors, each ascending on its own: merge them.
    std::sort(w.begin(), w.end(), [](const Write& a, const Write& b) { return a.rt < b.rt; });
    for (size_t j = 1; j < w.size(); ++j)
      if (w[j].rt == w[j - 1].rt)
        throw Error("mapped receiver: two HF elements land on element " + std::to_string(w[j].rt) + " of " + model.params_meta[k].name);
    p.params.push_back(static_cast<uint32_t>(k));
    std::vector<int64_t> pos(w.size());
    for (size_t j = 0; j < w.size(); ++j) pos[j] = w[j].rt;
    p.positions.push_back(std::move(pos));
  }

  // Old bits at every write (one gather for all parameters).
  std::vector<ConstTensorRef> sources;
  std::vector<PatchRef> where;
  uint64_t gather_bytes = 0;
  for (size_t j = 0; j < p.params.size(); ++j) {
    const TensorRef& prm = model.params[p.params[j]];
    sources.push_back(ConstTensorRef{prm.name, prm.data, prm.numel, prm.width});
    where.push_back(PatchRef{p.positions[j].size(), p.positions[j].data(), 8, nullptr, prm.width});
    gather_bytes += p.positions[j].size() * prm.width;
  }
  std::vector<uint8_t> gathered(gather_bytes);
  if (!sources.empty()) engine.gather(sources, where, gathered, transfer);

  // Old bits per row (from its first write) and, for the compact layout, the new bits rebased on them.
  p.old_rows.assign(p.new_rows.size(), 0);
  p.row_held.assign(rows, false);
  uint64_t at = 0;
  for (size_t j = 0; j < p.params.size(); ++j) {
    const auto& w = writes[p.params[j]];
    const uint32_t width = model.params[p.params[j]].width;
    for (const Write& x : w) {
      if (!p.row_held[x.row]) {
        std::memcpy(p.old_rows.data() + p.row_offset[x.row], gathered.data() + at, width);
        p.row_held[x.row] = true;
      }
      at += width;
    }
  }
  if (relative) {
    for (size_t t = 0; t < T; ++t) {
      const uint64_t first = p.tensor_rows[t], n = p.tensor_rows[t + 1] - first;
      if (!n) continue;
      const uint32_t w = model.hf[t].width();
      const size_t off = p.row_offset[first];
      compact::rebase_values(std::span<const uint8_t>(p.new_rows.data() + off, n * w),
                             std::span<const uint8_t>(p.old_rows.data() + off, n * w), w,
                             std::span<uint8_t>(p.new_rows.data() + off, n * w));
    }
  }
  // Per parameter: the new and old bits in write order.
  at = 0;
  for (size_t j = 0; j < p.params.size(); ++j) {
    const auto& w = writes[p.params[j]];
    const uint32_t width = model.params[p.params[j]].width;
    std::vector<uint8_t> nb(w.size() * width), ob(gathered.begin() + at, gathered.begin() + at + w.size() * width);
    for (size_t k = 0; k < w.size(); ++k) std::memcpy(nb.data() + k * width, p.new_rows.data() + p.row_offset[w[k].row], width);
    at += w.size() * width;
    p.new_bits.push_back(std::move(nb));
    p.old_bits.push_back(std::move(ob));
    p.elements += w.size();
  }
  return p;
}

// Σ mix(i, new) − Σ mix(i, old) per HF tensor over the changed elements this rank owns.
void owned_shifts(const Prepared& p, const MappedModel& model, std::vector<uint64_t>& partial) {
  const size_t T = model.hf.size();
  std::vector<const OwnedRanges*> owned(T, nullptr);
  for (const OwnedRanges& o : model.owned) owned[o.hf_tensor] = &o;
  std::vector<int64_t> idx;
  std::vector<uint8_t> nb, ob;
  for (size_t t = 0; t < T; ++t) {
    if (!owned[t] || p.tensor_rows[t + 1] == p.tensor_rows[t]) continue;
    const OwnedRanges& o = *owned[t];
    const uint32_t w = model.hf[t].width();
    idx.clear();
    nb.clear();
    ob.clear();
    size_t range = 0;
    for (uint64_t row = p.tensor_rows[t]; row < p.tensor_rows[t + 1]; ++row) {
      const int64_t i = p.row_index[row];
      while (range < o.start.size() && o.start[range] + o.length[range] <= i) ++range;
      if (range == o.start.size()) break;
      if (i < o.start[range] || !p.row_held[row]) continue;
      idx.push_back(i);
      nb.insert(nb.end(), p.new_rows.begin() + p.row_offset[row], p.new_rows.begin() + p.row_offset[row] + w);
      ob.insert(ob.end(), p.old_rows.begin() + p.row_offset[row], p.old_rows.begin() + p.row_offset[row] + w);
    }
    partial[t] = digest_scattered(w, idx.size(), idx.data(), 8, nb.data()) - digest_scattered(w, idx.size(), idx.data(), 8, ob.data());
  }
}

std::vector<PatchRef> patches_of(const Prepared& p, const std::vector<std::vector<uint8_t>>& bits, const MappedModel& model,
                                 std::vector<TensorRef>& targets) {
  std::vector<PatchRef> out;
  targets.clear();
  for (size_t j = 0; j < p.params.size(); ++j) {
    targets.push_back(model.params[p.params[j]]);
    out.push_back(PatchRef{p.positions[j].size(), p.positions[j].data(), 8, bits[j].data(), model.params[p.params[j]].width});
  }
  return out;
}

}  // namespace

uint64_t MappedReceiver::apply(const engine::DeltaToApply& delta, engine::TransferCounters& transfer) {
  const size_t T = model_.hf.size();
  if (digests_.size() != T) recompute_digests();
  // Every rank takes part in exactly one combine per delta, failed or not, so a failure on one
  // rank (reported in the last slot) can never leave the others waiting in the all-reduce.
  std::vector<uint64_t> partial(T + 1, 0);
  std::exception_ptr failure;
  Prepared p;
  std::vector<TensorRef> targets;
  bool written = false;
  try {
    p = prepare(delta, model_, targets_, version_, digests_, engine_, transfer);
    const auto patches = patches_of(p, p.new_bits, model_, targets);
    if (!patches.empty()) engine_.scatter(targets, patches, transfer);
    written = true;
    owned_shifts(p, model_, partial);
  } catch (...) {
    failure = std::current_exception();
    std::fill(partial.begin(), partial.end(), 0);
    partial[T] = 1;
  }
  auto roll_back = [&] {
    if (!written) return;
    const auto patches = patches_of(p, p.old_bits, model_, targets);
    if (!patches.empty()) engine_.scatter(targets, patches, transfer);
  };
  try {
    if (combine_) combine_(partial);
  } catch (...) {
    roll_back();
    throw;
  }
  const std::string what = delta.file->label() + ": delta " + std::to_string(delta.model_version);
  if (partial[T] != 0) {
    roll_back();
    if (failure) std::rethrow_exception(failure);
    throw Error(what + ": refused by " + std::to_string(partial[T]) + " other rank(s); weights restored", ErrorKind::kIntegrity);
  }
  for (size_t t = 0; t < T; ++t) {
    const auto it = p.expected.result.find(model_.hf[t].name);
    if (it == p.expected.result.end()) continue;
    const uint64_t got = digests_[t] + partial[t];
    if (served_[t] && got != it->second) {
      roll_back();
      throw Error(what + " result digest mismatch for tensor " + model_.hf[t].name + ": expected " + digest_to_hex(it->second) +
                      ", got " + digest_to_hex(got) + " across the ranks; weights restored to their state before the delta",
                  ErrorKind::kIntegrity);
    }
  }
  for (size_t t = 0; t < T; ++t) {
    const auto it = p.expected.result.find(model_.hf[t].name);
    if (it != p.expected.result.end()) digests_[t] = served_[t] ? digests_[t] + partial[t] : it->second;
  }
  version_ = delta.model_version;
  return p.elements;
}

}  // namespace deltasync
