// A publisher that starts again from the store alone: its process died (killed mid-publish,
// say) and took any local state with it. The store holds everything it needs: the newest
// visible version's weights, pulled and verified as any reader pulls them, and the anchor
// bookkeeping, read from the manifests.
#pragma once
#include <optional>

#include "engine/host_model.hpp"
#include "store/store.hpp"
#include "sync/protocol.hpp"
#include "sync/publisher.hpp"

namespace deltasync {

struct StoreResume {
  HostModel shadow;      // the newest visible version's weights (verified against its manifest)
  PublisherState state;  // last_version = that version; its latest anchor; delta bytes since it
};

// nullopt when the store has no version yet. The newest version is the newest manifest, not
// LATEST: a publisher killed after writing a manifest and before moving LATEST has made that
// version visible (readers trust any manifest they see), and publishing it again would be
// refused as "already exists". Stores that cannot list fall back to LATEST.
std::optional<StoreResume> resume_from_store(Store& store);

// The anchor bookkeeping of a publisher continuing from `version` (visible in `catalog`'s store):
// its latest anchor and the delta bytes published since it, from the manifests. Both resumes
// (this one and a sharded group's, sync/shard_resume.hpp) take it from here.
PublisherState resumed_state(protocol::Catalog& catalog, Store& store, uint64_t version);

}  // namespace deltasync
