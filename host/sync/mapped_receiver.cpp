#include "sync/mapped_receiver.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <numeric>

#include "codec/compact_codec.hpp"
#include "codec/compact_two_phase.hpp"
#include "codec/digest.hpp"
#include "core/error.hpp"
#include "core/parallel.hpp"
#include "core/scratch.hpp"
#include "engine/cpu_engine.hpp"
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

// The ranks' agreement on one step (an anchor's or a delta's): per-tensor partials in T slots
// and refusals in one more, summed across the ranks in place (one rank: the identity). Returns
// how many ranks refused, this one included when `refuse`.
uint64_t agree_across_ranks(const CombinePartials& combine, std::span<uint64_t> partial, bool refuse) {
  std::vector<uint64_t> slots(partial.size() + 1, 0);
  if (!refuse) std::copy(partial.begin(), partial.end(), slots.begin());
  slots.back() = refuse ? 1 : 0;
  if (combine) combine(slots);
  std::copy(slots.begin(), slots.end() - 1, partial.begin());
  return slots.back();
}

}  // namespace

// A delta resolved against the map: what to write where, the bits it replaces, and the rows'
// HF coordinates for the digests. Rows are every change of every HF tensor, in tensor order;
// row r of tensor t sits at byte tensor_bytes[t] + (r - tensor_rows[t]) * width in the new and
// old bits, so a segment's new and old bits are contiguous there: the scatter reads them in
// place. Kept between deltas (its buffers' memory is not faulted in again for every delta).
struct MappedReceiver::Prepared {
  // Per row: its HF flat index (ascending per tensor) and its new bits. They point into the
  // decoded compact delta when its arrays are already laid out so (one array each, tensor
  // order: the decoder's own layout), else into the copies below.
  const int64_t* row_index = nullptr;
  uint8_t* new_bits = nullptr;
  std::vector<int64_t> row_index_copy;
  std::vector<uint8_t> new_rows_copy;
  std::vector<uint64_t> tensor_rows;    // first row of each HF tensor (T + 1)
  std::vector<uint64_t> tensor_bytes;   // first row byte of each HF tensor (T + 1)
  std::vector<uint8_t> old_rows;        // per held row: the bits before (from its first write)
  std::vector<uint8_t> row_held;        // 1: the row is written somewhere on this rank
  std::vector<int64_t> positions;       // runtime positions of the segments with a negative shift
  std::vector<Segment> segments;        // by parameter, then runtime position
  std::vector<uint8_t> gathered;        // old bits in segment order
  // The compact delta decoded (positions, values, band scratch): kept with the rest, so that the
  // next delta decodes into memory already mapped. Allocated afresh per delta, a 15% delta of
  // Qwen3-0.6B (89M changes, ~1 GB of arrays) spent 5.1 of 6.4 s of its apply decoding into
  // fresh pages on this project's VM; kept, the decode takes 0.62-0.71 s (vllm_index_map.py).
  compact::DecodedDelta decoded;
  uint64_t elements = 0;

  const uint8_t* bits(const uint8_t* rows, const Segment& g, uint32_t width) const {
    return rows + tensor_bytes[g.tensor] + (g.row0 - tensor_rows[g.tensor]) * width;
  }
  // Where a segment writes: the positions and the parameter as they see it (from element
  // `shift` on, or whole with the shifted positions).
  const int64_t* indices(const Segment& g) const { return g.shift >= 0 ? row_index + g.row0 : positions.data() + g.first; }
  static TensorRef target(const TensorRef& param, const Segment& g) {
    if (g.shift < 0) return param;
    const auto shift = static_cast<uint64_t>(g.shift);
    return TensorRef{param.name, static_cast<uint8_t*>(param.data) + shift * param.width, param.numel - shift, param.width};
  }
};

