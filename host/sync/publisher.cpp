#include "sync/publisher.hpp"

#include <algorithm>
#include <cstring>

#include "codec/delta_io.hpp"
#include "engine/cpu_sync_engine.hpp"
#include "codec/digest.hpp"
#include "engine/integrity.hpp"
#include "sync/protocol.hpp"
#include "sync/range_hashes.hpp"
#include "format/sha256.hpp"
#include "store/http_transport.hpp"

namespace deltasync {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The run of publishers that name none (PublisherOptions::run_id).
constexpr const char* kUnnamedRun = "unnamed";

uint64_t unix_ms() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch()).count());
}

// A staged delta whose raw change set (with base values) is on the host can be merged with the
// next one; one coded on the device, or without base bits (low-memory shadow), cannot.
bool mergeable(const engine::StagedDelta& d) { return d.has_base_values && !d.coded_on_device; }

// True when the store holds exactly this manifest (a create whose answer was lost).
bool stored_manifest_is(Store& store, const protocol::Manifest& manifest) {
  const std::string text = protocol::to_json(manifest);
  try {
    const std::vector<uint8_t> stored = store.get(protocol::manifest_key(manifest.version));
    return stored.size() == text.size() && std::equal(stored.begin(), stored.end(), text.begin(),
                                                      [](uint8_t a, char b) { return a == static_cast<uint8_t>(b); });
  } catch (const NotFoundError&) {
    return false;
  }
}

}  // namespace

SparseDelta merge_deltas(const DeltaView& older, const DeltaView& newer, std::span<const TensorMeta> tensors) {
  const size_t T = tensors.size();
  if (older.num_tensors() != T || newer.num_tensors() != T) throw Error("merge_deltas: deltas describe a different number of tensors");
  if (older.base_values.size() != older.values.size()) throw Error("merge_deltas: older delta lacks base values");
  SparseDelta out;
  out.offsets.assign(1, 0);
  out.value_offsets.assign(1, 0);
  out.indices.reserve(older.total_changed() + newer.total_changed());
  out.values.reserve(older.values.size() + newer.values.size());
  out.base_values.reserve(out.values.capacity());
  for (size_t t = 0; t < T; ++t) {
    const uint32_t w = tensors[t].width();
    uint64_t i = older.offsets[t], ie = older.offsets[t + 1];
    uint64_t j = newer.offsets[t], je = newer.offsets[t + 1];
    const uint8_t* ov = older.values.data() + older.value_offsets[t];
    const uint8_t* ob = older.base_values.data() + older.value_offsets[t];
    const uint8_t* nv = newer.values.data() + newer.value_offsets[t];
    const bool newer_has_base = newer.base_values.size() == newer.values.size();
    const uint8_t* nb = newer_has_base ? newer.base_values.data() + newer.value_offsets[t] : nullptr;
    auto push = [&](int64_t index, const uint8_t* value, const uint8_t* base) {
      out.indices.push_back(index);
      out.values.insert(out.values.end(), value, value + w);
      out.base_values.insert(out.base_values.end(), base, base + w);
    };
    while (i < ie || j < je) {
      const int64_t a = i < ie ? older.indices[i] : INT64_MAX;
      const int64_t b = j < je ? newer.indices[j] : INT64_MAX;
      const uint64_t ko = i - older.offsets[t], kn = j - newer.offsets[t];
      if (a < b) {
        push(a, ov + ko * w, ob + ko * w);
        ++i;
      } else if (b < a) {
        // Only the newer delta touches it: its base bits are the older delta's result there,
        // i.e. the newer delta's own base.
        if (!nb) throw Error("merge_deltas: newer delta lacks base values");
        push(b, nv + kn * w, nb + kn * w);
        ++j;
      } else {
        push(a, nv + kn * w, ob + ko * w);  // newest value, oldest base
        ++i;
        ++j;
      }
    }
    out.offsets.push_back(out.indices.size());
    out.value_offsets.push_back(out.values.size());
  }
  return out;
}

