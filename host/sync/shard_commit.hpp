// Rank 0's commit of a shard-local publish (sync/shard_publish.hpp): the manifest of one version
// from every rank's receipt (sync/shard_receipts.hpp), checked, and made visible once.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "store/store.hpp"
#include "sync/protocol.hpp"
#include "sync/shard_receipts.hpp"

namespace deltasync {

// What rank 0 tells every rank after a commit attempt.
struct CommitOutcome {
  uint64_t version = 0;
  bool committed = false;
  std::string error;  // why not, when !committed
  bool fenced = false;  // not committed because the group's fence no longer holds the store
  // Not decided yet: a receipt's tensor table or rules differ from rank 0's (tables_needed), so
  // rank 0 needs every rank's table (a second gather) before it can commit or say why not.
  bool needs_tables = false;
  bool anchor = false;
  uint64_t delta_bytes = 0;   // summed over the parts
  uint64_t anchor_bytes = 0;
  uint64_t changed_elements = 0;
};
std::string outcome_to_json(const CommitOutcome& outcome);
CommitOutcome outcome_from_json(std::string_view text, const std::string& label);

// The manifest of one version from the gathered receipts. BadInputError("version V: ...") naming
// the rank and tensor when a rank failed, ranks disagree about the version, its base or anchor, a
// tensor's name, dtype or shape (from the tables), or the placements overlap or leave a gap.
// The digests are the summed partials; a delta of several parts gets format 3's placements
// (over the ranks that hold anything). `latest_anchor` is the newest anchor before this version.
protocol::Manifest manifest_from_receipts(const GatheredReceipts& gathered, std::optional<uint64_t> latest_anchor);
// Rank 0: manifest_from_receipts with the group's `fence`, every object it names present in the
// store (a part missing: NotFoundError naming it and its rank), then protocol::commit_version.
// Never throws: a failure is the outcome's error, with nothing visible; `fenced` when a rank found
// the fence gone or commit_version refused it (FencedError); `needs_tables` (nothing written)
// when the tables must be gathered first.
CommitOutcome commit_parts(Store& store, const GatheredReceipts& gathered, std::optional<uint64_t> latest_anchor,
                           const protocol::Fence& fence);

}  // namespace deltasync