namespace {

// Rows per task when a stage runs on the worker pool: segments and tensors range from a norm's
// hundreds of rows to an embedding's tens of millions, so the big ones are cut.
constexpr uint64_t kRowsPerTask = uint64_t{1} << 18;

// fn(item, begin, end) over [begin, end) of rows(item) rows of every item in [0, items), in
// parallel tasks of at most kRowsPerTask rows (an item of 0 rows has none).
template <class Rows, class Fn>
void for_row_chunks(size_t items, Rows&& rows, Fn&& fn) {
  struct Task {
    size_t item;
    uint64_t begin, end;
  };
  std::vector<Task> tasks;
  for (size_t k = 0; k < items; ++k) {
    const uint64_t n = rows(k);
    for (uint64_t b = 0; b < n; b += kRowsPerTask) tasks.push_back({k, b, std::min(n, b + kRowsPerTask)});
  }
  parallel_for(tasks.size(), [&](size_t t) { fn(tasks[t].item, tasks[t].begin, tasks[t].end); });
}

}  // namespace

MappedReceiver::~MappedReceiver() = default;

MappedReceiver::MappedReceiver(MappedModel model, engine::SyncEngine& engine, CombinePartials combine)
    : model_(std::move(model)), engine_(engine), combine_(std::move(combine)), prepared_(std::make_unique<Prepared>()) {
  const size_t T = model_.hf.size(), P = model_.params.size();
  if (model_.params_meta.size() != P) throw Error("mapped receiver: parameters and their descriptions differ in number");
  for (size_t k = 0; k < P; ++k)
    if (model_.params[k].numel != model_.params_meta[k].numel() || model_.params[k].width != model_.params_meta[k].width())
      throw Error("mapped receiver: parameter " + model_.params_meta[k].name + " holds " + std::to_string(model_.params[k].numel) + " elements of " +
                  std::to_string(model_.params[k].width) + " bytes, its description " + std::to_string(model_.params_meta[k].numel()) +
                  " of " + std::to_string(model_.params_meta[k].width()));
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
  std::vector<uint64_t> partial(model_.hf.size(), 0);
  agree_across_ranks(combine_, partial, true);
}

void MappedReceiver::load_anchor(std::span<const TensorMeta> meta, std::span<const std::span<const uint8_t>> bytes,
                                 std::span<const uint64_t> digests, uint64_t version) {
  const size_t T = model_.hf.size();
  const std::string what = "anchor of version " + std::to_string(version);
  Laps lap;
  // Agreement before any write, over the same T + 1 slots as a delta's: this rank's owned
  // digests of the anchor's host bytes, or its refusal in the last slot.
  std::vector<uint64_t> partial(T, 0);
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
      // A tensor this rank owns whole: its partial is the digest the subscriber computed from
      // these very bytes (verify_anchor), no second read.
      if (o.start.size() == 1 && o.start[0] == 0 && static_cast<uint64_t>(o.length[0]) == meta[o.hf_tensor].numel()) {
        partial[o.hf_tensor] = digests[o.hf_tensor];
        continue;
      }
      for (size_t k = 0; k < o.start.size(); ++k)
        partial[o.hf_tensor] += digest_slice(w, bytes[o.hf_tensor].data() + static_cast<uint64_t>(o.start[k]) * w,
                                             static_cast<uint64_t>(o.start[k]), static_cast<uint64_t>(o.length[k]));
    }
  } catch (...) {
    failure = std::current_exception();
  }
  const uint64_t refusals = agree_across_ranks(combine_, partial, failure != nullptr);
  lap.to(timings_.anchor_check);
  if (refusals != 0) {
    if (failure) std::rethrow_exception(failure);
    throw Error(what + ": refused by " + std::to_string(refusals) + " other rank(s); nothing written", ErrorKind::kIntegrity);
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
  uint64_t written = 0;
  auto injected_failure = [&] {
    if (fail_after_runs_ && written == *fail_after_runs_)
      throw Error(what + ": injected failure after writing " + std::to_string(written) + " of " + std::to_string(map_runs()) +
                  " runs (test)");
  };
  std::exception_ptr write_failure;
  try {
    for (size_t k = 0; k < by_param_.size(); ++k) {
      const TensorRef& p = model_.params[k];
      for (const ParamRun& r : by_param_[k]) {
        injected_failure();
        torn_ = true;  // from the first write until the audit below passes
        const uint32_t w = model_.hf[r.hf_tensor].width();
        engine_.write(p, static_cast<uint64_t>(r.rt_start) * w,
                      bytes[r.hf_tensor].subspan(static_cast<uint64_t>(r.hf_start) * w, static_cast<uint64_t>(r.length) * w));
        ++written;
      }
    }
    injected_failure();
  } catch (...) {
    write_failure = std::current_exception();
  }
  lap.to(timings_.anchor_write);
  // Every rank hears of a failed write before any audits (whose digest sum would wait for the
  // rank that failed): the model is then torn on every rank that took part -- the ranks that
  // wrote their whole share hold no version either -- so every rank's next plan is an anchor.
  // Slots: ranks that failed, ranks whose parameters are torn.
  std::vector<uint64_t> outcome{write_failure ? 1u : 0u, torn_ ? 1u : 0u};
  if (combine_) combine_(outcome);
  if (outcome[0] != 0) {
    torn_ = outcome[1] != 0;
    if (write_failure) std::rethrow_exception(write_failure);
    throw Error(what + ": a write failed on " + std::to_string(outcome[0]) +
                    " other rank(s); the runtime parameters are torn on every rank until an anchor is written whole");
  }
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
  torn_ = false;
}