// Where an anchor's bits are read from when its parts are uploaded: the engine's full shadow
// (which holds exactly this version's bits until the next encode moves it on) or a host copy.
// Streaming from the shadow needs no model-sized host copy; the next publish() copies what is
// still needed only if the upload has not finished by then (detach_anchor_from_shadow).
struct Publisher::AnchorSource {
  std::mutex mutex;            // from_shadow and snapshot, between the two threads
  bool from_shadow = false;
  std::vector<std::vector<uint8_t>> snapshot;  // per tensor, when !from_shadow (then immutable)
};

struct Publisher::Job {
  uint64_t version = 0;
  std::optional<uint64_t> base_version;
  bool has_delta = false;
  engine::StagedDelta staged;
  bool anchor = false;
  std::shared_ptr<AnchorSource> source;       // when anchor: where its full weights are read
  std::vector<uint64_t> full_digests;          // low-memory shadow: the weights' digests at publish time
  uint64_t merged = 1;
  Clock::time_point published_at;
  double stage_seconds = 0;
  engine::TransferCounters transfer;
  // Set once the manifest is written: a retry after a later failure (LATEST) must not upload
  // the version again, and nothing may be merged into it.
  std::optional<protocol::Manifest> committed;
  std::vector<uint64_t> result_digests;
  VersionStats committed_stats;
  // The manifest the last try was writing when it failed. Its create may have succeeded with
  // the answer lost (every retry of the exclusive create failing afterwards): the next try then
  // finds exactly these bytes in the store and finishes the version instead of refusing it as
  // "already exists" forever.
  std::optional<protocol::Manifest> attempted_manifest;
  std::vector<uint64_t> attempted_digests;
  VersionStats attempted_stats;
};

void check_options(const PublisherOptions& options) {
  if (options.anchor_part_bytes == 0)
    throw Error("publisher: option anchor_part_bytes must be positive", ErrorKind::kInvalidArgument);
  if (options.parallel_uploads == 0)
    throw Error("publisher: option parallel_uploads must be positive", ErrorKind::kInvalidArgument);
  if (!(options.anchor_share >= 0))
    throw Error("publisher: option anchor_share must be a non-negative number", ErrorKind::kInvalidArgument);
  if (options.compact_block_elements == 0 || options.compact_block_elements > (1u << 24))
    throw Error("publisher: option compact_block_elements must be 1 .. 16777216", ErrorKind::kInvalidArgument);
  if (!compact::is_tile_count(options.compact_max_tiles))
    throw Error("publisher: option compact_max_tiles must be 1, 2, 4 or 8", ErrorKind::kInvalidArgument);
  if (!compact::is_known_layout(options.compact_layout))
    throw Error("publisher: option compact_layout must be 1 or 2", ErrorKind::kInvalidArgument);
  if (!compact::is_known_version(options.compact_version))
    throw Error("publisher: option compact_version must be 1 or 2", ErrorKind::kInvalidArgument);
}

compact::Options compact_options(const PublisherOptions& options) {
  compact::Options out;
  out.block_elements = options.compact_block_elements;
  out.max_tiles = options.compact_max_tiles;
  out.layout = options.compact_layout;
  out.version = options.compact_version;
  return out;
}

protocol::Fence claim_store_for(Store& store, const PublisherOptions& options) {
  return protocol::claim_store(store, options.run_id.empty() ? std::string(kUnnamedRun) : options.run_id, options.take_over);
}

Publisher::Publisher(std::shared_ptr<Store> store, std::vector<TensorMeta> tensors, PublisherOptions options)
    : Publisher(std::move(store), std::move(tensors), std::make_unique<engine::CpuSyncEngine>(), std::move(options)) {}

