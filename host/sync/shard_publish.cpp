#include "sync/shard_publish.hpp"

#include <chrono>
#include <cstring>
#include <nlohmann/json.hpp>

#include "codec/delta_io.hpp"
#include "codec/digest.hpp"
#include "core/error.hpp"
#include "engine/cpu_sync_engine.hpp"
#include "engine/integrity.hpp"
#include "sync/protocol_json.hpp"
#include "sync/range_hashes.hpp"
#include "sync/shard_parts.hpp"
#include "sync/shard_resume.hpp"

namespace deltasync {
namespace {

using json = nlohmann::json;

using protocol::object_json;

std::string meta_text(DType dtype, const std::vector<uint64_t>& shape) { return std::string(dtype_name(dtype)) + shape_text(shape); }

uint64_t unix_ms() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch()).count());
}

}  // namespace

std::string receipt_to_json(const PartReceipt& r) {
  json j{{"rank", r.rank},   {"version", r.version},           {"anchor", r.anchor},
         {"error", r.error}, {"fenced", r.fenced}, {"delta_format", r.delta_format}};
  j["base_version"] = r.base_version ? json(*r.base_version) : json(nullptr);
  j["delta"] = r.delta ? object_json(*r.delta) : json(nullptr);
  json parts = json::array();
  for (const auto& p : r.anchor_parts) parts.push_back(object_json(p));
  j["anchor_parts"] = std::move(parts);
  json tensors = json::array();
  for (const auto& t : r.tensors)
    tensors.push_back(json{{"name", t.name}, {"dtype", std::string(dtype_name(t.dtype))}, {"shape", t.shape},
                           {"placement", placement_to_json(t.placement)}, {"digest", digest_to_hex(t.digest)}, {"changed", t.changed}});
  j["tensors"] = std::move(tensors);
  return j.dump();
}

PartReceipt receipt_from_json(std::string_view text, const std::string& label) {
  try {
    const json j = json::parse(text);
    PartReceipt r;
    r.rank = j.at("rank").get<uint64_t>();
    r.version = j.at("version").get<uint64_t>();
    r.anchor = j.at("anchor").get<bool>();
    r.error = j.at("error").get<std::string>();
    r.fenced = j.at("fenced").get<bool>();
    r.delta_format = j.at("delta_format").get<std::string>();
    if (!j.at("base_version").is_null()) r.base_version = j.at("base_version").get<uint64_t>();
    if (!j.at("delta").is_null()) r.delta = protocol::object_from_json(j.at("delta"), label);
    for (const auto& p : j.at("anchor_parts")) r.anchor_parts.push_back(protocol::object_from_json(p, label));
    for (const auto& t : j.at("tensors")) {
      PartReceipt::Tensor x;
      x.name = t.at("name").get<std::string>();
      const auto dtype = dtype_from_name(t.at("dtype").get<std::string>());
      if (!dtype) throw BadInputError(label + ": tensor " + x.name + " has an unknown dtype");
      x.dtype = *dtype;
      x.shape = t.at("shape").get<std::vector<uint64_t>>();
      const std::optional<Placement> placement = placement_from_json(t.at("placement"));
      if (!placement) throw BadInputError(label + ": tensor " + x.name + " has a malformed placement");
      x.placement = *placement;
      x.digest = digest_from_hex(t.at("digest").get<std::string>(), label);
      x.changed = t.at("changed").get<uint64_t>();
      r.tensors.push_back(std::move(x));
    }
    return r;
  } catch (const json::exception& e) {
    throw BadInputError(label + ": malformed receipt (" + e.what() + ")");
  }
}

PartReceipt failed_receipt(uint64_t rank, uint64_t version, const std::string& error, bool fenced) {
  PartReceipt r;
  r.rank = rank;
  r.version = version;
  r.error = error.empty() ? std::string("unknown failure") : error;
  r.fenced = fenced;
  return r;
}

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