namespace {

// The delta file's changes per HF tensor (positions ascending; for the compact layout values
// relative to base bits that live in the runtime parameters: `relative`) and its promises.
std::vector<PatchRef> resolve_changes(const engine::DeltaToApply& delta, std::span<const TensorMeta> hf,
                                      compact::DecodedDelta& decoded, ParsedDelta& parsed, bool& relative,
                                      integrity::DeltaDigests& expected) {
  const st::File& file = *delta.file;
  std::vector<PatchRef> patches;
  DeltaInfo info;
  relative = compact::is_compact_delta(file);
  if (relative) {
    // Decode positions and unbased values first; prepare() gathers the base where it is and rebases.
    patches = compact::decode_compact_delta_unbased(file, hf, decoded);
    info = decoded.info;
  } else {
    parsed = parse_trl_delta(file);
    if (!parsed.sparse) throw BadInputError(file.label() + ": is an anchor (sparse=\"False\"), not a delta");
    patches = resolve_patches(parsed, hf, file.label());
    info = parsed.info;
  }
  expected = engine::delta_promises(delta, info);
  return patches;
}

}  // namespace

// Maps every change onto the runtime parameters and gathers the bits it replaces, into
// prepared_. Nothing is written.
void MappedReceiver::prepare(std::span<const TensorRef> targets, std::span<const PatchRef> patches, bool relative,
                             bool decoded_here, engine::TransferCounters& transfer) {
  Laps lap;
  Prepared& p = *prepared_;
  const MappedModel& model = model_;
  const size_t T = model.hf.size();

  // Rows: every change of every HF tensor, in tensor order.
  p.tensor_rows.assign(T + 1, 0);
  p.tensor_bytes.assign(T + 1, 0);
  for (size_t t = 0; t < T; ++t) {
    p.tensor_rows[t + 1] = p.tensor_rows[t] + patches[t].count;
    p.tensor_bytes[t + 1] = p.tensor_bytes[t] + patches[t].count * model.hf[t].width();
  }
  const uint64_t rows = p.tensor_rows[T];
  // The decoder's arrays are used in place when this receiver decoded them (apply() of a compact
  // delta) and they are laid out as the rows are (one array each, tensor order: the decoder's
  // layout, checked): copying 89M changes' positions and bits cost ~0.2 s of a 15% apply.
  const SparseDelta& d = p.decoded.storage;
  bool in_place = decoded_here && d.indices.size() >= rows && d.values.size() >= p.tensor_bytes[T];
  for (size_t t = 0; t < T && in_place; ++t)
    in_place = !patches[t].count || (patches[t].index_width == 8 && patches[t].indices == d.indices.data() + p.tensor_rows[t] &&
                                     patches[t].values == d.values.data() + p.tensor_bytes[t]);
  if (in_place) {
    // The decoder validated every position (inside its tensor, strictly ascending).
    p.row_index = p.decoded.storage.indices.data();
    p.new_bits = p.decoded.storage.values.data();
  } else {
    cpu::validate(targets, patches);  // positions in range and ascending: the map's binary searches need it
    resize_scratch(p.row_index_copy, rows);
    resize_scratch(p.new_rows_copy, p.tensor_bytes[T]);
    parallel_for(T, [&](size_t t) {
      const PatchRef& patch = patches[t];
      if (!patch.count) return;
      int64_t* out = p.row_index_copy.data() + p.tensor_rows[t];
      if (patch.index_width == 8) {
        std::memcpy(out, patch.indices, patch.count * 8);
      } else {
        const int32_t* in = static_cast<const int32_t*>(patch.indices);
        for (uint64_t k = 0; k < patch.count; ++k) out[k] = in[k];
      }
      std::memcpy(p.new_rows_copy.data() + p.tensor_bytes[t], patch.values, patch.count * model.hf[t].width());
    });
    p.row_index = p.row_index_copy.data();
    p.new_bits = p.new_rows_copy.data();
  }
  lap.to(timings_.parse);

  // Map: each parameter's runs in runtime order, each taking the rows of its HF tensor that fall
  // inside it (two binary searches per run, one segment): positions come out ascending, no sort.
  // Runs with shift >= 0 (one rank: every run; fused parameters put a tensor further on) write
  // at the HF indices into the parameter seen from `shift` on, so no positions are made for them.
  p.segments.clear();
  uint64_t total = 0, shifted = 0;
  for (size_t k = 0; k < by_param_.size(); ++k)
    for (const ParamRun& r : by_param_[k]) {
      const uint64_t first = p.tensor_rows[r.hf_tensor], last = p.tensor_rows[r.hf_tensor + 1];
      if (first == last) continue;
      const int64_t* begin = p.row_index + first;
      const int64_t* end = p.row_index + last;
      const int64_t* lo = std::lower_bound(begin, end, r.hf_start);
      const int64_t* hi = std::lower_bound(lo, end, r.hf_start + r.length);
      if (lo == hi) continue;
      const int64_t shift = r.rt_start - r.hf_start;
      p.segments.push_back(Segment{static_cast<uint32_t>(k), r.hf_tensor, first + static_cast<uint64_t>(lo - begin),
                                   static_cast<uint64_t>(hi - lo), shift < 0 ? shifted : 0, shift});
      if (shift < 0) shifted += static_cast<uint64_t>(hi - lo);
      total += static_cast<uint64_t>(hi - lo);
    }
  resize_scratch(p.positions, shifted);
  const auto shifted_rows = [&](size_t k) { return p.segments[k].shift < 0 ? p.segments[k].count : 0; };
  for_row_chunks(p.segments.size(), shifted_rows, [&](size_t k, uint64_t b, uint64_t e) {
    const Segment& g = p.segments[k];
    const int64_t* in = p.row_index + g.row0;
    int64_t* out = p.positions.data() + g.first;
    for (uint64_t j = b; j < e; ++j) out[j] = in[j] + g.shift;
  });
  p.elements = total;
  lap.to(timings_.map);

  // Old bits at every write, one gather for all segments. In row order the segments cover every
  // row exactly once when each HF element is written in one place on this rank (one rank; no
  // replicated tensors): the gather's output, patch after patch, is then the old bits in row
  // order itself. Otherwise the gathered bits are sorted out per row below.
  std::vector<size_t> order(p.segments.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return p.segments[a].row0 < p.segments[b].row0; });
  uint64_t next_row = 0;
  bool rows_once = true;
  for (size_t k : order) {
    rows_once = rows_once && p.segments[k].row0 == next_row;
    next_row = p.segments[k].row0 + p.segments[k].count;
  }
  rows_once = rows_once && next_row == rows;
  if (!rows_once) std::iota(order.begin(), order.end(), size_t{0});
  std::vector<ConstTensorRef> sources;
  std::vector<PatchRef> where;
  std::vector<uint64_t> gathered_at(p.segments.size());  // per segment: its first byte gathered
  uint64_t gather_bytes = 0;
  for (size_t k : order) {
    const Segment& g = p.segments[k];
    const TensorRef view = Prepared::target(model.params[g.param], g);
    sources.push_back(ConstTensorRef{view.name, view.data, view.numel, view.width});
    where.push_back(PatchRef{g.count, p.indices(g), 8, nullptr, view.width});
    gathered_at[k] = gather_bytes;
    gather_bytes += g.count * view.width;
  }
  resize_scratch(p.old_rows, p.tensor_bytes[T]);
  if (rows_once) {
    if (!sources.empty()) engine_.gather(sources, where, p.old_rows, transfer);
    resize_scratch(p.row_held, rows);
    std::fill(p.row_held.begin(), p.row_held.end(), uint8_t{1});
    lap.to(timings_.gather);
  } else {
    resize_scratch(p.gathered, gather_bytes);
    if (!sources.empty()) engine_.gather(sources, where, p.gathered, transfer);
    lap.to(timings_.gather);
    // Old bits per row, from its first write: which segment writes a row first is decided in
    // segment order (one byte per row); the copies of segments that write every row of theirs
    // first run in parallel afterwards.
    resize_scratch(p.row_held, rows);
    std::fill(p.row_held.begin(), p.row_held.end(), uint8_t{0});
    std::vector<uint8_t> first_holder(p.segments.size(), 0);  // 1: the segment's every row is first written by it
    for (size_t k = 0; k < p.segments.size(); ++k) {
      const Segment& g = p.segments[k];
      const uint32_t w = model.params[g.param].width;
      uint8_t* held = p.row_held.data() + g.row0;
      if (std::all_of(held, held + g.count, [](uint8_t h) { return h == 0; })) {
        std::memset(held, 1, g.count);
        first_holder[k] = 1;
        continue;
      }
      // Rows this rank writes twice (one HF element in two parameters): the first write's.
      uint8_t* old = const_cast<uint8_t*>(p.bits(p.old_rows.data(), g, w));
      for (uint64_t j = 0; j < g.count; ++j)
        if (!held[j]) {
          std::memcpy(old + j * w, p.gathered.data() + gathered_at[k] + j * w, w);
          held[j] = 1;
        }
    }
    const auto first_rows = [&](size_t k) { return first_holder[k] ? p.segments[k].count : 0; };
    for_row_chunks(p.segments.size(), first_rows, [&](size_t k, uint64_t b, uint64_t e) {
      const Segment& g = p.segments[k];
      const uint32_t w = model.params[g.param].width;
      uint8_t* old = const_cast<uint8_t*>(p.bits(p.old_rows.data(), g, w));
      std::memcpy(old + b * w, p.gathered.data() + gathered_at[k] + b * w, (e - b) * w);
    });
  }
  // The compact layout: the new bits rebased on the old, in place.
  if (relative) {
    const auto tensor_rows = [&](size_t t) { return p.tensor_rows[t + 1] - p.tensor_rows[t]; };
    for_row_chunks(T, tensor_rows, [&](size_t t, uint64_t b, uint64_t e) {
      const uint32_t w = model.hf[t].width();
      const size_t off = p.tensor_bytes[t] + b * w;
      const size_t n = (e - b) * w;
      compact::rebase_values(std::span<const uint8_t>(p.new_bits + off, n), std::span<const uint8_t>(p.old_rows.data() + off, n), w,
                             std::span<uint8_t>(p.new_bits + off, n));
    });
  }
  lap.to(timings_.pack);
}