Publisher::Publisher(std::shared_ptr<Store> store, std::vector<TensorMeta> tensors,
                     std::unique_ptr<engine::SyncEngine> engine, PublisherOptions options)
    : store_(std::move(store)), tensors_(std::move(tensors)), engine_(std::move(engine)), options_(std::move(options)) {
  if (!store_) throw Error("publisher: no store");
  if (!engine_) throw Error("publisher: no engine");
  check_options(options_);
  try {
    format_ = parse_delta_format(options_.delta_format);
  } catch (const Error& e) {
    throw Error(std::string("publisher: ") + e.what(), ErrorKind::kInvalidArgument);
  }
  if (format_ == DeltaFormat::Compact && engine_->shadow_kind() == engine::ShadowKind::kLowByte)
    throw Error("publisher: format 'compact' codes values relative to the base bits, which the low-memory shadow does "
                "not keep; use format 'trl' with the low-memory shadow",
                ErrorKind::kInvalidArgument);
  if (format_ == DeltaFormat::Compact && options_.compact_version != compact::kFormatVersion1 &&
      engine_->device() != engine::Device::kCpu)
    throw Error("publisher: compact_version " + std::to_string(options_.compact_version) +
                    " is written by the CPU encoder only; this engine runs on " + std::string(engine::device_name(engine_->device())),
                ErrorKind::kInvalidArgument);
  options_.max_pending = std::max<size_t>(options_.max_pending, 1);
  for (const auto& t : tensors_) model_bytes_ += t.numel() * t.width();
  fence_ = claim_store_for(*store_, options_);
  note("claimed " + store_->url() + " for run " + fence_.run_id + ", epoch " + std::to_string(fence_.epoch));
  worker_ = std::thread([this] { worker_loop(); });
}

Publisher::~Publisher() {
  {
    // Finish what is queued, but never retry an upload whose failure the caller has already
    // been told about (or is about to be lost with this object): a version must not become
    // visible after the caller saw its publish fail and moved on.
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return paused_ || (queue_.empty() && !busy_); });
    stopping_ = true;
  }
  changed_.notify_all();
  worker_.join();
}

void Publisher::note(const std::string& line) const {
  if (options_.log) options_.log(line);
}

void Publisher::restore(const HostModel& shadow, const PublisherState& state) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (staged_version_ || busy_ || !queue_.empty()) throw Error("publisher: restore must come before the first publish");
  if (shadow.tensors.size() != tensors_.size()) throw Error("publisher: state has " + std::to_string(shadow.tensors.size()) + " tensors, the model " + std::to_string(tensors_.size()));
  for (size_t t = 0; t < tensors_.size(); ++t)
    if (shadow.tensors[t].name != tensors_[t].name || shadow.tensors[t].dtype != tensors_[t].dtype || shadow.tensors[t].shape != tensors_[t].shape)
      throw Error("publisher: state tensor " + shadow.tensors[t].name + " does not match the model's " + tensors_[t].name);
  if (engine_->device() != engine::Device::kCpu) throw Error("publisher: restore takes a host shadow; this engine runs on " + std::string(engine::device_name(engine_->device())));
  const auto refs = shadow.const_refs();
  uploaded_digests_ = shadow.digests.size() == refs.size() ? shadow.digests : digest_tensors(refs);
  engine_->reset_shadow(refs);
  published_digests_ = uploaded_digests_;
  uploaded_ = state;
  staged_version_ = state.last_version;
  staged_anchor_version_ = state.last_anchor_version;
}

void PublisherState::record_visible(uint64_t version, bool anchor, uint64_t delta_bytes) {
  last_version = version;
  if (anchor) {
    last_anchor_version = version;
    delta_bytes_since_anchor = 0;
  } else {
    delta_bytes_since_anchor += delta_bytes;
  }
}

bool anchor_rule_due(const PublisherOptions& options, uint64_t version, uint64_t last_anchor_version,
                     uint64_t delta_bytes_since_anchor, uint64_t model_bytes) {
  if (options.anchor_every && version - last_anchor_version >= options.anchor_every) return true;
  return options.anchor_share > 0 && double(delta_bytes_since_anchor) > options.anchor_share * double(model_bytes);
}

bool Publisher::anchor_due(uint64_t version) const {
  if (!staged_version_) return true;
  if (!staged_anchor_version_) return true;
  std::lock_guard<std::mutex> lock(mutex_);
  return anchor_rule_due(options_, version, *staged_anchor_version_, uploaded_.delta_bytes_since_anchor, model_bytes_);
}

void Publisher::stage_anchor(Job& job, std::span<const ConstTensorRef> current) {
  job.anchor = true;
  auto source = std::make_shared<AnchorSource>();
  if (engine_->shadow_kind() == engine::ShadowKind::kFull) {
    // The shadow was just brought to `current`'s bits (reset or encode): stream from it.
    source->from_shadow = true;
    shadow_source_ = source;
  } else {
    // A low-byte shadow lacks the high bytes: the anchor takes a host copy now.
    source->snapshot.resize(tensors_.size());
    for (size_t t = 0; t < tensors_.size(); ++t) {
      source->snapshot[t].resize(tensors_[t].numel() * tensors_[t].width());
      engine_->read(current[t], 0, source->snapshot[t]);  // counted with the upload's reads
    }
  }
  job.source = std::move(source);
  staged_anchor_version_ = job.version;
}

