// The store protocol: how versions are laid out in a store, what a manifest says, how a version
// becomes visible, how a reader plans its catch-up and what retention deletes.
//
// Layout under the store's root (V = version as 20 decimal digits, so names sort by version;
// NONCE = 12 hex digits chosen per upload, so a retried or racing upload never overwrites an
// object a visible manifest names):
//   deltas/V-NONCE.safetensors          a delta (compact or TRL layout) from base_version to V
//   anchors/V-NONCE/part-00000.safetensors ...  the full weights at V, split at tensor
//                                       boundaries into parts of bounded size
//   manifests/V.json                    written once (exclusive create) after its objects
//   LATEST                              "V\n" (a store from before fencing) or
//                                       "V\nrun R\nepoch E\nsince S\n": the newest version (V may
//                                       be "none" for a store claimed before its first version),
//                                       and the fence: which run publishes here, in which epoch,
//                                       and the version that epoch started from. Rewritten after
//                                       each manifest (a hint: a reader also trusts any manifest
//                                       it can see, unless its epoch was superseded).
// A version exists exactly when its manifest does and its epoch is not superseded. Versions need
// not be consecutive (a publisher that fell behind merges pending versions into one delta).
//
// Fencing (two publishers never interleave versions in one store): a publisher claims the store
// at start-up by a compare-and-swap of LATEST that names its run and a new epoch (one more than
// LATEST's) and `since`, the newest version it resumes from. A publisher of another run is refused
// unless it takes the store over explicitly; a publisher of an older epoch (a zombie) is refused by
// commit_version. A manifest written by an epoch E is superseded, invisible to readers, when some
// later epoch started from a version older than it (since < version): what a zombie managed to
// write after the takeover. A store from before fencing (LATEST "V\n", manifests without "fence")
// has no owner: the first fenced publisher claims it as epoch 1 without taking it over, and its
// manifests count as epoch 0.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/placement.hpp"
#include "store/store.hpp"
#include "sync/part_placements.hpp"

namespace deltasync::protocol {

inline constexpr const char* kLatestKey = "LATEST";
inline constexpr const char* kManifestPrefix = "manifests/";
// The newest manifest format. 2 writes a sharded delta's placements compactly
// (sync/part_placements.hpp); 3 is 2 whose delta parts name only the tensors they change (their
// headers hold no table of the model and no partials of unchanged tensors: a reader derives a
// changed tensor's base digest from the manifest's, sync/shard_parts.hpp). A manifest without
// delta parts is still written as format 1. docs/stores.md.
inline constexpr int kManifestFormat = 3;

std::string manifest_key(uint64_t version);
// The version a manifest key names, or nullopt for any other key.
std::optional<uint64_t> version_of_manifest_key(const std::string& key);
std::string delta_key(uint64_t version, const std::string& nonce);
std::string anchor_part_key(uint64_t version, const std::string& nonce, size_t part);
std::string new_nonce();

// Who publishes into a store: a run's identity and its epoch (a restart of the run takes the
// next one), and `since`, the newest version when the epoch started (nullopt: an empty store).
struct Fence {
  std::string run_id;
  uint64_t epoch = 0;
  std::optional<uint64_t> since;
  bool operator==(const Fence&) const = default;
};

// What LATEST says: the newest version (nullopt: claimed, nothing published yet) and the fence
// (nullopt: a store from before fencing).
struct LatestPointer {
  std::optional<uint64_t> version;
  std::optional<Fence> fence;
};

struct ObjectRef {
  std::string key;
  uint64_t size = 0;
  std::string sha256;  // lowercase hex of the object's bytes
  // SHA-256 (lowercase hex) of the object's safetensors prefix -- the 8-byte length and the
  // JSON header -- when the object is sealed for ranged reads (sync/range_hashes.hpp): the
  // header then vouches for every chunk of the data, so a reader may fetch byte ranges and
  // verify them. Empty for objects written before (readers fetch those whole).
  std::string header_sha256 = {};
};

// One trainer rank's part of a version's delta (shard-local publish, sync/shard_publish.hpp):
// an ordinary delta file over the full tensors whose changes lie in the positions its manifest's
// part_placements give it. The parts of a version tile every tensor exactly.
struct DeltaPart {
  ObjectRef object;
};

struct Manifest {
  uint64_t version = 0;
  // The delta bringing base_version to version (absent for a version published only as an
  // anchor, e.g. the first one).
  std::optional<ObjectRef> delta;
  std::optional<uint64_t> base_version;
  std::string delta_format;  // a delta format name (codec/delta_io.hpp: parse_delta_format)
  uint64_t changed_elements = 0;
  // The full weights at `version`, in parts (empty when this version has no anchor).
  std::vector<ObjectRef> anchor_parts;
  // The newest version <= this one that has an anchor: a reader without listing rights can
  // always find a recovery point from any manifest.
  std::optional<uint64_t> latest_anchor;
  uint64_t total_elements = 0;
  uint64_t model_bytes = 0;
  std::string digest_algorithm;                // integrity's algorithm name; empty when none
  std::map<std::string, std::string> digests;  // every tensor's digest at `version` (hex)
  uint64_t created_unix_ms = 0;
  // A delta in several parts (one per trainer rank), instead of `delta`: at least two (one part
  // is written as `delta`, so a one-rank publisher's manifest reads as before).
  std::vector<DeltaPart> delta_parts;
  // Where each tensor lies across delta_parts (parts() == delta_parts.size()), unexpanded.
  PartPlacements part_placements;
  std::optional<Fence> fence;  // the run and epoch that wrote it (nullopt: before fencing, epoch 0)

