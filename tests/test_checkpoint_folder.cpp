// Checkpoint folders: a single file, a folder with model.safetensors.index.json, a folder of
// *.safetensors without one; every defect of a folder refused with one line naming the file; the
// save_pretrained-style split; and the folder writer's atomic replace.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "core/error.hpp"
#include "format/checkpoint_folder.hpp"
#include "test_support.hpp"

namespace {

namespace ds = deltasync;

struct Tensor {
  std::string name;
  std::vector<uint8_t> bytes;  // BF16, 1-D
};

void write_shard(const std::string& path, const std::vector<Tensor>& tensors, const ds::st::Metadata& md = {}) {
  std::vector<ds::st::WriteTensor> out;
  for (const auto& t : tensors) out.push_back({t.name, ds::DType::BF16, {t.bytes.size() / 2}, t.bytes});
  ds::st::write_file(path, out, md);
}

void write_text(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

// A folder as save_pretrained writes it: two shards and the index (with config.json beside).
struct Folder {
  TempDir dir;
  std::string path = dir.file("model");
  Folder() {
    std::filesystem::create_directory(path);
    write_shard(path + "/model-00001-of-00002.safetensors", {{"a", random_bytes(8, 1)}, {"b", random_bytes(4, 2)}}, {{"format", "pt"}});
    write_shard(path + "/model-00002-of-00002.safetensors", {{"c", random_bytes(16, 3)}}, {{"format", "pt"}});
    write_index(28);
    write_text(path + "/config.json", "{}");
  }
  void write_index(uint64_t total_size) {
    write_text(path + "/" + ds::kIndexFileName,
               ds::index_json({{"a", "model-00001-of-00002.safetensors"}, {"b", "model-00001-of-00002.safetensors"},
                               {"c", "model-00002-of-00002.safetensors"}},
                              total_size));
  }
};

TEST(CheckpointFolder, OpensAFolderWithIndexInShardOrder) {
  Folder f;
  const ds::Checkpoint c = ds::Checkpoint::open(f.path);
  EXPECT_TRUE(c.is_folder());
  ASSERT_EQ(c.shards().size(), 2u);
  EXPECT_EQ(c.shards()[0].file, "model-00001-of-00002.safetensors");
  std::vector<std::string> names;
  for (const auto& t : c.tensors()) names.push_back(t.name);
  EXPECT_EQ(names, (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_EQ(c.tensor_bytes(), 28u);
  EXPECT_EQ(c.other_files(), std::vector<std::string>{"config.json"});
  const auto at = c.find("c");
  ASSERT_TRUE(at.has_value());
  EXPECT_EQ(at->shard, 1u);
  const auto expected = random_bytes(16, 3);
  EXPECT_TRUE(std::equal(expected.begin(), expected.end(), c.bytes(*at).begin()));
  EXPECT_FALSE(c.find("zzz").has_value());
  EXPECT_EQ(c.recorded_version(), std::nullopt);
}

TEST(CheckpointFolder, FolderWithoutIndexAndSingleFile) {
  Folder f;
  std::filesystem::remove(f.path + "/" + ds::kIndexFileName);
  EXPECT_EQ(ds::Checkpoint::open(f.path).shards().size(), 2u);
  const ds::Checkpoint one = ds::Checkpoint::open(f.path + "/model-00002-of-00002.safetensors");
  EXPECT_FALSE(one.is_folder());
  EXPECT_EQ(one.shards().size(), 1u);
  EXPECT_TRUE(one.index_text().empty());
}

TEST(CheckpointFolder, DefectsAreOneLineErrorsNamingTheFile) {
  auto refused = [](const std::function<void(Folder&)>& breaker) {
    Folder f;
    breaker(f);
    return error_message([&] { ds::Checkpoint::open(f.path); });
  };
  const std::string index = std::string("/") + ds::kIndexFileName;
  std::string m = refused([](Folder& f) { std::filesystem::remove(f.path + "/model-00002-of-00002.safetensors"); });
  EXPECT_NE(m.find(index + ": names shard model-00002-of-00002.safetensors, which does not exist"), std::string::npos) << m;
  m = refused([](Folder& f) { write_shard(f.path + "/extra.safetensors", {{"d", random_bytes(2, 4)}}); });
  EXPECT_NE(m.find("/extra.safetensors: shard not named in model.safetensors.index.json"), std::string::npos) << m;
  m = refused([](Folder& f) {
    write_shard(f.path + "/model-00002-of-00002.safetensors", {{"c", random_bytes(16, 3)}, {"a", random_bytes(8, 1)}});
  });
  EXPECT_NE(m.find(": tensor a is in both model-00001-of-00002.safetensors and model-00002-of-00002.safetensors"), std::string::npos) << m;
  m = refused([](Folder& f) { f.write_index(30); });
  EXPECT_NE(m.find(index + ": metadata.total_size is 30 but the shards hold 28 bytes of tensors"), std::string::npos) << m;
  m = refused([](Folder& f) { write_shard(f.path + "/model-00002-of-00002.safetensors", {{"c", random_bytes(16, 3)}, {"x", random_bytes(2, 5)}}); });
  EXPECT_NE(m.find("model-00002-of-00002.safetensors: tensor x is not in the index's weight_map"), std::string::npos) << m;
  m = refused([](Folder& f) { write_shard(f.path + "/model-00002-of-00002.safetensors", {{"q", random_bytes(16, 3)}}); });
  EXPECT_NE(m.find("tensor q is not in the index's weight_map"), std::string::npos) << m;
  m = refused([](Folder& f) {
    write_text(f.path + "/" + ds::kIndexFileName, R"({"weight_map": {"a": "../model-00001-of-00002.safetensors"}})");
  });
  EXPECT_NE(m.find("not a file name inside the folder"), std::string::npos) << m;
  m = refused([](Folder& f) { write_text(f.path + "/" + ds::kIndexFileName, "{"); });
  EXPECT_NE(m.find(index + ": not a JSON object"), std::string::npos) << m;
  {
    Folder f;
    write_shard(f.path + "/model-00001-of-00002.safetensors", {{"a", random_bytes(8, 1)}, {"b", random_bytes(4, 2)}}, {{"model_version", "3"}});
    write_shard(f.path + "/model-00002-of-00002.safetensors", {{"c", random_bytes(16, 3)}}, {{"model_version", "4"}});
    m = error_message([&] { ds::Checkpoint::open(f.path).recorded_version(); });
  }
  EXPECT_NE(m.find("shards record different model versions"), std::string::npos) << m;
  TempDir empty;
  m = error_message([&] { ds::Checkpoint::open(empty.path().string()); });
  EXPECT_NE(m.find("folder holds no model.safetensors.index.json and no *.safetensors files"), std::string::npos) << m;
}

// A shard's model_version follows the one number rule: the 19-digit cap the old reader had is
// gone (10^19 is a version), and a sign or a space is refused naming the shard.
TEST(CheckpointFolder, RecordedVersionTakesExactDigitsOnly) {
  auto version_of = [](const std::string& text) {
    Folder f;
    const std::string shard = f.path + "/model-00002-of-00002.safetensors";
    write_shard(shard, {{"c", random_bytes(16, 3)}}, {{"model_version", text}});
    try {
      return std::to_string(ds::Checkpoint::open(f.path).recorded_version().value());
    } catch (const ds::BadInputError& e) {
      const std::string m = e.what();
      EXPECT_EQ(m.rfind(shard + ": ", 0), 0u) << m;
      return m.substr(shard.size() + 2);
    }
  };
  EXPECT_EQ(version_of("7"), "7");
  EXPECT_EQ(version_of("10000000000000000000"), "10000000000000000000");
  EXPECT_EQ(version_of("+7"), "metadata model_version '+7': not a decimal integer");
  EXPECT_EQ(version_of(" 7"), "metadata model_version ' 7': not a decimal integer");
  EXPECT_EQ(version_of("-1"), "metadata model_version '-1': not a decimal integer");
  EXPECT_EQ(version_of("18446744073709551616"), "metadata model_version '18446744073709551616': out of range (max 18446744073709551615)");
}

TEST(CheckpointFolder, PlanShardsSplitsAtTensorBoundaries) {
  std::vector<ds::TensorMeta> tensors{{"a", ds::DType::BF16, {10}}, {"b", ds::DType::BF16, {10}}, {"c", ds::DType::BF16, {100}},
                                      {"d", ds::DType::BF16, {1}}};
  const ds::WeightMap split = ds::plan_shards(tensors, 40);
  EXPECT_EQ(split.at("a"), "model-00001-of-00003.safetensors");
  EXPECT_EQ(split.at("b"), "model-00001-of-00003.safetensors");
  EXPECT_EQ(split.at("c"), "model-00002-of-00003.safetensors");  // larger than a shard: alone
  EXPECT_EQ(split.at("d"), "model-00003-of-00003.safetensors");
  EXPECT_EQ(ds::plan_shards(tensors, 1000).at("c"), "model.safetensors");
}

TEST(FolderWriter, CreatesReplacesAndCleansUp) {
  TempDir dir;
  const std::string target = dir.file("out");
  {
    ds::FolderWriter w(target);
    write_shard(w.path_of("model.safetensors"), {{"a", random_bytes(4, 1)}});
    // Destroyed without commit: nothing appears, the temporary folder is gone.
  }
  EXPECT_EQ(dir.entries(), std::vector<std::string>{});
  {
    ds::FolderWriter w(target);
    write_shard(w.path_of("model.safetensors"), {{"a", random_bytes(4, 1)}});
    w.commit();
  }
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"out"});
  {
    ds::FolderWriter w(target);
    write_shard(w.path_of("model-00001-of-00001.safetensors"), {{"a", random_bytes(4, 2)}});
    w.commit();  // replaces the old folder whole
  }
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"out"});
  EXPECT_FALSE(std::filesystem::exists(target + "/model.safetensors"));
  EXPECT_TRUE(std::filesystem::exists(target + "/model-00001-of-00001.safetensors"));
  write_text(dir.file("file"), "x");
  ds::FolderWriter w(dir.file("file"));
  const std::string m = error_message([&] { w.commit(); });
  EXPECT_NE(m.find("exists and is not a folder"), std::string::npos) << m;
}

}  // namespace