void Publisher::detach_anchor_from_shadow() {
  std::shared_ptr<AnchorSource> source = shadow_source_.lock();
  shadow_source_.reset();
  if (!source) return;  // uploaded already (or merged away)
  std::lock_guard<std::mutex> lock(source->mutex);
  if (!source->from_shadow) return;
  std::lock_guard<std::mutex> engine_lock(engine_mutex_);
  std::vector<std::vector<uint8_t>> copy(tensors_.size());
  for (size_t t = 0; t < tensors_.size(); ++t) {
    copy[t].resize(tensors_[t].numel() * tensors_[t].width());
    engine_->read(engine_->shadow_tensor(t), 0, copy[t]);
  }
  source->snapshot = std::move(copy);
  source->from_shadow = false;
  note("the anchor of version " + std::to_string(staged_anchor_version_.value_or(0)) +
       " was still uploading: copied its weights to host memory before the shadow moved on");
}

void Publisher::set_stream(void* stream) {
  std::lock_guard<std::mutex> lock(engine_mutex_);
  engine_->set_stream(stream);
}

void Publisher::publish(uint64_t version, std::span<const ConstTensorRef> current, bool force_anchor) {
  const auto start = Clock::now();
  if (current.size() != tensors_.size()) throw Error("publish: expected " + std::to_string(tensors_.size()) + " tensors, got " + std::to_string(current.size()));
  for (size_t t = 0; t < current.size(); ++t)
    if (current[t].numel != tensors_[t].numel() || current[t].width != tensors_[t].width())
      throw Error("publish: tensor " + tensors_[t].name + " has a different size than the model describes");
  if (staged_version_ && version <= *staged_version_)
    throw Error("publish: version " + std::to_string(version) + " is not newer than " + std::to_string(*staged_version_),
                ErrorKind::kInvalidArgument);
  const bool low_byte = engine_->shadow_kind() == engine::ShadowKind::kLowByte;
  auto job = std::make_unique<Job>();
  job->version = version;
  job->published_at = start;
  // An anchor still streaming from the shadow gets its own copy before this encode moves the
  // shadow on (takes the anchor's lock, then the engine's).
  if (engine_->has_shadow()) detach_anchor_from_shadow();
  std::unique_lock<std::mutex> engine_lock(engine_mutex_);
  if (!engine_->has_shadow()) {
    // First version of this publisher: the shadow starts as a copy and the version is an anchor.
    engine_->reset_shadow(current);
    if (low_byte) published_digests_ = engine_->digests(current);
  } else {
    job->base_version = staged_version_;
    job->has_delta = true;
    engine::EncodeRequest request;
    request.want_coded = format_ == DeltaFormat::Compact && engine_->device() != engine::Device::kCpu;
    request.compact = compact_options(options_);
    request.tensors = tensors_;
    engine_->encode(current, request, job->staged);
    job->transfer.add(job->staged.transfer);
    if (low_byte) {
      job->full_digests = engine_->digests(current);
      // A tensor whose digest moved although no change of it was seen lost a change to the
      // low-byte shadow; the receiver could not check it, so this version becomes an anchor.
      for (size_t t = 0; t < tensors_.size(); ++t) {
        if (job->staged.counts[t] == 0 && job->full_digests[t] != published_digests_[t]) {
          note("version " + std::to_string(version) + ": the low-memory shadow missed a change in " + tensors_[t].name +
               "; publishing an anchor");
          job->has_delta = false;
          job->staged.clear();
          force_anchor = true;
          break;
        }
      }
      published_digests_ = job->full_digests;
    }
  }
  bool anchor = force_anchor || anchor_due(version);
  {
    // Merging into a pending anchor makes the merged version an anchor: it needs these weights.
    std::lock_guard<std::mutex> lock(mutex_);
    if (queue_.size() >= options_.max_pending && (queue_.back()->anchor || !queue_.back()->has_delta)) anchor = true;
  }
  if (anchor) stage_anchor(*job, current);
  engine_lock.unlock();
  staged_version_ = version;
  job->stage_seconds = seconds_since(start);
  {
    VersionStats st;
    st.version = version;
    st.base_version = job->has_delta ? job->base_version : std::nullopt;
    st.anchor = job->anchor;
    st.changed_elements = job->staged.total_changed();
    st.stage_seconds = job->stage_seconds;
    st.transfer = job->transfer;
    st.coded_on_device = job->staged.coded_on_device;
    std::lock_guard<std::mutex> lock(mutex_);
    last_staged_ = st;
    history_[version] = st;
  }
  // A background failure from before this call is reported after this version is safely queued
  // (the shadow already moved on, so dropping the version would break the chain). One that
  // arises meanwhile -- this version's own upload may fail before publish() returns -- waits
  // for the next publish() or flush(), so a caller never sees its version fail in the call
  // that staged it.
  std::exception_ptr earlier;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    earlier = failure_;
  }
  enqueue(std::move(job));
  std::lock_guard<std::mutex> lock(mutex_);
  if (failure_ && failure_ == earlier) {
    auto f = failure_;
    failure_ = nullptr;
    std::rethrow_exception(f);
  }
}

