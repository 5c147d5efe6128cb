#include "sync/publisher_resume.hpp"

#include "core/error.hpp"
#include "sync/protocol.hpp"
#include "sync/subscriber.hpp"

namespace deltasync {

std::optional<StoreResume> resume_from_store(Store& store) {
  Subscriber sub(store);
  std::optional<uint64_t> newest = sub.poll();
  try {
    const std::vector<uint64_t> listed = sub.catalog().refresh();
    if (!listed.empty() && (!newest || listed.back() > *newest)) newest = listed.back();
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::kUnsupported) throw;
  }
  if (!newest) return std::nullopt;
  StoreResume out;
  sub.sync(out.shadow, newest);
  out.state = resumed_state(sub.catalog(), store, *newest);
  return out;
}

PublisherState resumed_state(protocol::Catalog& catalog, Store& store, uint64_t version) {
  PublisherState state;
  state.last_version = version;
  const protocol::Manifest* m = catalog.find(version);
  if (!m) throw NotFoundError(store.describe(protocol::manifest_key(version)) + ": disappeared while resuming from it");
  state.last_anchor_version = m->latest_anchor;
  // Delta bytes since that anchor, following the chain back (what decides the next anchor by size).
  for (const protocol::Manifest* cur = m; cur && !cur->has_anchor() && cur->base_version; cur = catalog.find(*cur->base_version))
    state.delta_bytes_since_anchor += cur->delta_bytes();
  return state;
}

}  // namespace deltasync
