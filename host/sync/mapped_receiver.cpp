#include "sync/mapped_receiver.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <numeric>

#include "codec/compact_codec.hpp"
#include "codec/compact_two_phase.hpp"
#include "codec/digest.hpp"
#include "core/error.hpp"
#include "format/delta_file.hpp"

namespace deltasync {
namespace {

using Clock = std::chrono::steady_clock;

// Adds the seconds since the last lap to `slot`.
class Laps {
 public:
  void to(double& slot) {
    const auto now = Clock::now();
    slot += std::chrono::duration<double>(now - last_).count();
    last_ = now;
  }

 private:
  Clock::time_point last_ = Clock::now();
};

// Copies one element of `width` bytes; the common widths as fixed-size copies.
inline void copy_element(uint8_t* dst, const uint8_t* src, uint32_t width) {
  switch (width) {
    case 2: std::memcpy(dst, src, 2); break;
    case 4: std::memcpy(dst, src, 4); break;
    case 1: *dst = *src; break;
    default: std::memcpy(dst, src, width);
  }
}

// A delta resolved against the map: what to write where, the bits it replaces, and the rows'
// HF coordinates for the digests. Rows are every change of every HF tensor, in tensor order;
// row r of tensor t sits at byte tensor_bytes[t] + (r - tensor_rows[t]) * width in the row arrays.
struct Prepared {
  integrity::DeltaDigests expected;
  std::vector<int64_t> row_index;       // per row: its HF flat index (ascending per tensor)
  std::vector<uint64_t> tensor_rows;    // first row of each HF tensor (T + 1)
  std::vector<uint64_t> tensor_bytes;   // first row byte of each HF tensor (T + 1)
  std::vector<uint8_t> new_rows;        // per row: the new bits
  std::vector<uint8_t> old_rows;        // per held row: the bits before (from its first write)
  std::vector<uint8_t> row_held;        // 1: the row is written somewhere on this rank
  // Per runtime parameter with writes: positions ascending, the row of each, new and old bits.
  std::vector<uint32_t> params;
  std::vector<std::vector<int64_t>> positions;
  std::vector<std::vector<uint64_t>> rows;
  std::vector<std::vector<uint8_t>> new_bits, old_bits;
  uint64_t elements = 0;
};

}  // namespace

MappedReceiver::MappedReceiver(MappedModel model, engine::SyncEngine& engine, CombinePartials combine)
    : model_(std::move(model)), engine_(engine), combine_(std::move(combine)) {
  const size_t T = model_.hf.size(), P = model_.params.size();
  if (model_.params_meta.size() != P) throw Error("mapped receiver: parameters and their descriptions differ in number");
  targets_.assign(T, {});
  by_param_.assign(P, {});
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
      by_param_[r.param].push_back(ParamRun{r.hf_tensor, r.hf_start[k], r.length[k], r.rt_start[k]});
    }
    targets_[r.hf_tensor].push_back(&r);
  }
  // In runtime order, a parameter's writes come out ascending with no sort; two runs on one
  // runtime element would make a write ambiguous.
  for (size_t k = 0; k < P; ++k) {
    auto& runs = by_param_[k];
    std::sort(runs.begin(), runs.end(), [](const ParamRun& a, const ParamRun& b) { return a.rt_start < b.rt_start; });
    for (size_t j = 1; j < runs.size(); ++j)
      if (runs[j].rt_start < runs[j - 1].rt_start + runs[j - 1].length)
        throw Error("mapped receiver: runs of " + model_.hf[runs[j - 1].hf_tensor].name + " and " + model_.hf[runs[j].hf_tensor].name +
                    " overlap in parameter " + model_.params_meta[k].name);
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

void MappedReceiver::abandon() {
  if (!combine_) return;
  std::vector<uint64_t> partial(model_.hf.size() + 1, 0);
  partial.back() = 1;
  combine_(partial);
}

void MappedReceiver::load_anchor(std::span<const TensorMeta> meta, std::span<const std::span<const uint8_t>> bytes,
                                 std::span<const uint64_t> digests, uint64_t version) {
  const size_t T = model_.hf.size();
  const std::string what = "anchor of version " + std::to_string(version);
  Laps lap;
  // Agreement before any write, over the same T + 1 slots as a delta's: this rank's owned
  // digests of the anchor's host bytes, or its refusal in the last slot.
  std::vector<uint64_t> partial(T + 1, 0);
  std::exception_ptr failure;
  try {
    if (meta.size() != T || bytes.size() != T || digests.size() != T)
      throw BadInputError(what + ": holds " + std::to_string(meta.size()) + " tensors, the model maps " + std::to_string(T));
    for (size_t t = 0; t < T; ++t) {
      if (meta[t].name != model_.hf[t].name || meta[t].dtype != model_.hf[t].dtype || meta[t].shape != model_.hf[t].shape)
        throw BadInputError(what + ": tensor " + meta[t].name + " differs from the mapped model's " + model_.hf[t].name);
      if (bytes[t].size() != meta[t].numel() * meta[t].width())
        throw BadInputError(what + ": tensor " + meta[t].name + " has " + std::to_string(bytes[t].size()) + " bytes, expected " +
                            std::to_string(meta[t].numel() * meta[t].width()));
    }
    for (const OwnedRanges& o : model_.owned) {
      const uint32_t w = model_.hf[o.hf_tensor].width();
      for (size_t k = 0; k < o.start.size(); ++k)
        partial[o.hf_tensor] += digest_slice(w, bytes[o.hf_tensor].data() + static_cast<uint64_t>(o.start[k]) * w,
                                             static_cast<uint64_t>(o.start[k]), static_cast<uint64_t>(o.length[k]));
    }
  } catch (...) {
    failure = std::current_exception();
    std::fill(partial.begin(), partial.end(), 0);
    partial[T] = 1;
  }
  if (combine_) combine_(partial);
  lap.to(timings_.anchor_check);
  if (partial[T] != 0) {
    if (failure) std::rethrow_exception(failure);
    throw Error(what + ": refused by " + std::to_string(partial[T]) + " other rank(s); nothing written", ErrorKind::kIntegrity);
  }
  // Every rank sees the same sums, so every rank refuses alike.
  for (size_t t = 0; t < T; ++t)
    if (served_[t] && partial[t] != digests[t])
      throw Error(what + ": tensor " + model_.hf[t].name + " hashes to " + digest_to_hex(partial[t]) +
                      " over the elements the ranks hold, the anchor to " + digest_to_hex(digests[t]) +
                      " (the index map does not cover every element once); nothing written",
                  ErrorKind::kIntegrity);

  version_.reset();
  digests_.clear();
  for (size_t k = 0; k < by_param_.size(); ++k) {
    const TensorRef& p = model_.params[k];
    for (const ParamRun& r : by_param_[k]) {
      const uint32_t w = model_.hf[r.hf_tensor].width();
      engine_.write(p, static_cast<uint64_t>(r.rt_start) * w,
                    bytes[r.hf_tensor].subspan(static_cast<uint64_t>(r.hf_start) * w, static_cast<uint64_t>(r.length) * w));
    }
  }
  lap.to(timings_.anchor_write);
  recompute_digests();
  lap.to(timings_.anchor_audit);
  for (size_t t = 0; t < T; ++t) {
    if (!served_[t]) digests_[t] = digests[t];
    if (digests_[t] != digests[t])
      throw Error(what + ": after writing, tensor " + model_.hf[t].name + " hashes to " + digest_to_hex(digests_[t]) +
                      " in the runtime parameters, the anchor to " + digest_to_hex(digests[t]),
                  ErrorKind::kIntegrity);
  }
  version_ = version;
}

namespace {

// Resolves the file, checks the base, maps every change onto the runtime parameters and
// gathers the bits it replaces. Nothing is written.
Prepared prepare(const engine::DeltaToApply& delta, const MappedModel& model, const std::vector<std::vector<ParamRun>>& by_param,
                 const std::optional<uint64_t>& version, const std::vector<uint64_t>& digests, engine::SyncEngine& engine,
                 engine::TransferCounters& transfer, MappedTimings& timings) {
  Laps lap;
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

  // Rows: every change of every HF tensor, in tensor order.
  p.tensor_rows.assign(T + 1, 0);
  p.tensor_bytes.assign(T + 1, 0);
  for (size_t t = 0; t < T; ++t) {
    p.tensor_rows[t + 1] = p.tensor_rows[t] + patches[t].count;
    p.tensor_bytes[t + 1] = p.tensor_bytes[t] + patches[t].count * model.hf[t].width();
  }
  const uint64_t rows = p.tensor_rows[T];
  p.row_index.resize(rows);
  p.new_rows.resize(p.tensor_bytes[T]);
  for (size_t t = 0; t < T; ++t) {
    const PatchRef& patch = patches[t];
    if (!patch.count) continue;
    int64_t* out = p.row_index.data() + p.tensor_rows[t];
    if (patch.index_width == 8) {
      std::memcpy(out, patch.indices, patch.count * 8);
    } else {
      const int32_t* in = static_cast<const int32_t*>(patch.indices);
      for (uint64_t k = 0; k < patch.count; ++k) out[k] = in[k];
    }
    std::memcpy(p.new_rows.data() + p.tensor_bytes[t], patch.values, patch.count * model.hf[t].width());
  }
  lap.to(timings.parse);

  // Map: each parameter's runs in runtime order, each taking the rows of its HF tensor that fall
  // inside it (two binary searches per run): positions come out ascending, no sort.
  for (size_t k = 0; k < by_param.size(); ++k) {
    std::vector<int64_t> pos;
    std::vector<uint64_t> row_of;
    for (const ParamRun& r : by_param[k]) {
      const uint64_t first = p.tensor_rows[r.hf_tensor], last = p.tensor_rows[r.hf_tensor + 1];
      if (first == last) continue;
      const int64_t* begin = p.row_index.data() + first;
      const int64_t* end = p.row_index.data() + last;
      const int64_t* lo = std::lower_bound(begin, end, r.hf_start);
      const int64_t* hi = std::lower_bound(lo, end, r.hf_start + r.length);
      const int64_t shift = r.rt_start - r.hf_start;
      const uint64_t row0 = first + static_cast<uint64_t>(lo - begin);
      const size_t at = pos.size(), n = static_cast<size_t>(hi - lo);
      pos.resize(at + n);
      row_of.resize(at + n);
      for (size_t j = 0; j < n; ++j) {
        pos[at + j] = lo[j] + shift;
        row_of[at + j] = row0 + j;
      }
    }
    if (pos.empty()) continue;
    p.params.push_back(static_cast<uint32_t>(k));
    p.positions.push_back(std::move(pos));
    p.rows.push_back(std::move(row_of));
  }
  lap.to(timings.map);

  // Old bits at every write (one gather for all parameters), straight into old_bits.
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
  lap.to(timings.gather);

  // Per row: its tensor's width and byte offset (rows of one tensor are contiguous).
  std::vector<uint32_t> row_width_of_tensor(T);
  for (size_t t = 0; t < T; ++t) row_width_of_tensor[t] = model.hf[t].width();
  auto row_byte = [&](uint64_t row, uint32_t t) { return p.tensor_bytes[t] + (row - p.tensor_rows[t]) * row_width_of_tensor[t]; };
  auto tensor_of = [&](uint64_t row) {
    return static_cast<uint32_t>(std::upper_bound(p.tensor_rows.begin(), p.tensor_rows.end(), row) - p.tensor_rows.begin() - 1);
  };
  // Old bits per row (from its first write) and, for the compact layout, the new bits rebased on them.
  p.old_rows.assign(p.new_rows.size(), 0);
  p.row_held.assign(rows, 0);
  uint64_t at = 0;
  for (size_t j = 0; j < p.params.size(); ++j) {
    const uint32_t width = model.params[p.params[j]].width;
    const auto& row_of = p.rows[j];
    uint32_t t = row_of.empty() ? 0 : tensor_of(row_of[0]);
    for (size_t k = 0; k < row_of.size(); ++k, at += width) {
      const uint64_t row = row_of[k];
      if (row < p.tensor_rows[t] || row >= p.tensor_rows[t + 1]) t = tensor_of(row);
      if (p.row_held[row]) continue;
      copy_element(p.old_rows.data() + row_byte(row, t), gathered.data() + at, width);
      p.row_held[row] = 1;
    }
  }
  if (relative) {
    for (size_t t = 0; t < T; ++t) {
      const uint64_t n = p.tensor_rows[t + 1] - p.tensor_rows[t];
      if (!n) continue;
      const uint32_t w = model.hf[t].width();
      const size_t off = p.tensor_bytes[t];
      compact::rebase_values(std::span<const uint8_t>(p.new_rows.data() + off, n * w),
                             std::span<const uint8_t>(p.old_rows.data() + off, n * w), w,
                             std::span<uint8_t>(p.new_rows.data() + off, n * w));
    }
  }
  // Per parameter: the new and old bits in write order.
  at = 0;
  for (size_t j = 0; j < p.params.size(); ++j) {
    const uint32_t width = model.params[p.params[j]].width;
    const auto& row_of = p.rows[j];
    std::vector<uint8_t> nb(row_of.size() * width), ob(gathered.begin() + at, gathered.begin() + at + row_of.size() * width);
    uint32_t t = row_of.empty() ? 0 : tensor_of(row_of[0]);
    for (size_t k = 0; k < row_of.size(); ++k) {
      const uint64_t row = row_of[k];
      if (row < p.tensor_rows[t] || row >= p.tensor_rows[t + 1]) t = tensor_of(row);
      copy_element(nb.data() + k * width, p.new_rows.data() + row_byte(row, t), width);
    }
    at += row_of.size() * width;
    p.new_bits.push_back(std::move(nb));
    p.old_bits.push_back(std::move(ob));
    p.elements += row_of.size();
  }
  lap.to(timings.pack);
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
    const uint64_t first = p.tensor_rows[t], last = p.tensor_rows[t + 1];
    if (!owned[t] || first == last) continue;
    const OwnedRanges& o = *owned[t];
    const uint32_t w = model.hf[t].width();
    const int64_t* index = p.row_index.data() + first;
    const uint8_t* new_bits = p.new_rows.data() + p.tensor_bytes[t];
    const uint8_t* old_bits = p.old_rows.data() + p.tensor_bytes[t];
    const uint64_t n = last - first;
    // The common case (one rank, or a tensor this rank holds whole): every row owned and held.
    const bool whole = o.start.size() == 1 && o.start[0] <= index[0] && index[n - 1] < o.start[0] + o.length[0] &&
                       std::all_of(p.row_held.begin() + first, p.row_held.begin() + last, [](uint8_t h) { return h != 0; });
    if (whole) {
      partial[t] = digest_scattered(w, n, index, 8, new_bits) - digest_scattered(w, n, index, 8, old_bits);
      continue;
    }
    idx.clear();
    nb.clear();
    ob.clear();
    size_t range = 0;
    for (uint64_t k = 0; k < n; ++k) {
      const int64_t i = index[k];
      while (range < o.start.size() && o.start[range] + o.length[range] <= i) ++range;
      if (range == o.start.size()) break;
      if (i < o.start[range] || !p.row_held[first + k]) continue;
      idx.push_back(i);
      nb.insert(nb.end(), new_bits + k * w, new_bits + (k + 1) * w);
      ob.insert(ob.end(), old_bits + k * w, old_bits + (k + 1) * w);
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
    p = prepare(delta, model_, by_param_, version_, digests_, engine_, transfer, timings_);
    Laps lap;
    const auto patches = patches_of(p, p.new_bits, model_, targets);
    if (!patches.empty()) engine_.scatter(targets, patches, transfer);
    written = true;
    lap.to(timings_.scatter);
    owned_shifts(p, model_, partial);
    lap.to(timings_.digest);
  } catch (...) {
    failure = std::current_exception();
    std::fill(partial.begin(), partial.end(), 0);
    partial[T] = 1;
  }
  Laps lap;
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
  lap.to(timings_.digest);
  version_ = delta.model_version;
  return p.elements;
}

}  // namespace deltasync