VersionStats Publisher::last_staged() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return last_staged_;
}

std::vector<VersionStats> Publisher::history() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<VersionStats> out;
  for (const auto& [v, st] : history_) out.push_back(st);
  return out;
}

void Publisher::enqueue(std::unique_ptr<Job> job) {
  std::string merged_note;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    // Uploads fell behind: fold this version into the newest pending one when the two can be
    // one version. A pending anchor can only absorb a version that brings its own full weights
    // (otherwise the merged anchor would carry the older version's weights under the newer
    // number): publish() makes such a version an anchor when it sees the queue full, but the
    // queue can fill up after that look (a failed upload goes back to its front), so it is
    // checked again here. Two deltas fold only when both raw change sets are on the host; a
    // version with full weights absorbs anything before it (its delta is then dropped).
    auto can_fold = [&](const Job& back) {
      if (back.committed || (!job->anchor && back.anchor)) return false;
      if (back.has_delta && job->has_delta && !(mergeable(back.staged) && mergeable(job->staged))) return job->anchor;
      return true;
    };
    if (queue_.size() >= options_.max_pending && !can_fold(*queue_.back())) {
      // Nothing to fold into: wait for the oldest upload (bounded memory however slow the store).
      if (paused_) retry_requested_ = true;
      changed_.notify_all();
      changed_.wait(lock, [&] { return queue_.size() < options_.max_pending || (paused_ && failure_) || stopping_; });
    }
    bool fold = queue_.size() >= options_.max_pending && can_fold(*queue_.back());
    SparseDelta merged_changes;
    if (fold && queue_.back()->has_delta && job->has_delta && mergeable(queue_.back()->staged) && mergeable(job->staged)) {
      // The shadow has already moved on to this version: dropping it on a failed merge (out of
      // memory) would break the chain for good, so it is then queued unmerged instead.
      try {
        merged_changes = merge_deltas(queue_.back()->staged.changes.view(), job->staged.changes.view(), tensors_);
      } catch (const std::exception& e) {
        fold = false;
        merged_note = "could not merge version " + std::to_string(job->version) + " into a pending upload (" + e.what() +
                      "); queued on its own";
      }
    }
    if (fold) {
      Job& back = *queue_.back();
      if (back.has_delta && job->has_delta && mergeable(back.staged) && mergeable(job->staged)) {
        back.staged.changes = std::move(merged_changes);
        for (size_t t = 0; t < tensors_.size(); ++t)
          back.staged.counts[t] = back.staged.changes.offsets[t + 1] - back.staged.changes.offsets[t];
        back.full_digests = std::move(job->full_digests);
      } else if (job->anchor) {
        // The newer version's full weights stand alone: the merged version is an anchor only.
        back.has_delta = false;
        back.staged.clear();
        back.full_digests.clear();
      } else if (!back.has_delta) {
        // The pending version is anchor-only and the new one an anchor too (publish() saw to it).
      }
      if (job->anchor) back.source = std::move(job->source);
      back.anchor = back.anchor || job->anchor;
      if (back.anchor && !back.source) throw Error("publisher: merged anchor without weights (internal error)");
      history_[back.version].merged_into = job->version;
      VersionStats& merged = history_[job->version];
      merged.merged_versions = back.merged + job->merged;
      merged.base_version = back.has_delta ? back.base_version : std::nullopt;
      back.version = job->version;
      back.merged += job->merged;
      back.stage_seconds += job->stage_seconds;
      back.transfer.add(job->transfer);
      back.attempted_manifest.reset();  // a different version now: an earlier try's manifest is not its own
      merged_note = "merged version " + std::to_string(job->version) + " into a pending upload (" + std::to_string(back.merged) + " versions)";
    } else {
      queue_.push_back(std::move(job));
    }
    // A failed upload waiting at the front is tried again now. (Only a failure already seen
    // counts: one still in progress must be reported before it is retried.)
    if (paused_) retry_requested_ = true;
  }
  changed_.notify_all();
  // The log callback runs without the lock: it may block (a Python logger takes the GIL) while
  // another thread asks for stats() or state().
  if (!merged_note.empty()) note(merged_note);
}