namespace {

// Σ mix(i, new) − Σ mix(i, old) per HF tensor over the changed elements this rank owns.
void owned_shifts(const MappedReceiver::Prepared& p, const MappedModel& model, std::span<uint64_t> partial) {
  const size_t T = model.hf.size();
  std::vector<const OwnedRanges*> owned(T, nullptr);
  for (const OwnedRanges& o : model.owned) owned[o.hf_tensor] = &o;
  std::vector<int64_t> idx;
  std::vector<uint8_t> nb, ob;
  std::vector<size_t> whole_tensors;
  std::vector<PatchRef> whole_patches;
  std::vector<const void*> whole_old;
  for (size_t t = 0; t < T; ++t) {
    const uint64_t first = p.tensor_rows[t], last = p.tensor_rows[t + 1];
    if (!owned[t] || first == last) continue;
    const OwnedRanges& o = *owned[t];
    const uint32_t w = model.hf[t].width();
    const int64_t* index = p.row_index + first;
    const uint8_t* new_bits = p.new_bits + p.tensor_bytes[t];
    const uint8_t* old_bits = p.old_rows.data() + p.tensor_bytes[t];
    const uint64_t n = last - first;
    // The common case (one rank, or a tensor this rank holds whole): every row owned and held.
    const bool whole = o.start.size() == 1 && o.start[0] <= index[0] && index[n - 1] < o.start[0] + o.length[0] &&
                       std::all_of(p.row_held.begin() + first, p.row_held.begin() + last, [](uint8_t h) { return h != 0; });
    if (whole) {  // hashed below, all such tensors in parallel chunks
      whole_tensors.push_back(t);
      whole_patches.push_back(PatchRef{n, index, 8, new_bits, w});
      whole_old.push_back(old_bits);
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
  const std::vector<uint64_t> shifts = digest_shifts(whole_patches, whole_old);
  for (size_t k = 0; k < whole_tensors.size(); ++k) partial[whole_tensors[k]] = shifts[k];
}

// The scatter of every segment, its values read in place from `rows` (the new or the old bits).
void scatter_segments(const MappedReceiver::Prepared& p, const uint8_t* rows, const MappedModel& model,
                      engine::SyncEngine& engine, engine::TransferCounters& transfer) {
  if (p.segments.empty()) return;
  std::vector<TensorRef> targets;
  std::vector<PatchRef> patches;
  targets.reserve(p.segments.size());
  patches.reserve(p.segments.size());
  for (const MappedReceiver::Segment& g : p.segments) {
    const TensorRef& prm = model.params[g.param];
    targets.push_back(MappedReceiver::Prepared::target(prm, g));
    patches.push_back(PatchRef{g.count, p.indices(g), 8, p.bits(rows, g, prm.width), prm.width});
  }
  engine.scatter(targets, patches, transfer);
}

}  // namespace

// The HF tensors are the targets (names and sizes; their bits live in the runtime parameters,
// where the runs put them); write() maps, gathers and scatters the changes this rank holds and
// returns the shifts of the elements it owns, which agree() sums across the ranks.
class MappedReceiver::Transaction final : public integrity::PatchTransaction {
 public:
  Transaction(MappedReceiver& receiver, engine::TransferCounters& transfer) : r_(receiver), transfer_(transfer) {}
  bool relative = false;      // compact layout: values rebased on the gathered bits
  bool decoded_here = false;  // the patches point into the receiver's own decoded delta (validated
                              // by its decoder; rebased there in place)

  void write(std::span<const TensorRef> targets, std::span<const PatchRef> patches, std::span<uint64_t> shifts) override {
    lap_.to(r_.timings_.parse);
    r_.prepare(targets, patches, relative, decoded_here, transfer_);
    lap_ = Laps();
    scatter_segments(*r_.prepared_, r_.prepared_->new_bits, r_.model_, r_.engine_, transfer_);
    lap_.to(r_.timings_.scatter);
    owned_shifts(*r_.prepared_, r_.model_, shifts);
    lap_.to(r_.timings_.digest);
  }
  void undo(std::span<const TensorRef>) override {
    scatter_segments(*r_.prepared_, r_.prepared_->old_rows.data(), r_.model_, r_.engine_, transfer_);
  }
  uint64_t agree(std::span<uint64_t> shifts, bool refuse) override {
    const uint64_t refusals = agree_across_ranks(r_.combine_, shifts, refuse);
    lap_.to(r_.timings_.digest);
    return refusals;
  }
  bool holds(size_t target) const override { return r_.served_[target]; }

 private:
  MappedReceiver& r_;
  engine::TransferCounters& transfer_;
  Laps lap_;
};

uint64_t MappedReceiver::apply(const engine::DeltaToApply& delta, engine::TransferCounters& transfer) {
  const size_t T = model_.hf.size();
  if (digests_.size() != T) recompute_digests();
  // Every rank takes part in exactly one agreement per delta, failed or not (apply_verified's
  // contract; refuse_apply for a file this rank cannot resolve), so a failure on one rank can
  // never leave the others waiting in the all-reduce.
  Transaction transaction(*this, transfer);
  ParsedDelta parsed;
  std::vector<PatchRef> patches;
  integrity::DeltaDigests expected;
  try {
    patches = resolve_changes(delta, model_.hf, prepared_->decoded, parsed, transaction.relative, expected);
    transaction.decoded_here = transaction.relative;
  } catch (...) {
    integrity::refuse_apply(T, std::current_exception(), transaction);
  }
  try {
    return apply_resolved(patches, expected, transaction);
  } catch (const Error& e) {
    throw Error(delta.file->label() + ": " + e.what(), e.kind());
  }
}

uint64_t MappedReceiver::apply_patches(std::span<const PatchRef> patches, const integrity::DeltaDigests& expected, bool relative,
                                       engine::TransferCounters& transfer) {
  if (digests_.size() != model_.hf.size()) recompute_digests();
  Transaction transaction(*this, transfer);
  transaction.relative = relative;
  return apply_resolved(patches, expected, transaction);
}

uint64_t MappedReceiver::apply_resolved(std::span<const PatchRef> patches, const integrity::DeltaDigests& expected,
                                        Transaction& transaction) {
  const size_t T = model_.hf.size();
  std::vector<TensorRef> targets(T);
  for (size_t t = 0; t < T; ++t)
    targets[t] = TensorRef{model_.hf[t].name, nullptr, model_.hf[t].numel(), model_.hf[t].width()};
  integrity::apply_verified(targets, patches, expected, digests_, version_, transaction);
  version_ = expected.model_version;
  return prepared_->elements;
}

std::optional<ranged::NeededRanges> MappedReceiver::needed_ranges() const {
  std::vector<std::vector<ranged::ElementSpan>> spans(model_.hf.size());
  for (const MappedRuns& r : model_.runs)
    for (size_t k = 0; k < r.hf_start.size(); ++k)
      spans[r.hf_tensor].push_back({static_cast<uint64_t>(r.hf_start[k]), static_cast<uint64_t>(r.hf_start[k] + r.length[k])});
  // Owned elements are held ones; listed too so that a digest share can never miss a change.
  for (const OwnedRanges& o : model_.owned)
    for (size_t k = 0; k < o.start.size(); ++k)
      spans[o.hf_tensor].push_back({static_cast<uint64_t>(o.start[k]), static_cast<uint64_t>(o.start[k] + o.length[k])});
  ranged::NeededRanges needed;
  bool everything = true;
  for (size_t t = 0; t < model_.hf.size(); ++t) {
    std::vector<ranged::ElementSpan> merged = ranged::merge_spans(std::move(spans[t]));
    const uint64_t n = model_.hf[t].numel();
    everything = everything && served_[t] && (n == 0 || (merged.size() == 1 && merged[0] == ranged::ElementSpan{0, n}));
    if (!served_[t]) {
      // Nothing of it is written here (a tied lm_head), but its digests are part of the version's
      // verified state: no elements, its records only (an indexed delta keeps them out of the
      // JSON header, so a tensor not named here would keep its old digest).
      needed.emplace(model_.hf[t].name, ranged::NeededTensor{model_.hf[t].shape, {}});
      continue;
    }
    if (!merged.empty()) needed.emplace(model_.hf[t].name, ranged::NeededTensor{model_.hf[t].shape, std::move(merged)});
  }
  // A rank that holds the whole model (TP=1) reads whole objects, once, SHA-256 checked.
  if (everything) return std::nullopt;
  return needed;
}

}  // namespace deltasync
