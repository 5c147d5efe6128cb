#include "sync/part_placements.hpp"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "core/error.hpp"

namespace deltasync::protocol {
namespace {

using json = nlohmann::json;

[[noreturn]] void bad(const std::string& label, const std::string& why) { throw BadInputError(label + ": " + why); }

// Parts and tensors far below this; keeps every position sum of a checked segment in range.
constexpr uint64_t kLimit = uint64_t{1} << 62;

Placement at(const PlacementSegment& s, uint64_t i) { return Placement{s.first + i * s.first_step, s.run_length, s.run_stride, s.run_count}; }

// Appends part `k`'s placement to a tensor's pattern, extending the last segment when the part
// follows it and its first position continues the arithmetic step.
void append(PlacementPattern& pattern, uint64_t k, const Placement& pl) {
  if (!pattern.empty()) {
    PlacementSegment& s = pattern.back();
    const bool same_runs = s.run_length == pl.run_length && s.run_stride == pl.run_stride && s.run_count == pl.run_count;
    if (same_runs && s.part + s.count == k) {
      if (s.count == 1 && pl.first >= s.first) {
        s.first_step = pl.first - s.first;
        s.count = 2;
        return;
      }
      if (s.count > 1 && pl.first == s.first + s.count * s.first_step) {
        ++s.count;
        return;
      }
    }
  }
  pattern.push_back(PlacementSegment{k, 1, pl.first, 0, pl.run_length, pl.run_stride, pl.run_count});
}

PlacementPattern pattern_from_json(const json& j, size_t parts, const std::string& label, size_t index) {
  const std::string where = "manifest part_placements pattern " + std::to_string(index);
  if (!j.is_array() || j.empty()) bad(label, where + " is not a non-empty array of segments");
  PlacementPattern out;
  uint64_t next_part = 0;  // segments ascend and never name a part twice
  for (const json& e : j) {
    if (!e.is_array() || e.size() != 7 || !std::all_of(e.begin(), e.end(), [](const json& x) { return x.is_number_unsigned(); }))
      bad(label, where + ": a segment is not 7 non-negative integers [part, count, first, first_step, run_length, run_stride, run_count]");
    const PlacementSegment s{e[0].get<uint64_t>(), e[1].get<uint64_t>(), e[2].get<uint64_t>(), e[3].get<uint64_t>(),
                             e[4].get<uint64_t>(), e[5].get<uint64_t>(), e[6].get<uint64_t>()};
    if (s.count == 0 || s.part < next_part || s.part >= parts || s.count > parts - s.part)
      bad(label, where + ": segment [" + std::to_string(s.part) + ", " + std::to_string(s.count) + ", ...] names parts out of order or past the " +
                     std::to_string(parts) + " delta parts");
    // Every position the segment can name stays below 2^63: no arithmetic below wraps.
    const unsigned __int128 last_first = static_cast<unsigned __int128>(s.first) + static_cast<unsigned __int128>(s.count - 1) * s.first_step;
    const unsigned __int128 span = s.run_count == 0 ? 0 : static_cast<unsigned __int128>(s.run_count - 1) * s.run_stride + s.run_length;
    if (s.first >= kLimit || s.run_length >= kLimit || s.run_stride >= kLimit || s.run_count >= kLimit ||
        last_first + span >= (static_cast<unsigned __int128>(1) << 63))
      bad(label, where + ": a segment reaches past 2^63 positions");
    next_part = s.part + s.count;
    out.push_back(s);
  }
  return out;
}

}  // namespace

PlacementPattern pattern_of(std::span<const Placement> per_part) {
  PlacementPattern out;
  for (size_t k = 0; k < per_part.size(); ++k)
    if (!per_part[k].empty()) append(out, k, per_part[k]);
  return out;
}

Placement placement_in(const PlacementPattern& pattern, uint64_t part) {
  auto it = std::upper_bound(pattern.begin(), pattern.end(), part, [](uint64_t k, const PlacementSegment& s) { return k < s.part; });
  if (it == pattern.begin()) return {};
  --it;
  if (part >= it->part + it->count) return {};
  return at(*it, part - it->part);
}

std::vector<Placement> expand(const PlacementPattern& pattern, size_t parts) {
  std::vector<Placement> out(parts);
  for (const PlacementSegment& s : pattern)
    for (uint64_t i = 0; i < s.count; ++i) out[s.part + i] = at(s, i);
  return out;
}

PlacementPattern renumber(const PlacementPattern& pattern, std::span<const uint64_t> part_of) {
  PlacementPattern out = pattern;
  for (PlacementSegment& s : out) s.part = part_of[s.part];
  return out;
}

size_t PartPlacements::intern(PlacementPattern pattern) {
  const auto [it, fresh] = index_.emplace(std::move(pattern), patterns_.size());
  if (fresh) patterns_.push_back(it->first);
  return it->second;
}

void PartPlacements::assign(std::string name, size_t index) { tensors_.insert_or_assign(std::move(name), index); }

void PartPlacements::set(std::string name, PlacementPattern pattern) {
  if (pattern.empty()) {
    tensors_.erase(name);
    return;
  }
  assign(std::move(name), intern(std::move(pattern)));
}

const PlacementPattern* PartPlacements::find(std::string_view tensor) const {
  const auto it = tensors_.find(tensor);
  return it == tensors_.end() ? nullptr : &patterns_[it->second];
}

Placement PartPlacements::placement(std::string_view tensor, size_t part) const {
  const PlacementPattern* p = find(tensor);
  return p ? placement_in(*p, part) : Placement{};
}

std::vector<std::map<std::string, Placement>> PartPlacements::per_part() const {
  std::vector<std::map<std::string, Placement>> out(parts_);
  for (const auto& [name, index] : tensors_)
    for (const PlacementSegment& s : patterns_[index])
      for (uint64_t i = 0; i < s.count; ++i) out[s.part + i].emplace_hint(out[s.part + i].end(), name, at(s, i));
  return out;
}

PartPlacements PartPlacements::from_per_part(const std::vector<std::map<std::string, Placement>>& parts) {
  // Parts outer, tensors inner: each part's placements extend its tensors' patterns as they come.
  std::map<std::string, PlacementPattern> building;
  for (size_t k = 0; k < parts.size(); ++k)
    for (const auto& [name, pl] : parts[k])
      if (!pl.empty()) append(building[name], k, pl);
  PartPlacements out(parts.size());
  for (auto& [name, pattern] : building) out.set(name, std::move(pattern));
  return out;
}

void check_parts_tile(const std::vector<Placement>& placements, const std::vector<std::string>& part_names, const std::string& tensor,
                      const std::string& label) {
  uint64_t end = 0;
  for (const Placement& p : placements)
    if (!p.empty()) end = std::max(end, p.end());
  check_tiling(placements, part_names, end, tensor, label);
}

void TilingChecker::check(const std::string& tensor, uint64_t numel) {
  const PlacementPattern* pattern = placements_.find(tensor);
  if (!checked_.emplace(std::make_pair(pattern, numel), true).second) return;
  try {
    const std::vector<Placement> expanded = pattern ? expand(*pattern, placements_.parts()) : std::vector<Placement>{};
    check_tiling(expanded, part_names_, numel, tensor, label_);
  } catch (...) {
    checked_.erase(std::make_pair(pattern, numel));  // the next tensor of this kind is named as well
    throw;
  }
}

json part_placements_json(const PartPlacements& placements) {
  json patterns = json::array();
  for (const PlacementPattern& p : placements.patterns()) {
    json segments = json::array();
    for (const PlacementSegment& s : p)
      segments.push_back(json::array({s.part, s.count, s.first, s.first_step, s.run_length, s.run_stride, s.run_count}));
    patterns.push_back(std::move(segments));
  }
  // Ascending names: nlohmann's object (a std::map) takes each insert at its end.
  json tensors = json::object();
  for (const auto& [name, index] : placements.tensors()) tensors.emplace(name, index);
  return json{{"patterns", std::move(patterns)}, {"tensors", std::move(tensors)}};
}

PartPlacements read_part_placements(const json& j, const std::vector<std::string>& part_names, const std::string& label) {
  if (!j.is_object() || !j.contains("patterns") || !j.contains("tensors") || !j["patterns"].is_array() || !j["tensors"].is_object())
    bad(label, "manifest part_placements is not {\"patterns\": [...], \"tensors\": {...}}");
  PartPlacements out(part_names.size());
  std::vector<PlacementPattern> patterns;
  for (const json& p : j["patterns"]) patterns.push_back(pattern_from_json(p, part_names.size(), label, patterns.size()));
  std::vector<size_t> interned(patterns.size());
  std::vector<bool> checked(patterns.size(), false);  // tiling-checked at first use, named after that tensor
  const json& tensors = j["tensors"];
  for (auto it = tensors.begin(); it != tensors.end(); ++it) {
    if (!it.value().is_number_unsigned() || it.value().get<uint64_t>() >= patterns.size())
      bad(label, "manifest part_placements: tensor " + it.key() + " names no pattern of the " + std::to_string(patterns.size()));
    const size_t at = it.value().get<size_t>();
    if (!checked[at]) {
      check_parts_tile(expand(patterns[at], part_names.size()), part_names, it.key(), label);
      interned[at] = out.intern(patterns[at]);
      checked[at] = true;
    }
    out.assign(it.key(), interned[at]);
  }
  return out;
}

}  // namespace deltasync::protocol