std::string outcome_to_json(const CommitOutcome& o) {
  return json{{"version", o.version},           {"committed", o.committed},         {"error", o.error}, {"fenced", o.fenced},
              {"anchor", o.anchor},             {"delta_bytes", o.delta_bytes},     {"anchor_bytes", o.anchor_bytes},
              {"changed_elements", o.changed_elements}}
      .dump();
}

CommitOutcome outcome_from_json(std::string_view text, const std::string& label) {
  try {
    const json j = json::parse(text);
    CommitOutcome o;
    o.version = j.at("version").get<uint64_t>();
    o.committed = j.at("committed").get<bool>();
    o.error = j.at("error").get<std::string>();
    o.fenced = j.at("fenced").get<bool>();
    o.anchor = j.at("anchor").get<bool>();
    o.delta_bytes = j.at("delta_bytes").get<uint64_t>();
    o.anchor_bytes = j.at("anchor_bytes").get<uint64_t>();
    o.changed_elements = j.at("changed_elements").get<uint64_t>();
    return o;
  } catch (const json::exception& e) {
    throw BadInputError(label + ": malformed commit outcome (" + e.what() + ")");
  }
}

protocol::Manifest manifest_from_receipts(std::span<const PartReceipt> receipts, std::optional<uint64_t> latest_anchor) {
  if (receipts.empty()) throw Error("commit: no receipts");
  const PartReceipt& first = receipts[0];
  const std::string label = "version " + std::to_string(first.version);
  for (const auto& r : receipts)
    if (!r.error.empty()) throw Error(label + ": rank " + std::to_string(r.rank) + " failed: " + r.error);
  for (const auto& r : receipts) {
    const std::string who = label + ": rank " + std::to_string(r.rank);
    if (r.version != first.version) throw BadInputError(who + " published version " + std::to_string(r.version));
    if (r.base_version != first.base_version || r.anchor != first.anchor || r.delta_format != first.delta_format)
      throw BadInputError(who + " disagrees with rank " + std::to_string(first.rank) + " about the base version, the anchor or the format");
    if (r.tensors.size() != first.tensors.size())
      throw BadInputError(who + " reports " + std::to_string(r.tensors.size()) + " tensors, rank " + std::to_string(first.rank) + " " +
                          std::to_string(first.tensors.size()));
    for (size_t t = 0; t < r.tensors.size(); ++t) {
      const auto& a = r.tensors[t];
      const auto& b = first.tensors[t];
      if (a.name != b.name) throw BadInputError(who + " reports tensor " + a.name + " where rank " + std::to_string(first.rank) + " has " + b.name);
      if (a.dtype != b.dtype || a.shape != b.shape)
        throw BadInputError(who + " reports tensor " + a.name + " as " + meta_text(a.dtype, a.shape) + ", rank " + std::to_string(first.rank) +
                            " as " + meta_text(b.dtype, b.shape));
    }
  }
  protocol::Manifest m;
  m.version = first.version;
  m.digest_algorithm = std::string(integrity::kDigestAlgorithm);
  std::vector<std::string> names;
  for (const auto& r : receipts) names.push_back("rank " + std::to_string(r.rank));
  for (size_t t = 0; t < first.tensors.size(); ++t) {
    const auto& x = first.tensors[t];
    std::vector<Placement> placements;
    uint64_t digest = 0;
    for (const auto& r : receipts) {
      placements.push_back(r.tensors[t].placement);
      digest += r.tensors[t].digest;
    }
    const TensorMeta meta{x.name, x.dtype, x.shape};
    check_tiling(placements, names, meta.numel(), x.name, label);
    m.digests[x.name] = digest_to_hex(digest);
    m.total_elements += meta.numel();
    m.model_bytes += meta.numel() * meta.width();
  }
  if (first.base_version) {
    m.base_version = first.base_version;
    m.delta_format = first.delta_format;
    std::vector<protocol::DeltaPart> parts;
    for (const auto& r : receipts) {
      bool holds = false;
      protocol::DeltaPart part;
      for (const auto& x : r.tensors) {
        m.changed_elements += x.changed;
        if (x.placement.empty()) continue;
        holds = true;
        part.placements[x.name] = x.placement;
      }
      if (!holds) continue;
      if (!r.delta) throw BadInputError(label + ": rank " + std::to_string(r.rank) + " holds tensors but sent no delta part");
      part.object = *r.delta;
      parts.push_back(std::move(part));
    }
    if (parts.empty()) throw BadInputError(label + ": no rank sent a delta part");
    if (parts.size() == 1) {
      m.delta = parts[0].object;  // the single form: one publisher's manifest reads as before
    } else {
      m.delta_parts = std::move(parts);
    }
  }
  for (const auto& r : receipts) m.anchor_parts.insert(m.anchor_parts.end(), r.anchor_parts.begin(), r.anchor_parts.end());
  if (first.anchor && m.anchor_parts.empty()) throw BadInputError(label + ": an anchor version without anchor parts");
  m.latest_anchor = first.anchor ? std::optional<uint64_t>(first.version) : latest_anchor;
  m.created_unix_ms = unix_ms();
  return m;
}

