#include "sync/shard_publish.hpp"

#include <nlohmann/json.hpp>

#include "codec/delta_io.hpp"
#include "codec/digest.hpp"
#include "core/error.hpp"
#include "engine/cpu_sync_engine.hpp"
#include "engine/integrity.hpp"
#include "sync/range_hashes.hpp"
#include "sync/shard_parts.hpp"
#include "sync/shard_resume.hpp"

namespace deltasync {
namespace {

using json = nlohmann::json;

}  // namespace

// The fence travels in LATEST's own text form (protocol::latest_text), so it has one reader.
std::string claim_to_json(const ClaimOutcome& c) {
  return json{{"fence", c.fence ? json(protocol::latest_text(protocol::LatestPointer{std::nullopt, c.fence})) : json(nullptr)},
              {"error", c.error}}
      .dump();
}

ClaimOutcome claim_from_json(std::string_view text, const std::string& label) {
  try {
    const json j = json::parse(text);
    ClaimOutcome c;
    c.error = j.at("error").get<std::string>();
    if (!j.at("fence").is_null()) {
      c.fence = protocol::parse_latest_pointer(j.at("fence").get<std::string>(), label).fence;
      if (!c.fence) throw BadInputError(label + ": a claim without its fence");
    } else if (c.error.empty()) {
      throw BadInputError(label + ": a refused claim without its reason");
    }
    return c;
  } catch (const json::exception& e) {
    throw BadInputError(label + ": malformed claim outcome (" + e.what() + ")");
  }
}

ClaimOutcome claim_for_group(Store& store, const PublisherOptions& options) {
  ClaimOutcome c;
  try {
    c.fence = claim_store_for(store, options);
  } catch (const std::exception& e) {
    c.error = e.what();
  }
  return c;
}

ShardPublisher::ShardPublisher(std::shared_ptr<Store> store, std::vector<ShardTensor> tensors, uint64_t rank, const ClaimOutcome& claim,
                               std::unique_ptr<engine::SyncEngine> engine, PublisherOptions options)
    : store_(std::move(store)), tensors_(std::move(tensors)), rank_(rank), engine_(std::move(engine)), options_(std::move(options)) {
  if (!claim.fence) throw protocol::FencedError(claim.error);  // rank 0's refusal, raised alike on every rank
  fence_ = *claim.fence;
  if (!store_) throw Error("shard publisher: no store");
  if (!engine_) engine_ = std::make_unique<engine::CpuSyncEngine>();
  check_options(options_);
  try {
    format_ = parse_delta_format(options_.delta_format);
  } catch (const Error& e) {
    throw Error(std::string("shard publisher: ") + e.what(), ErrorKind::kInvalidArgument);
  }
  if (engine_->shadow_kind() != engine::ShadowKind::kFull)
    throw Error("shard publisher: needs a full shadow (the low-memory shadow is not supported for sharded models)",
                ErrorKind::kInvalidArgument);
  for (size_t t = 0; t < tensors_.size(); ++t) {
    const ShardTensor& x = tensors_[t];
    const uint64_t numel = x.full.numel();
    if (!x.placement.empty() && (x.placement.run_stride < x.placement.run_length || x.placement.end() > numel))
      throw Error("shard publisher: tensor " + x.full.name + ": placement " + placement_text(x.placement) + " does not fit its " +
                      std::to_string(numel) + " elements",
                  ErrorKind::kInvalidArgument);
    if (x.rule.kind != PlacementRule::Kind::kExplicit && rule_placement(x.rule, x.full.shape, x.rule.coordinate) != x.placement)
      throw Error("shard publisher: tensor " + x.full.name + ": placement " + placement_text(x.placement) +
                      " is not the one its rule gives at coordinate " + std::to_string(x.rule.coordinate),
                  ErrorKind::kInvalidArgument);
    full_.push_back(x.full);
    model_bytes_ += numel * x.full.width();
    if (!x.placement.empty()) held_.push_back(t);
  }
  digests_.assign(tensors_.size(), 0);
  table_receipt_.rank = rank_;
  describe_table(tensors_, table_receipt_);
}

ShardPublisher::~ShardPublisher() = default;

PartReceipt ShardPublisher::recover() {
  const uint64_t since = fence_.since.value_or(0);
  try {
    if (shadow_started_ || pending_version_) throw Error("resume must come before the first publish");
    PartReceipt receipt = table_receipt_;
    receipt.version = since;
    receipt.partials.assign(tensors_.size(), 0);
    if (fence_.since) {  // else an empty store at the claim: nothing to recover
      recovered_ = std::make_unique<ShardRecovery>(recover_shard(*store_, tensors_, fence_));
      receipt.partials = recovered_->partials;
      resume_counters_ = recovered_->counters;
    }
    return receipt;
  } catch (const std::exception& e) {
    recovered_.reset();
    return failed_receipt(rank_, since, e.what(), false, tensors_.size());
  }
}

std::optional<uint64_t> ShardPublisher::adopt(std::span<const PartReceipt> receipts, std::span<const uint64_t> digests,
                                             std::span<const std::vector<ShardTensor>> tables) {
  if (!fence_.since) return std::nullopt;
  const uint64_t since = *fence_.since;
  // Every rank holds the same receipts and sums: a failure anywhere throws the same line
  // everywhere, and when none failed every rank has its recovery (and the same manifest's digests).
  check_recovery(GatheredReceipts{receipts, digests, tensors_, tables}, since,
                 recovered_ ? std::span<const uint64_t>(recovered_->expected) : std::span<const uint64_t>());
  if (!recovered_) throw Error("resume from version " + std::to_string(since) + ": this rank has not recovered its shard");
  std::vector<ConstTensorRef> refs;
  std::vector<std::unique_ptr<engine::EngineMemory>> memory;
  for (size_t i = 0; i < held_.size(); ++i) {
    const TensorMeta& m = full_[held_[i]];
    const std::vector<uint8_t>& bits = recovered_->local[i];
    memory.push_back(engine_->allocate(bits.size()));
    const uint64_t numel = tensors_[held_[i]].placement.numel();
    engine_->write(TensorRef{m.name, memory.back()->data(), numel, m.width()}, 0, bits);
    refs.push_back(ConstTensorRef{m.name, memory.back()->data(), numel, m.width()});
  }
  if (!refs.empty()) engine_->reset_shadow(refs);
  resume_staging_ = std::move(memory);
  shadow_started_ = true;
  broken_ = false;
  committed_ = recovered_->state;
  digests_ = recovered_->partials;
  recovered_.reset();
  return since;
}

bool ShardPublisher::anchor_due(uint64_t version) const {
  if (broken_ || !committed_.last_version || !committed_.last_anchor_version) return true;
  return anchor_rule_due(options_, version, *committed_.last_anchor_version, committed_.delta_bytes_since_anchor, model_bytes_);
}

PartReceipt ShardPublisher::publish_part(uint64_t version, std::span<const ConstTensorRef> local, bool anchor) {
  const size_t T = tensors_.size();
  if (local.size() != T) throw Error("publish: expected " + std::to_string(T) + " tensors, got " + std::to_string(local.size()));
  if (pending_version_ && version <= *pending_version_)
    throw Error("publish: version " + std::to_string(version) + " is not newer than " + std::to_string(*pending_version_),
                ErrorKind::kInvalidArgument);
  if (!fenced_.empty()) throw protocol::FencedError(fenced_);  // the group was fenced off: it stops
  try {
    protocol::check_fence(*store_, fence_);  // a fenced-off rank uploads nothing more
  } catch (const protocol::FencedError& e) {
    fenced_ = e.what();
    throw;
  }
  std::vector<ConstTensorRef> held;
  std::vector<Placement> held_placements;
  for (size_t t : held_) {
    const ShardTensor& x = tensors_[t];
    if (local[t].numel != x.placement.numel() || local[t].width != x.full.width())
      throw Error("publish: tensor " + x.full.name + " shard holds " + std::to_string(local[t].numel) + " elements of " +
                  std::to_string(local[t].width) + " bytes; its placement " + placement_text(x.placement) + " needs " +
                  std::to_string(x.placement.numel()) + " of " + std::to_string(x.full.width()));
    held.push_back(local[t]);
    held_placements.push_back(x.placement);
  }
  // A delta needs the committed base on every rank; otherwise (first version, or the last one
  // failed somewhere) the shadow restarts here and the version is an anchor only.
  const bool with_delta = shadow_started_ && !broken_ && committed_.last_version.has_value();
  if (!with_delta) anchor = true;
  pending_version_ = version;
  broken_ = true;  // until conclude() hears that this version is visible

  PartReceipt receipt = table_receipt_;
  receipt.version = version;
  receipt.anchor = anchor;
  receipt.delta_format = std::string(delta_format_name(format_));
  std::vector<uint64_t> result = digests_;
  const std::string nonce = protocol::new_nonce();
  if (!with_delta) {
    if (!held.empty()) engine_->reset_shadow(held);
    shadow_started_ = true;
  } else {
    receipt.base_version = committed_.last_version;
    engine::StagedDelta staged;
    engine::EncodeRequest request;  // raw changes on the host: their positions are translated here
    if (!held.empty()) engine_->encode(held, request, staged);
    resume_staging_.clear();  // the encode has read the shadow reset from them
    if (!held_.empty() && !staged.has_base_values)
      throw Error("publish: the engine staged no base bits (a full shadow is needed for shard parts)");
    // The engine's change set in shard coordinates -> the tensors this rank changed, in full
    // coordinates: the part names only those (its header grows with them, not with the model).
    SparseDelta part;
    part.offsets.assign(1, 0);
    part.value_offsets.assign(1, 0);
    std::vector<TensorMeta> changed_meta;
    std::vector<size_t> changed_at;  // model index of each
    if (!held.empty()) {
      const DeltaView local_view = staged.changes.view();
      for (size_t k = 0; k < held_.size(); ++k) {
        const uint64_t b = local_view.offsets[k], e = local_view.offsets[k + 1];
        if (e == b) continue;
        const size_t t = held_[k];
        const uint64_t vb = local_view.value_offsets[k], ve = local_view.value_offsets[k + 1];
        const size_t at = part.indices.size();
        part.indices.insert(part.indices.end(), local_view.indices.begin() + b, local_view.indices.begin() + e);
        to_full_positions(std::span(part.indices).subspan(at), tensors_[t].placement, full_[t].name);
        part.values.insert(part.values.end(), local_view.values.begin() + vb, local_view.values.begin() + ve);
        part.base_values.insert(part.base_values.end(), local_view.base_values.begin() + vb, local_view.base_values.begin() + ve);
        part.offsets.push_back(part.indices.size());
        part.value_offsets.push_back(part.values.size());
        changed_meta.push_back(full_[t]);
        changed_at.push_back(t);
        receipt.changed += e - b;
      }
    }
    // Partials in O(changed), in full positions (the engine's own shifts are in shard positions).
    std::vector<uint64_t> shifted(changed_at.size());
    for (size_t i = 0; i < changed_at.size(); ++i) shifted[i] = digests_[changed_at[i]];
    integrity::advance_digests(shifted, changed_meta, part.view());
    integrity::DeltaDigests dd;
    dd.model_version = version;
    dd.base_version = committed_.last_version;
    for (size_t i = 0; i < changed_at.size(); ++i) {
      dd.base.emplace(changed_meta[i].name, digests_[changed_at[i]]);
      dd.result.emplace(changed_meta[i].name, shifted[i]);
      result[changed_at[i]] = shifted[i];
    }
    DeltaInfo info;
    integrity::put_delta_digests(info, dd);
    if (!held_.empty()) {  // a rank holding nothing has no part (the manifest lists the others')
      const compact::Options compact = compact_options(options_);
      std::vector<uint8_t> bytes;
      if (format_ == DeltaFormat::Compact && compact.layout == compact::kLayout2) {
        // The indexed layout numbers tensors in the model's table (its header names none): the
        // part's changes seen over the whole table, the unchanged tensors empty.
        std::vector<uint64_t> offsets(full_.size() + 1, 0), value_offsets(full_.size() + 1, 0);
        for (size_t i = 0, t = 0; t < full_.size(); ++t) {
          const bool changed = i < changed_at.size() && changed_at[i] == t;
          offsets[t + 1] = changed ? part.offsets[i + 1] : offsets[t];
          value_offsets[t + 1] = changed ? part.value_offsets[i + 1] : value_offsets[t];
          i += changed;
        }
        bytes = serialize_delta(format_, full_, DeltaView{offsets, value_offsets, part.indices, part.values, part.base_values}, info, compact);
      } else {
        bytes = serialize_delta(format_, changed_meta, part.view(), info, compact);
      }
      receipt.delta = ranged::put_delta_object(*store_, protocol::delta_key(version, nonce), bytes, format_);
    }
  }
  if (anchor && !held_.empty()) {
    // The shadow now holds exactly this version's bits: the anchor slices are read from it.
    std::vector<std::vector<uint8_t>> bits(held_.size());
    std::vector<std::span<const uint8_t>> spans;
    std::vector<TensorMeta> metas;
    for (size_t i = 0; i < held_.size(); ++i) {
      const size_t t = held_[i];
      bits[i].resize(tensors_[t].placement.numel() * full_[t].width());
      engine_->read(engine_->shadow_tensor(i), 0, bits[i]);
      spans.emplace_back(bits[i]);
      metas.push_back(full_[t]);
    }
    std::vector<ConstTensorRef> refs;
    for (size_t i = 0; i < held_.size(); ++i) refs.push_back(ConstTensorRef{full_[held_[i]].name, bits[i].data(), held_placements[i].numel(), full_[held_[i]].width()});
    const std::vector<uint64_t> partials = digest_placed_tensors(refs, held_placements);
    for (size_t i = 0; i < held_.size(); ++i) {
      const size_t t = held_[i];
      if (with_delta && partials[i] != result[t])
        throw Error("publisher: version " + std::to_string(version) + ": the anchor's weights disagree with the delta chain's digests (tensor " +
                    full_[t].name + ")");
      result[t] = partials[i];
    }
    const std::vector<uint8_t> part =
        serialize_anchor_slices(metas, held_placements, spans, version, "rank " + std::to_string(rank_));
    receipt.anchor_parts.push_back(protocol::put_object(*store_, protocol::anchor_part_key(version, nonce, rank_), part));
  }
  receipt.partials = result;
  pending_digests_ = std::move(result);
  return receipt;
}

PartReceipt ShardPublisher::failed(uint64_t version, const std::string& error) const {
  return failed_receipt(rank_, version, error, !fenced_.empty(), tensors_.size());
}

void ShardPublisher::conclude(const CommitOutcome& outcome) {
  if (outcome.fenced && fenced_.empty()) fenced_ = outcome.error;
  if (!pending_version_ || outcome.version != *pending_version_ || !outcome.committed) {
    broken_ = true;  // the shadows are ahead of the store: the next version restarts from an anchor
    return;
  }
  broken_ = false;
  committed_.record_visible(outcome.version, outcome.anchor, outcome.delta_bytes);
  digests_ = pending_digests_;
  if (rank_ == 0 && outcome.anchor && options_.keep_anchors) {
    try {
      protocol::apply_retention(*store_, options_.keep_anchors);
    } catch (const Error& e) {
      if (options_.log) options_.log(std::string("retention skipped: ") + e.what());
    }
  }
}

}  // namespace deltasync
