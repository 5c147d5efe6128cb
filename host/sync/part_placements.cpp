#include "sync/part_placements.hpp"

#include <algorithm>
#include <array>
#include <map>
#include <string_view>
#include <unordered_map>

#include "core/error.hpp"

namespace deltasync::protocol {
namespace {

using json = nlohmann::json;

// [part, count, first, first_step, run_length, run_stride, run_count]
using Segment = std::array<uint64_t, 7>;
using Pattern = std::vector<Segment>;

[[noreturn]] void bad(const std::string& label, const std::string& why) { throw BadInputError(label + ": " + why); }

// Parts and tensors far below this; keeps every position sum of a checked segment in range.
constexpr uint64_t kLimit = uint64_t{1} << 62;

// Appends part `k`'s placement to a tensor's pattern, extending the last segment when the part
// follows it and its first position continues the arithmetic step.
void append(Pattern& pattern, uint64_t k, const Placement& pl) {
  if (!pattern.empty()) {
    Segment& s = pattern.back();
    const bool same_runs = s[4] == pl.run_length && s[5] == pl.run_stride && s[6] == pl.run_count;
    if (same_runs && s[0] + s[1] == k) {
      if (s[1] == 1 && pl.first >= s[2]) {
        s[3] = pl.first - s[2];
        s[1] = 2;
        return;
      }
      if (s[1] > 1 && pl.first == s[2] + s[1] * s[3]) {
        ++s[1];
        return;
      }
    }
  }
  pattern.push_back(Segment{k, 1, pl.first, 0, pl.run_length, pl.run_stride, pl.run_count});
}

Pattern pattern_from_json(const json& j, size_t parts, const std::string& label, size_t index) {
  const std::string where = "manifest part_placements pattern " + std::to_string(index);
  if (!j.is_array() || j.empty()) bad(label, where + " is not a non-empty array of segments");
  Pattern out;
  uint64_t next_part = 0;  // segments ascend and never name a part twice
  for (const json& e : j) {
    if (!e.is_array() || e.size() != 7 || !std::all_of(e.begin(), e.end(), [](const json& x) { return x.is_number_unsigned(); }))
      bad(label, where + ": a segment is not 7 non-negative integers [part, count, first, first_step, run_length, run_stride, run_count]");
    Segment s;
    for (size_t i = 0; i < 7; ++i) s[i] = e[i].get<uint64_t>();
    if (s[1] == 0 || s[0] < next_part || s[0] >= parts || s[1] > parts - s[0])
      bad(label, where + ": segment [" + std::to_string(s[0]) + ", " + std::to_string(s[1]) + ", ...] names parts out of order or past the " +
                     std::to_string(parts) + " delta parts");
    // Every position the segment can name stays below 2^63: no arithmetic below wraps.
    const unsigned __int128 last_first = static_cast<unsigned __int128>(s[2]) + static_cast<unsigned __int128>(s[1] - 1) * s[3];
    const unsigned __int128 span = s[6] == 0 ? 0 : static_cast<unsigned __int128>(s[6] - 1) * s[5] + s[4];
    if (s[2] >= kLimit || s[4] >= kLimit || s[5] >= kLimit || s[6] >= kLimit || last_first + span >= (static_cast<unsigned __int128>(1) << 63))
      bad(label, where + ": a segment reaches past 2^63 positions");
    next_part = s[0] + s[1];
    out.push_back(s);
  }
  return out;
}

// The placement each part holds under `pattern` (empty where it names none).
std::vector<Placement> expand(const Pattern& pattern, size_t parts) {
  std::vector<Placement> out(parts);
  for (const Segment& s : pattern)
    for (uint64_t i = 0; i < s[1]; ++i) out[s[0] + i] = Placement{s[2] + i * s[3], s[4], s[5], s[6]};
  return out;
}

}  // namespace

void check_parts_tile(const std::vector<Placement>& placements, const std::vector<std::string>& part_names, const std::string& tensor,
                      const std::string& label) {
  uint64_t end = 0;
  for (const Placement& p : placements)
    if (!p.empty()) end = std::max(end, p.end());
  check_tiling(placements, part_names, end, tensor, label);
}

json part_placements_json(const std::vector<DeltaPart>& parts) {
  // Parts outer, tensors inner: each part's placements extend its tensors' patterns as they come,
  // so the work is one hash lookup per entry and the memory a few segments per tensor.
  std::unordered_map<std::string_view, size_t> index;
  std::vector<std::string_view> names;
  std::vector<Pattern> patterns_of;
  for (size_t k = 0; k < parts.size(); ++k) {
    for (const auto& [name, pl] : parts[k].placements) {
      auto [it, fresh] = index.emplace(name, names.size());
      if (fresh) {
        names.push_back(name);
        patterns_of.emplace_back();
      }
      append(patterns_of[it->second], k, pl);
    }
  }
  std::map<Pattern, size_t> distinct;
  json patterns = json::array();
  json tensors = json::object();
  for (size_t t = 0; t < names.size(); ++t) {
    auto [it, fresh] = distinct.emplace(std::move(patterns_of[t]), distinct.size());
    if (fresh) {
      json p = json::array();
      for (const Segment& s : it->first) p.push_back(json(s));
      patterns.push_back(std::move(p));
    }
    tensors[std::string(names[t])] = it->second;
  }
  return json{{"patterns", std::move(patterns)}, {"tensors", std::move(tensors)}};
}

void read_part_placements(const json& j, std::vector<DeltaPart>& parts, const std::string& label) {
  if (!j.is_object() || !j.contains("patterns") || !j.contains("tensors") || !j["patterns"].is_array() || !j["tensors"].is_object())
    bad(label, "manifest part_placements is not {\"patterns\": [...], \"tensors\": {...}}");
  std::vector<Pattern> patterns;
  for (const json& p : j["patterns"]) patterns.push_back(pattern_from_json(p, parts.size(), label, patterns.size()));
  std::vector<std::string> part_names;
  for (const auto& p : parts) part_names.push_back("part " + p.object.key);
  std::vector<std::vector<Placement>> expanded(patterns.size());  // filled and tiling-checked at first use
  const json& tensors = j["tensors"];
  for (auto it = tensors.begin(); it != tensors.end(); ++it) {  // ascending names: each insert goes at the end
    if (!it.value().is_number_unsigned() || it.value().get<uint64_t>() >= patterns.size())
      bad(label, "manifest part_placements: tensor " + it.key() + " names no pattern of the " + std::to_string(patterns.size()));
    const size_t at = it.value().get<size_t>();
    if (expanded[at].empty()) {
      expanded[at] = expand(patterns[at], parts.size());
      check_parts_tile(expanded[at], part_names, it.key(), label);
    }
    for (const Segment& s : patterns[at])
      for (uint64_t i = 0; i < s[1]; ++i) {
        auto& m = parts[s[0] + i].placements;
        m.emplace_hint(m.end(), it.key(), expanded[at][s[0] + i]);
      }
  }
}

}  // namespace deltasync::protocol