CommitOutcome commit_parts(Store& store, std::span<const PartReceipt> receipts, std::optional<uint64_t> latest_anchor,
                           const protocol::Fence& fence) {
  CommitOutcome out;
  if (!receipts.empty()) out.version = receipts[0].version;
  try {
    for (const auto& r : receipts)
      if (r.fenced) throw protocol::FencedError("version " + std::to_string(r.version) + ": rank " + std::to_string(r.rank) + ": " + r.error);
    protocol::Manifest m = manifest_from_receipts(receipts, latest_anchor);
    m.fence = fence;  // commit_version refuses a fenced-off group; LATEST keeps naming its owner
    for (const auto& r : receipts) {
      std::vector<protocol::ObjectRef> objects = r.anchor_parts;
      if (r.delta) objects.push_back(*r.delta);
      for (const auto& o : objects) {
        const auto info = store.head(o.key);
        if (!info) throw NotFoundError("version " + std::to_string(m.version) + ": part " + store.describe(o.key) + " of rank " +
                                       std::to_string(r.rank) + " is missing from the store");
      }
    }
    if (!protocol::commit_version(store, m))
      throw Error(store.describe(protocol::manifest_key(m.version)) + ": version " + std::to_string(m.version) + " already exists");
    out.committed = true;
    out.anchor = m.has_anchor();
    out.delta_bytes = m.delta_bytes();
    out.anchor_bytes = m.anchor_bytes();
    out.changed_elements = m.changed_elements;
  } catch (const protocol::FencedError& e) {
    out.committed = false;
    out.fenced = true;
    out.error = e.what();
  } catch (const std::exception& e) {
    out.committed = false;
    out.error = e.what();
  }
  return out;
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
    full_.push_back(x.full);
    model_bytes_ += numel * x.full.width();
    if (!x.placement.empty()) held_.push_back(t);
  }
  digests_.assign(tensors_.size(), 0);
}

ShardPublisher::~ShardPublisher() = default;

PartReceipt ShardPublisher::recover() {
  const uint64_t since = fence_.since.value_or(0);
  try {
    if (shadow_started_ || pending_version_) throw Error("resume must come before the first publish");
    PartReceipt receipt;
    receipt.rank = rank_;
    receipt.version = since;
    std::vector<uint64_t> partials(tensors_.size(), 0);
    if (fence_.since) {  // else an empty store at the claim: nothing to recover
      recovered_ = std::make_unique<ShardRecovery>(recover_shard(*store_, tensors_, fence_));
      partials = recovered_->partials;
      resume_counters_ = recovered_->counters;
    }
    for (size_t t = 0; t < tensors_.size(); ++t) {
      const ShardTensor& x = tensors_[t];
      receipt.tensors.push_back(PartReceipt::Tensor{x.full.name, x.full.dtype, x.full.shape, x.placement, partials[t], 0});
    }
    return receipt;
  } catch (const std::exception& e) {
    recovered_.reset();
    return failed_receipt(rank_, since, e.what());
  }
}

