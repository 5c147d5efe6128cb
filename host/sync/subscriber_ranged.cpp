// The subscriber's reads for a receiver that holds only part of the model: every sealed compact
// delta object by its needed ranges (sync/ranged_fetch.hpp), everything else whole.
#include <map>

#include "store/http_transport.hpp"
#include "sync/ranged_fetch.hpp"
#include "sync/subscriber.hpp"

namespace deltasync {

std::vector<std::vector<uint8_t>> Subscriber::fetch_planned(const std::vector<protocol::ObjectRef>& objects, size_t anchor_parts,
                                                            const std::vector<const protocol::Manifest*>& chain,
                                                            const Receiver& weights, SyncReport& report) {
  for (const auto* m : chain) report.delta_bytes += m->delta_bytes();
  const std::optional<ranged::NeededRanges> needed = weights.needed_ranges();
  if (!needed) return fetch_all(objects, report);
  // Which objects are read by ranges: the deltas that are sealed and compact (older objects and
  // the interoperable layout are read whole, SHA-256 checked as before).
  std::vector<bool> by_ranges(objects.size(), false);
  std::vector<ranged::PartScope> scopes(objects.size());
  size_t k = anchor_parts;
  for (const auto* m : chain) {
    if (m->delta) {
      by_ranges[k++] = ranged::can_read_ranged(*m->delta, m->delta_format);
      continue;
    }
    for (size_t part = 0; part < m->delta_parts.size(); ++part) {
      scopes[k] = ranged::PartScope{&m->part_placements, part};
      by_ranges[k++] = ranged::can_read_ranged(m->delta_parts[part].object, m->delta_format);
    }
  }
  std::vector<protocol::ObjectRef> whole;
  std::vector<size_t> whole_at, ranged_at;
  for (size_t i = 0; i < objects.size(); ++i) {
    if (by_ranges[i]) {
      ranged_at.push_back(i);
    } else {
      whole.push_back(objects[i]);
      whole_at.push_back(i);
    }
  }
  std::vector<std::vector<uint8_t>> out(objects.size());
  std::vector<std::vector<uint8_t>> fetched = fetch_all(whole, report);
  for (size_t j = 0; j < whole.size(); ++j) out[whole_at[j]] = std::move(fetched[j]);
  std::vector<uint64_t> bytes(ranged_at.size(), 0);
  // The model's table once for every object (indexed deltas number their tensors by it).
  const std::shared_ptr<const compact::TensorTable> table = compact::TensorTable::of(weights.tensors());
  const ranged::ReadOptions read_options{table.get(), options_.range_gap_bytes};
  http::run_parallel(ranged_at.size(), options_.parallel_fetches, [&](size_t j) {
    const size_t i = ranged_at[j];
    ranged::RangedDelta read = ranged::fetch_needed(store_, objects[i], *needed, scopes[i], read_options);
    bytes[j] = read.bytes_fetched;
    out[i] = std::move(read.file);
  });
  for (uint64_t b : bytes) report.bytes_fetched += b;
  return out;
}

}  // namespace deltasync