void Publisher::flush() {
  std::unique_lock<std::mutex> lock(mutex_);
  if (failure_) {  // report a failure once; the failed job stays queued for the next try
    auto f = failure_;
    failure_ = nullptr;
    std::rethrow_exception(f);
  }
  if (paused_) retry_requested_ = true;
  changed_.notify_all();
  changed_.wait(lock, [&] { return (queue_.empty() && !busy_) || (failure_ && !busy_); });
  if (failure_) {
    auto f = failure_;
    failure_ = nullptr;
    std::rethrow_exception(f);
  }
}

std::vector<VersionStats> Publisher::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

PublisherState Publisher::state() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return uploaded_;
}

void Publisher::worker_loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    // After a failure the failed job waits at the front until the caller publishes again or
    // flushes (a store that is down is not hammered in a loop).
    changed_.wait(lock, [&] { return stopping_ || (!queue_.empty() && (!paused_ || retry_requested_)); });
    // Shutting down: stop once nothing is queued, or when what is left already failed and
    // nobody asked for another try (the destructor's flush reported it).
    if (stopping_ && (queue_.empty() || (paused_ && !retry_requested_))) return;
    retry_requested_ = false;
    paused_ = false;
    std::unique_ptr<Job> job = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    std::exception_ptr error;
    try {
      upload(*job);
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    busy_ = false;
    if (error) {
      failure_ = error;
      paused_ = true;
      queue_.push_front(std::move(job));
    }
    changed_.notify_all();
  }
}