std::optional<uint64_t> ShardPublisher::adopt(std::span<const PartReceipt> receipts) {
  if (!fence_.since) return std::nullopt;
  const uint64_t since = *fence_.since;
  // Every rank holds the same receipts: a failure anywhere throws the same line everywhere, and
  // when none failed every rank has its recovery (and the same manifest's digests).
  check_recovery(receipts, since, recovered_ ? std::span<const uint64_t>(recovered_->expected) : std::span<const uint64_t>());
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

  PartReceipt receipt;
  receipt.rank = rank_;
  receipt.version = version;
  receipt.anchor = anchor;
  receipt.delta_format = std::string(delta_format_name(format_));
  std::vector<uint64_t> result = digests_;
  std::vector<uint64_t> changed(T, 0);
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
    // The engine's change set in shard coordinates -> the model's tensors in full coordinates.
    SparseDelta part;
    part.offsets.assign(1, 0);
    part.value_offsets.assign(1, 0);
    if (held.empty()) {  // nothing encoded: an empty change set over no tensors
      staged.changes.offsets.assign(1, 0);
      staged.changes.value_offsets.assign(1, 0);
    }
    const DeltaView local_view = staged.changes.view();
    size_t k = 0;
    for (size_t t = 0; t < T; ++t) {
      if (k < held_.size() && held_[k] == t) {
        const uint64_t b = local_view.offsets[k], e = local_view.offsets[k + 1];
        const uint64_t vb = local_view.value_offsets[k], ve = local_view.value_offsets[k + 1];
        const size_t at = part.indices.size();
        part.indices.insert(part.indices.end(), local_view.indices.begin() + b, local_view.indices.begin() + e);
        to_full_positions(std::span(part.indices).subspan(at), tensors_[t].placement, full_[t].name);
        part.values.insert(part.values.end(), local_view.values.begin() + vb, local_view.values.begin() + ve);
        part.base_values.insert(part.base_values.end(), local_view.base_values.begin() + vb, local_view.base_values.begin() + ve);
        changed[t] = e - b;
        ++k;
      }
      part.offsets.push_back(part.indices.size());
      part.value_offsets.push_back(part.values.size());
    }
    // Partials in O(changed), in full positions (the engine's own shifts are in shard positions).
    integrity::advance_digests(result, full_, part.view());
    integrity::DeltaDigests dd;
    dd.model_version = version;
    dd.base_version = committed_.last_version;
    integrity::DigestMap unchanged;
    for (size_t t : held_) {
      if (changed[t]) {
        dd.base.emplace(full_[t].name, digests_[t]);
        dd.result.emplace(full_[t].name, result[t]);
      } else {
        unchanged.emplace(full_[t].name, digests_[t]);
      }
    }
    DeltaInfo info;
    integrity::put_delta_digests(info, dd);
    if (!unchanged.empty()) integrity::put_digest_map(info.extra, shard_keys::kUnchangedDigests, unchanged);
    if (!held_.empty()) {  // a rank holding nothing has no part (the manifest lists the others')
      const std::vector<uint8_t> bytes = serialize_delta(format_, full_, part.view(), info, compact_options(options_));
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
  for (size_t t = 0; t < T; ++t) {
    const ShardTensor& x = tensors_[t];
    receipt.tensors.push_back(PartReceipt::Tensor{x.full.name, x.full.dtype, x.full.shape, x.placement, result[t], changed[t]});
  }
  pending_digests_ = std::move(result);
  return receipt;
}

PartReceipt ShardPublisher::failed(uint64_t version, const std::string& error) const {
  return failed_receipt(rank_, version, error, !fenced_.empty());
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