  bool has_anchor() const { return !anchor_parts.empty(); }
  bool has_delta() const { return delta.has_value() || !delta_parts.empty(); }
  uint64_t delta_bytes() const;
  uint64_t anchor_bytes() const;
  std::string kind() const { return has_anchor() ? (has_delta() ? "anchor+delta" : "anchor") : "delta"; }
};

// The objects of a version's delta, in part order: `delta`, or every delta part's.
std::vector<ObjectRef> delta_objects(const Manifest& manifest);

// Uploads `bytes` under `key` and returns its reference (size, SHA-256).
ObjectRef put_object(Store& store, const std::string& key, std::span<const uint8_t> bytes);

// Checks an object's bytes against the size and SHA-256 its manifest records; throws
// Error("LABEL: ...") naming what differs (a corrupt or replaced object).
void verify_object(const ObjectRef& ref, std::span<const uint8_t> bytes, const std::string& label);

// How a sharded delta's placements are written: compact (format 3, sync/part_placements.hpp), or
// per part as format 1 did (to measure the difference; parts written since format 3 name only
// their changed tensors, which readers of format 1 alone would not expect).
enum class PlacementForm { kCompact, kPerPart };
std::string to_json(const Manifest& manifest, PlacementForm form = PlacementForm::kCompact);
// Strict: every required field present with the right type; formats 1 to 3. A sharded delta's
// parts must not overlap or leave a gap in any tensor (below the end of its last part, once per
// pattern; the full size is checked against the model where they are combined); the placements
// stay unexpanded. Throws Error("LABEL: reason").
Manifest manifest_from_json(std::string_view text, const std::string& label);

// Thrown when a publisher's fence no longer holds the store (another run, or a newer epoch of its
// own run, claimed it): nothing it writes from then on becomes visible.
class FencedError : public Error {
 public:
  explicit FencedError(const std::string& what) : Error(what, ErrorKind::kInvalidArgument) {}
};

// Throws FencedError when LATEST names a fence other than `mine` (a newer epoch, or another run).
void check_fence(Store& store, const Fence& mine);

// Makes a version visible: checks the manifest's fence still holds the store (FencedError
// otherwise, writing nothing), writes its manifest with put_if_absent (returns false, writing
// nothing, when the version already exists), then advances LATEST if it is older.
bool commit_version(Store& store, const Manifest& manifest);
// The two steps of commit_version. write_manifest treats finding its own bytes as success (a
// retried create whose first answer was lost).
bool write_manifest(Store& store, const Manifest& manifest);
// Moves LATEST forward to `version` by compare-and-swap where the store has one; with a fence,
// only while LATEST still names that fence (FencedError otherwise).
void advance_latest(Store& store, uint64_t version, const std::optional<Fence>& fence = std::nullopt);

// Claims the store for `run_id` at a publisher's start-up: a new epoch (LATEST's + 1), since the
// newest visible version, written into LATEST by compare-and-swap. Refused with FencedError
// (nothing written) when another run holds the store and `take_over` is false. An empty run_id
// is refused (Error).
Fence claim_store(Store& store, const std::string& run_id, bool take_over);

// Reads LATEST; nullopt when absent. Throws Error for malformed contents.
std::optional<uint64_t> read_latest(Store& store);
std::optional<uint64_t> parse_latest(std::string_view text, const std::string& label);
std::optional<LatestPointer> read_latest_pointer(Store& store);
LatestPointer parse_latest_pointer(std::string_view text, const std::string& label);
std::string latest_text(const LatestPointer& pointer);

// Manifests are immutable, so a catalog fetches each at most once.
class Catalog {
 public:
  explicit Catalog(Store& store) : store_(store) {}
  // The manifest of a version, or nullopt when it does not exist (never published, or deleted
  // by retention). Cached once found.
  const Manifest* find(uint64_t version);
  // Lists manifests/ (stores that can list) and loads the ones not yet cached; versions whose
  // manifests disappeared are forgotten. Returns the versions in ascending order.
  std::vector<uint64_t> refresh();
  // The newest visible version: max(LATEST, newest listed manifest when listing is possible).
  std::optional<uint64_t> newest(bool can_list);
  void forget(uint64_t version) { cache_.erase(version); }
  // Learns the fence a LATEST names (readers that read LATEST themselves pass it on), so that
  // manifests of the epochs it supersedes are ignored.
  void note_fence(const std::optional<Fence>& fence);
  // A manifest written by an epoch some later epoch superseded (started from an older version):
  // find() and refresh() never return one.
  bool superseded(const Manifest& manifest) const;
  // The newest epoch seen (0: none, or only a store from before fencing).
  uint64_t newest_epoch() const { return epoch_since_.empty() ? 0 : epoch_since_.rbegin()->first; }