void Publisher::upload(Job& job) {
  auto t0 = Clock::now();
  Store& store = *store_;
  const std::string manifest_key = protocol::manifest_key(job.version);
  if (!job.committed && job.attempted_manifest && stored_manifest_is(store, *job.attempted_manifest)) {
    job.committed = std::move(job.attempted_manifest);
    job.result_digests = std::move(job.attempted_digests);
    job.committed_stats = job.attempted_stats;
    job.committed_stats.visible_seconds = seconds_since(job.published_at);
    job.attempted_manifest.reset();
  }
  if (job.committed) {  // the manifest is out; only LATEST and the bookkeeping were missing
    protocol::advance_latest(store, job.version, fence_);
    finish(job, job.committed_stats, job.result_digests);
    return;
  }
  VersionStats st;
  st.version = job.version;
  st.base_version = job.has_delta ? job.base_version : std::nullopt;
  st.anchor = job.anchor;
  st.merged_versions = job.merged;
  st.stage_seconds = job.stage_seconds;
  st.transfer = job.transfer;
  st.coded_on_device = job.staged.coded_on_device;

  // 1. Encode: delta file with integrity digests, anchor parts.
  std::vector<uint8_t> delta_bytes;
  std::vector<uint64_t> result_digests;
  PublisherState before;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    before = uploaded_;
  }
  if (job.has_delta) {
    if (job.base_version != before.last_version)
      throw Error("publisher: version " + std::to_string(job.version) + " is based on " + std::to_string(*job.base_version) +
                  " but the store's last version from this publisher is " +
                  (before.last_version ? std::to_string(*before.last_version) : "none"));
    if (uploaded_digests_.size() != tensors_.size()) throw Error("publisher: no digests of the base version (restore() not called?)");
    engine::StagedDelta& staged = job.staged;
    staged.fill_offsets(tensors_);
    // Result digests in O(changed): from the engine's shifts, from the base and new bits, or
    // (low-memory shadow) the full digests taken at publish time.
    result_digests = uploaded_digests_;
    if (!job.full_digests.empty()) {
      result_digests = job.full_digests;
    } else {
      staged.advance_digests(result_digests, tensors_);
    }
    integrity::DeltaDigests dd;
    dd.model_version = job.version;
    dd.base_version = job.base_version;
    for (size_t t = 0; t < tensors_.size(); ++t) {
      if (staged.counts[t] == 0) continue;
      dd.base.emplace(tensors_[t].name, uploaded_digests_[t]);
      dd.result.emplace(tensors_[t].name, result_digests[t]);
    }
    DeltaInfo info;
    integrity::put_delta_digests(info, dd);
    if (staged.coded_on_device) {
      delta_bytes = compact::serialize_compact_delta(tensors_, staged.changes.view(), info, staged.coded, compact_options(options_));
    } else {
      delta_bytes = serialize_delta(format_, tensors_, staged.changes.view(), info, compact_options(options_));
    }
    st.changed_elements = staged.total_changed();
  }
  st.encode_seconds = seconds_since(t0);

  // 2. Upload objects under fresh names, then the manifest (exclusive), then LATEST.
  auto t1 = Clock::now();
  protocol::check_fence(store, fence_);  // a fenced-off publisher uploads nothing more
  if (store.head(manifest_key)) throw Error(store.describe(manifest_key) + ": version " + std::to_string(job.version) + " already exists");
  protocol::Manifest m;
  m.version = job.version;
  m.fence = fence_;
  const std::string nonce = protocol::new_nonce();
  if (job.has_delta) {
    m.delta = ranged::put_delta_object(store, protocol::delta_key(job.version, nonce), delta_bytes, format_);
    m.base_version = job.base_version;
    m.delta_format = std::string(delta_format_name(format_));
    m.changed_elements = st.changed_elements;
    st.delta_bytes = m.delta->size;
  }
  if (job.anchor) m.anchor_parts = upload_anchor(job, nonce, result_digests, st);
  m.latest_anchor = job.anchor ? std::optional<uint64_t>(job.version) : before.last_anchor_version;
  for (const auto& t : tensors_) m.total_elements += t.numel();
  m.model_bytes = model_bytes_;
  m.digest_algorithm = std::string(integrity::kDigestAlgorithm);
  for (size_t t = 0; t < tensors_.size(); ++t) m.digests[tensors_[t].name] = digest_to_hex(result_digests[t]);
  m.created_unix_ms = unix_ms();
  job.attempted_manifest = m;
  job.attempted_digests = result_digests;
  job.attempted_stats = st;
  job.attempted_stats.upload_seconds = seconds_since(t1);
  if (!protocol::write_manifest(store, m))
    throw Error(store.describe(manifest_key) + ": version " + std::to_string(job.version) + " was published by someone else meanwhile");
  st.upload_seconds = seconds_since(t1);
  st.visible_seconds = seconds_since(job.published_at);
  job.committed = std::move(m);
  job.result_digests = result_digests;
  job.committed_stats = st;
  protocol::advance_latest(store, job.version, fence_);
  finish(job, st, result_digests);
}

