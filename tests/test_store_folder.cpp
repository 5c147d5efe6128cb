// The folder store: whole-object semantics, exclusive create under contention, ranges, listing,
// removal, conditional reads, and keys that must be refused.
#include <gtest/gtest.h>

#include <atomic>
#include <filesystem>
#include <string>
#include <thread>

#include "store/store.hpp"
#include "test_support.hpp"

namespace {

using deltasync::NotFoundError;
using deltasync::Store;

std::span<const uint8_t> bytes_of(const std::string& s) { return {reinterpret_cast<const uint8_t*>(s.data()), s.size()}; }
std::string text_of(const std::vector<uint8_t>& b) { return std::string(b.begin(), b.end()); }

TEST(FolderStore, PutGetOverwrite) {
  TempDir dir;
  auto store = deltasync::open_store("file://" + dir.path().string());
  store->put("a/b/c.bin", bytes_of("first"));
  EXPECT_EQ(text_of(store->get("a/b/c.bin")), "first");
  store->put("a/b/c.bin", bytes_of("second, longer"));
  EXPECT_EQ(text_of(store->get("a/b/c.bin")), "second, longer");
  store->put("empty", {});
  EXPECT_TRUE(store->get("empty").empty());
  EXPECT_EQ(store->describe("a/b/c.bin"), "file://" + dir.path().string() + "/a/b/c.bin");
}

TEST(FolderStore, MissingObjects) {
  TempDir dir;
  auto store = deltasync::open_store(dir.path().string());
  EXPECT_THROW(store->get("nope"), NotFoundError);
  EXPECT_THROW(store->get_range("nope", 0, 1), NotFoundError);
  EXPECT_FALSE(store->head("nope").has_value());
  EXPECT_NO_THROW(store->remove("nope"));
  std::string msg = error_message([&] { store->get("x/nope"); });
  EXPECT_NE(msg.find("x/nope"), std::string::npos) << msg;
}

TEST(FolderStore, PutIfAbsentDoesNotReplace) {
  TempDir dir;
  auto store = deltasync::open_store(dir.path().string());
  EXPECT_TRUE(store->put_if_absent("m/1.json", bytes_of("one")));
  EXPECT_FALSE(store->put_if_absent("m/1.json", bytes_of("two")));
  EXPECT_EQ(text_of(store->get("m/1.json")), "one");
  // No temporary files left behind by the losing write.
  EXPECT_EQ(store->list("").size(), 1u);
  size_t files = 0;
  for (auto& e : std::filesystem::recursive_directory_iterator(dir.path())) files += e.is_regular_file();
  EXPECT_EQ(files, 1u);
}

TEST(FolderStore, PutIfAbsentHasExactlyOneWinnerUnderContention) {
  TempDir dir;
  auto store = deltasync::open_store(dir.path().string());
  for (int round = 0; round < 20; ++round) {
    const std::string key = "race/" + std::to_string(round);
    std::atomic<int> winners{0}, winner_id{-1};
    std::vector<std::thread> threads;
    for (int t = 0; t < 8; ++t) {
      threads.emplace_back([&, t] {
        const std::string payload = "writer-" + std::to_string(t) + std::string(4096, char('a' + t));
        if (store->put_if_absent(key, bytes_of(payload))) {
          ++winners;
          winner_id = t;
        }
      });
    }
    for (auto& th : threads) th.join();
    ASSERT_EQ(winners.load(), 1) << key;
    const int w = winner_id.load();
    EXPECT_EQ(text_of(store->get(key)), "writer-" + std::to_string(w) + std::string(4096, char('a' + w)));
  }
}

TEST(FolderStore, Ranges) {
  TempDir dir;
  auto store = deltasync::open_store(dir.path().string());
  store->put("r", bytes_of("0123456789"));
  EXPECT_EQ(text_of(store->get_range("r", 2, 3)), "234");
  EXPECT_EQ(text_of(store->get_range("r", 8, 100)), "89");
  EXPECT_EQ(text_of(store->get_range("r", 10, 5)), "");
  EXPECT_THROW(store->get_range("r", 11, 1), deltasync::Error);
}

TEST(FolderStore, HeadAndConditionalGet) {
  TempDir dir;
  auto store = deltasync::open_store(dir.path().string());
  store->put("LATEST", bytes_of("1\n"));
  auto info = store->head("LATEST");
  ASSERT_TRUE(info);
  EXPECT_EQ(info->size, 2u);
  auto first = store->get_if_changed("LATEST", "");
  EXPECT_TRUE(first.changed);
  EXPECT_EQ(text_of(first.bytes), "1\n");
  auto same = store->get_if_changed("LATEST", first.etag);
  EXPECT_FALSE(same.changed);
  EXPECT_TRUE(same.bytes.empty());
  store->put("LATEST", bytes_of("22\n"));  // a new file (rename): a new tag
  auto moved = store->get_if_changed("LATEST", first.etag);
  EXPECT_TRUE(moved.changed);
  EXPECT_EQ(text_of(moved.bytes), "22\n");
}

TEST(FolderStore, ListByPrefixSortedAndWithoutTemporaries) {
  TempDir dir;
  auto store = deltasync::open_store(dir.path().string());
  store->put("manifests/002.json", bytes_of("b"));
  store->put("manifests/001.json", bytes_of("a"));
  store->put("deltas/001.st", bytes_of("xyz"));
  store->put("anchors/001-n/part-0.st", bytes_of("p"));
  // A crashed writer's leftover must stay invisible.
  write_file_bytes(dir.file("manifests/.003.json.deltasync-tmp.0123456789abcdef"), bytes_of("junk"));
  auto manifests = store->list("manifests/");
  ASSERT_EQ(manifests.size(), 2u);
  EXPECT_EQ(manifests[0].key, "manifests/001.json");
  EXPECT_EQ(manifests[1].key, "manifests/002.json");
  EXPECT_EQ(store->list("manifests/00").size(), 2u);
  EXPECT_EQ(store->list("anchors/").at(0).key, "anchors/001-n/part-0.st");
  EXPECT_EQ(store->list("").size(), 4u);
  EXPECT_EQ(store->list("deltas/").at(0).size, 3u);
  EXPECT_TRUE(store->list("missing/").empty());
}

TEST(FolderStore, RemoveDropsEmptyFolders) {
  TempDir dir;
  auto store = deltasync::open_store(dir.path().string());
  store->put("anchors/v1/part-0", bytes_of("p"));
  store->remove("anchors/v1/part-0");
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "anchors"));
  EXPECT_TRUE(std::filesystem::exists(dir.path()));
}