 private:
  Store& store_;
  std::map<uint64_t, Manifest> cache_;
  std::map<uint64_t, std::optional<uint64_t>> epoch_since_;  // every epoch seen -> its `since`
};

// A way to reach `target`: optionally load the anchor of `anchor_version` first, then apply the
// deltas of `deltas` (ascending versions) in order.
struct CatchUpPlan {
  std::optional<uint64_t> anchor_version;
  std::vector<uint64_t> deltas;
  uint64_t bytes = 0;  // total bytes to fetch
  std::string describe() const;
};

// The cheapest plan by bytes from `current` (nullopt: the reader has nothing) to `target`:
// the chain of deltas from current (when target's base links lead back to it), or any anchor
// on target's chain plus the deltas after it. `allow_current` false plans from an anchor only
// (recovery). Returns nullopt when no plan exists (e.g. no anchor left on the chain).
std::optional<CatchUpPlan> plan_catch_up(Catalog& catalog, std::optional<uint64_t> current, uint64_t target,
                                         bool allow_current = true);

struct RetentionReport {
  std::vector<uint64_t> deleted_versions;
  uint64_t deleted_objects = 0;
  uint64_t deleted_bytes = 0;
  uint64_t aborted_uploads = 0;  // unfinished multipart uploads of deleted versions
};

// Keeps the newest `keep_anchors` anchors and every version from the oldest kept anchor on;
// deletes the other versions (manifest first, so no visible version ever names a missing
// object) and orphaned objects older than the oldest kept anchor (left by killed uploads), and
// aborts the unfinished multipart uploads of those versions.
// Needs a store that can list. keep_anchors == 0 keeps everything.
RetentionReport apply_retention(Store& store, size_t keep_anchors);

}  // namespace deltasync::protocol
