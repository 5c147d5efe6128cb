// The compact placements of a sharded manifest (formats 2 and 3, sync/part_placements.hpp): round
// trip, formats 1 and 2 still read, overlap and gaps refused with one line, size against the
// per-part form, patterns kept unexpanded in memory.
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "sync/protocol.hpp"
#include "test_support.hpp"

namespace {

using namespace deltasync;
using namespace deltasync::protocol;
using json = nlohmann::json;

// A sharded version of `parts` parts: every tensor's placements come from `place(tensor, part)`
// (an empty placement: the part holds none of it).
Manifest sharded(size_t parts, const std::vector<std::pair<std::string, std::function<Placement(size_t)>>>& tensors) {
  Manifest m;
  m.version = 5;
  m.base_version = 4;
  m.delta_format = "compact";
  m.latest_anchor = 1;
  std::vector<std::map<std::string, Placement>> per_part(parts);
  for (size_t k = 0; k < parts; ++k) {
    DeltaPart p;
    p.object = ObjectRef{"deltas/00000000000000000005-00000000000" + std::to_string(k % 10) + "-" + std::to_string(k), 10 + k,
                         std::string(64, 'a')};
    for (const auto& [name, place] : tensors) {
      const Placement pl = place(k);
      if (!pl.empty()) per_part[k][name] = pl;
    }
    m.delta_parts.push_back(std::move(p));
  }
  m.part_placements = PartPlacements::from_per_part(per_part);
  return m;
}

// FSDP2's Shard(0) of a [rows, cols] tensor over `parts`, as torch.chunk cuts it.
std::function<Placement(size_t)> chunk_rows(uint64_t rows, uint64_t cols, size_t parts) {
  return [=](size_t k) {
    const std::vector<uint64_t> shape{rows, cols};
    return shard_placement(shape, 0, k, parts);
  };
}

// The model of the tests below: uneven Shard(0) (trailing parts empty), Shard(1) (runs), a
// replicated tensor published by part 0, irregular per-rank offsets, two tensors of one shape.
Manifest example() {
  const size_t P = 5;
  return sharded(P, {{"rows.a", chunk_rows(7, 3, P)},
                     {"rows.b", chunk_rows(7, 3, P)},
                     {"cols", [](size_t k) { return shard_placement(std::vector<uint64_t>{6, 8}, 1, k, 5); }},
                     {"norm", [](size_t k) { return k == 0 ? whole_placement(7) : Placement{}; }},
                     {"offsets", [](size_t k) {
                        const uint64_t cuts[] = {0, 4, 5, 11, 12, 20};
                        return offset_placement(cuts[k], cuts[k + 1] - cuts[k]);
                      }}});
}

TEST(PartPlacements, RoundTripIsExactAndCompact) {
  const Manifest m = example();
  const std::string text = to_json(m);
  const json j = json::parse(text);
  EXPECT_EQ(j["format_version"], 3);
  for (const auto& part : j["delta_parts"]) EXPECT_FALSE(part.contains("placements"));
  // rows.a and rows.b share one pattern; Shard(0) of 7 rows over 5 is 2+2+2+1+0: two segments.
  EXPECT_EQ(j["part_placements"]["tensors"]["rows.a"], j["part_placements"]["tensors"]["rows.b"]);
  EXPECT_EQ(j["part_placements"]["patterns"].size(), 4u);
  EXPECT_EQ(j["part_placements"]["patterns"][j["part_placements"]["tensors"]["rows.a"].get<size_t>()].size(), 2u);

  const Manifest back = manifest_from_json(text, "m");
  ASSERT_EQ(back.delta_parts.size(), m.delta_parts.size());
  for (size_t k = 0; k < m.delta_parts.size(); ++k) EXPECT_EQ(back.delta_parts[k].object.key, m.delta_parts[k].object.key);
  EXPECT_EQ(back.part_placements, m.part_placements);
  EXPECT_EQ(back.part_placements.per_part()[4].count("rows.a"), 0u);  // the empty trailing chunk stays absent
  EXPECT_TRUE(back.part_placements.placement("rows.a", 4).empty());
  EXPECT_EQ(back.part_placements.placement("cols", 1), (Placement{2, 2, 8, 6}));
  EXPECT_EQ(to_json(back), text);
  // A format 2 manifest (parts that named every tensor) reads the same way.
  json two = j;
  two["format_version"] = 2;
  EXPECT_EQ(manifest_from_json(two.dump(), "m").part_placements, m.part_placements);
}

TEST(PartPlacements, FormatOneIsStillReadAndWritten) {
  const Manifest m = example();
  const std::string old_text = to_json(m, PlacementForm::kPerPart);
  const json j = json::parse(old_text);
  EXPECT_EQ(j["format_version"], 1);
  EXPECT_FALSE(j.contains("part_placements"));
  EXPECT_EQ(j["delta_parts"][1]["placements"]["cols"], json::array({2, 2, 8, 6}));
  const Manifest back = manifest_from_json(old_text, "m");
  EXPECT_EQ(back.part_placements, m.part_placements);
  EXPECT_EQ(to_json(back), to_json(m));  // re-written compactly
  // A manifest without delta parts stays format 1 (readable by readers that know only that).
  Manifest single = m;
  single.delta_parts.clear();
  single.part_placements = {};
  single.delta = ObjectRef{"deltas/x", 1, std::string(64, 'b')};
  EXPECT_EQ(json::parse(to_json(single))["format_version"], 1);
}

// The compact text of example() with `edit` applied to its JSON.
std::string edited(const std::function<void(json&)>& edit) {
  json j = json::parse(to_json(example()));
  edit(j);
  return j.dump();
}

std::string refusal(const std::string& text) { return error_message([&] { manifest_from_json(text, "LABEL"); }); }

TEST(PartPlacements, OverlapsAndGapsAreRefusedInBothForms) {
  // Compact: the offsets pattern's second part starts one position early (overlap), or late (gap).
  auto shift_second = [](int64_t by) {
    return edited([by](json& j) {
      auto& seg = j["part_placements"]["patterns"][j["part_placements"]["tensors"]["offsets"].get<size_t>()];
      seg[1][2] = seg[1][2].get<int64_t>() + by;  // [part 1, 1 part, first 4 ...]
    });
  };
  const std::string overlap = refusal(shift_second(-1));
  EXPECT_NE(overlap.find("LABEL: tensor offsets: part "), std::string::npos) << overlap;
  EXPECT_NE(overlap.find("overlap at position 3"), std::string::npos) << overlap;
  EXPECT_EQ(overlap.find('\n'), std::string::npos);
  const std::string gap = refusal(shift_second(+1));
  EXPECT_NE(gap.find("no part covers positions 4..4"), std::string::npos) << gap;

  // Format 1: two parts claiming the same rows.
  json old = json::parse(to_json(example(), PlacementForm::kPerPart));
  old["delta_parts"][1]["placements"]["rows.a"] = old["delta_parts"][0]["placements"]["rows.a"];
  const std::string old_overlap = refusal(old.dump());
  EXPECT_NE(old_overlap.find("LABEL: tensor rows.a: part "), std::string::npos) << old_overlap;
  EXPECT_NE(old_overlap.find("overlap at position 0"), std::string::npos) << old_overlap;
}

TEST(PartPlacements, MalformedTablesAreRefused) {
  auto pattern_of = [](json& j, const char* tensor) -> json& {
    return j["part_placements"]["patterns"][j["part_placements"]["tensors"][tensor].get<size_t>()];
  };
  EXPECT_NE(refusal(edited([&](json& j) { pattern_of(j, "norm")[0][0] = 5; })).find("past the 5 delta parts"), std::string::npos);
  EXPECT_NE(refusal(edited([&](json& j) { pattern_of(j, "offsets")[1][0] = 0; })).find("out of order"), std::string::npos);
  EXPECT_NE(refusal(edited([&](json& j) { pattern_of(j, "norm")[0].erase(6); })).find("not 7 non-negative integers"), std::string::npos);
  EXPECT_NE(refusal(edited([&](json& j) { pattern_of(j, "norm")[0][3] = uint64_t{1} << 63; pattern_of(j, "norm")[0][1] = 2; }))
                .find("past 2^63"),
            std::string::npos);
  EXPECT_NE(refusal(edited([](json& j) { j["part_placements"]["tensors"]["norm"] = 99; })).find("tensor norm names no pattern"),
            std::string::npos);
  EXPECT_NE(refusal(edited([](json& j) { j.erase("part_placements"); })).find("no part_placements"), std::string::npos);
  EXPECT_NE(refusal(edited([](json& j) { j["delta_parts"][0]["placements"] = json::object(); })).find("its own placements"),
            std::string::npos);
  EXPECT_NE(refusal(edited([](json& j) { j["format_version"] = 1; })).find("a field of formats 2 and 3"), std::string::npos);
  EXPECT_NE(refusal(edited([](json& j) { j["part_placements"] = json::array(); })).find("part_placements is not"), std::string::npos);
}

TEST(PartPlacements, ManyShardedTensorsCostAFractionOfThePerPartForm) {
  // 64 ranks, 300 tensors of 3 shapes under FSDP2's Shard(0): the per-part form grows with
  // parts x tensors, the compact one with tensors (names and one pattern index each).
  const size_t P = 64;
  std::vector<std::pair<std::string, std::function<Placement(size_t)>>> tensors;
  for (int t = 0; t < 300; ++t) tensors.emplace_back("model.layers." + std::to_string(t) + ".w", chunk_rows(100 + 900 * (t % 3), 7, P));
  const Manifest m = sharded(P, tensors);
  const std::string compact = to_json(m), per_part = to_json(m, PlacementForm::kPerPart);
  EXPECT_LT(compact.size() * 20, per_part.size()) << compact.size() << " vs " << per_part.size();
  EXPECT_EQ(json::parse(compact)["part_placements"]["patterns"].size(), 3u);
  const Manifest back = manifest_from_json(compact, "m");
  EXPECT_EQ(back.part_placements, m.part_placements);
  // In memory as on the wire: three patterns, one index per tensor, nothing per part.
  EXPECT_EQ(back.part_placements.patterns().size(), 3u);
  EXPECT_EQ(back.part_placements.tensors().size(), 300u);
  for (size_t k = 0; k < P; ++k)
    EXPECT_EQ(back.part_placements.placement("model.layers.7.w", k), chunk_rows(100 + 900 * (7 % 3), 7, P)(k)) << "part " << k;
}

}  // namespace