TEST(FolderStore, RefusesKeysThatEscapeTheRoot) {
  TempDir dir;
  auto store = deltasync::open_store(dir.path().string());
  for (const char* key : {"../x", "a/../../x", "/abs", "", "a//b", "a/", "./a"}) {
    EXPECT_THROW(store->put(key, bytes_of("x")), deltasync::Error) << key;
    EXPECT_THROW(store->head(key), deltasync::Error) << key;
  }
}

TEST(OpenStore, RejectsUnknownSchemes) {
  std::string msg = error_message([] { deltasync::open_store("ftp://host/x"); });
  EXPECT_NE(msg.find("unknown store URL"), std::string::npos) << msg;
}

TEST(OpenStore, S3NeedsCredentialsAndNeverPrintsThem) {
  unsetenv("AWS_ACCESS_KEY_ID");
  setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-value", 1);
  std::string msg = error_message([] { deltasync::open_store("s3://bucket/prefix"); });
  EXPECT_NE(msg.find("AWS_ACCESS_KEY_ID"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("s3cr3t-value"), std::string::npos) << msg;
  unsetenv("AWS_SECRET_ACCESS_KEY");
}

TEST(OpenStore, ErrorsNeverEchoSecretsWrittenIntoTheUrl) {
  // A key pair typed into an s3:// URL, a password in an unknown scheme's URL, a signature in a
  // query string: the error names the store without them.
  for (const char* url : {"s3://AKIAEXAMPLE:topsecret@bucket/prefix", "ftp://user:topsecret@host/x",
                          "gs://bucket/obj?sig=topsecret"}) {
    std::string msg = error_message([&] { deltasync::open_store(url); });
    EXPECT_FALSE(msg.empty()) << url;
    EXPECT_EQ(msg.find("topsecret"), std::string::npos) << msg;
  }
}

TEST(OpenStore, HttpStoreCannotList) {
  auto store = deltasync::open_store("http://127.0.0.1:9/base");
  std::string msg = error_message([&] { store->list("manifests/"); });
  EXPECT_NE(msg.find("listing is not supported"), std::string::npos) << msg;
}

}  // namespace