std::vector<protocol::ObjectRef> Publisher::upload_anchor(Job& job, const std::string& nonce, std::vector<uint64_t>& digests,
                                                          VersionStats& st) {
  // Parts at tensor boundaries, each at most anchor_part_bytes unless one tensor is larger.
  std::vector<std::vector<size_t>> groups(1);
  uint64_t in_group = 0;
  for (size_t t = 0; t < tensors_.size(); ++t) {
    const uint64_t n = tensors_[t].numel() * tensors_[t].width();
    if (!groups.back().empty() && in_group + n > options_.anchor_part_bytes) {
      groups.emplace_back();
      in_group = 0;
    }
    groups.back().push_back(t);
    in_group += n;
  }
  const bool check_chain = job.has_delta;  // digests holds the delta chain's result digests
  std::vector<uint64_t> full(tensors_.size(), 0);
  std::vector<protocol::ObjectRef> refs(groups.size());
  std::vector<uint64_t> part_bytes(groups.size(), 0);
  AnchorSource& source = *job.source;
  // Each of up to parallel_uploads threads reads one part into host memory, hashes it (the
  // anchor's digests come from the bits uploaded), serializes and uploads it, then frees it.
  http::run_parallel(groups.size(), options_.parallel_uploads, [&](size_t k) {
    std::vector<std::vector<uint8_t>> own;  // this part's bits, when read from the shadow
    std::vector<std::span<const uint8_t>> bits;
    {
      std::lock_guard<std::mutex> lock(source.mutex);
      if (source.from_shadow) {
        std::lock_guard<std::mutex> engine_lock(engine_mutex_);
        for (size_t t : groups[k]) {
          own.emplace_back(tensors_[t].numel() * tensors_[t].width());
          engine_->read(engine_->shadow_tensor(t), 0, own.back());
          bits.emplace_back(own.back());
        }
      } else {
        for (size_t t : groups[k]) bits.emplace_back(source.snapshot[t]);  // immutable from here
      }
    }
    std::vector<st::WriteTensor> write;
    integrity::DigestMap part_digests;
    for (size_t i = 0; i < groups[k].size(); ++i) {
      const size_t t = groups[k][i];
      const ConstTensorRef ref{tensors_[t].name, bits[i].data(), tensors_[t].numel(), tensors_[t].width()};
      full[t] = digest_tensors(std::span(&ref, 1))[0];
      if (check_chain && full[t] != digests[t])
        throw Error("publisher: version " + std::to_string(job.version) + ": the anchor's weights disagree with the delta chain's digests (tensor " +
                    tensors_[t].name + ")");
      write.push_back(st::WriteTensor{tensors_[t].name, tensors_[t].dtype, tensors_[t].shape, bits[i]});
      part_digests.emplace(tensors_[t].name, full[t]);
    }
    st::Metadata md{{"sparse", "False"}, {"format", "anchor"}, {"model_version", std::to_string(job.version)},
                    {"anchor_part", std::to_string(k) + "/" + std::to_string(groups.size())}};
    integrity::put_checkpoint_digests(md, part_digests);
    const std::vector<uint8_t> part = st::serialize(write, md);
    part_bytes[k] = part.size();
    refs[k] = protocol::put_object(*store_, protocol::anchor_part_key(job.version, nonce, k), part);
  });
  for (uint64_t n : part_bytes) st.anchor_bytes += n;
  if (engine_->device() != engine::Device::kCpu)
    for (const auto& t : tensors_) st.transfer.device_to_host_bytes += t.numel() * t.width();
  digests = std::move(full);
  return refs;
}

void Publisher::finish(const Job& job, const VersionStats& st, const std::vector<uint64_t>& result_digests) {
  Store& store = *store_;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    uploaded_.record_visible(job.version, job.anchor, st.delta_bytes);
    uploaded_digests_ = result_digests;
    stats_.push_back(st);
    VersionStats& h = history_[job.version];
    h = st;
    h.visible = true;
  }
  note("version " + std::to_string(job.version) + " visible: " + (job.anchor ? "anchor " + std::to_string(st.anchor_bytes) + " B, " : std::string()) +
       (job.has_delta ? "delta " + std::to_string(st.delta_bytes) + " B" : "no delta"));

  // 3. Retention after each new anchor; a failure here never un-publishes anything.
  if (job.anchor && options_.keep_anchors) {
    try {
      auto r = protocol::apply_retention(store, options_.keep_anchors);
      if (!r.deleted_versions.empty() || r.aborted_uploads)
        note("retention: deleted " + std::to_string(r.deleted_versions.size()) + " versions, " + std::to_string(r.deleted_bytes) +
             " bytes; aborted " + std::to_string(r.aborted_uploads) + " unfinished uploads");
    } catch (const Error& e) {
      note(std::string("retention skipped: ") + e.what());
    }
  }
}

}  // namespace deltasync
