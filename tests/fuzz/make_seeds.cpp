// Writes the fuzzers' seed corpora from valid files: `fuzz_make_seeds DIR` fills DIR/<harness>/
// (the harness fuzz_<harness>.cpp) with files the library itself writes for the fuzz model
// (fuzz_model.hpp) and with the S3 and HTTP answers real servers give. scripts/fuzz --seeds
// runs it into tests/fuzz/corpus/; libFuzzer then mutates from there.
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "format/checkpoint_folder.hpp"
#include "fuzz_model.hpp"
#include "format/sha256.hpp"
#include "sync/protocol.hpp"

using namespace deltasync;
namespace fs = std::filesystem;

namespace {

fs::path g_root;

void put(const std::string& harness, const std::string& name, std::span<const uint8_t> bytes) {
  const fs::path dir = g_root / harness;
  fs::create_directories(dir);
  std::ofstream out(dir / name, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + (dir / name).string());
}
void put(const std::string& harness, const std::string& name, std::string_view text) {
  put(harness, name, std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
}

void model_files() {
  const std::pair<DeltaFormat, const char*> formats[] = {
      {DeltaFormat::Compact, "compact"}, {DeltaFormat::Trl, "trl"}, {DeltaFormat::TrlIdx, "trl-idx"}, {DeltaFormat::TrlIdxRaw, "trl-idx-raw"}};
  for (const auto& [format, name] : formats) {
    const auto bytes = fuzz::seed_delta(format);
    put("delta_apply", std::string("delta-") + name + ".safetensors", bytes);
    put("safetensors", std::string("delta-") + name + ".safetensors", bytes);
  }
  const auto anchor = fuzz::seed_anchor();
  put("anchor_load", "anchor.safetensors", anchor);
  put("safetensors", "anchor.safetensors", anchor);
  put("safetensors", "empty.safetensors", st::serialize({}, {}));

  compact::Options v2_untiled;
  v2_untiled.version = compact::kFormatVersion2;
  v2_untiled.max_tiles = 1;
  v2_untiled.layout = compact::kLayout1;
  const auto compact_v2 = fuzz::seed_compact_delta(v2_untiled);
  put("delta_apply", "delta-compact-v2.safetensors", compact_v2);
  put("safetensors", "delta-compact-v2.safetensors", compact_v2);
  // Tiles (block index version 2, the 2-D tensor banded), in both stream versions.
  const auto tiled = fuzz::seed_compact_delta(fuzz::tiled_seed_options(compact::kFormatVersion1));
  const auto tiled_v2 = fuzz::seed_compact_delta(fuzz::tiled_seed_options(compact::kFormatVersion2));
  put("delta_apply", "delta-compact-tiled.safetensors", tiled);
  put("safetensors", "delta-compact-tiled.safetensors", tiled);
  put("delta_apply", "delta-compact-v2-tiled.safetensors", tiled_v2);
  // The indexed layout (compact_layout 2: bitmap, records, entries with block hashes), tiled, in
  // both stream versions: what publishers write.
  for (const uint32_t version : {compact::kFormatVersion1, compact::kFormatVersion2}) {
    const auto indexed = fuzz::seed_compact_delta(fuzz::tiled_seed_options(version, compact::kLayout2));
    const std::string name = std::string("delta-compact-indexed") + (version == compact::kFormatVersion2 ? "-v2" : "") + ".safetensors";
    put("delta_apply", name, indexed);
    put("safetensors", name, indexed);
  }

  // The compact deltas' encoded tensors, in the block harness's framing (byte 0: the tensor,
  // plus 0x80 for compact_version 2, plus 0x40 for block index version 2).
  const auto meta = fuzz::model_meta();
  const std::pair<std::vector<uint8_t>, const char*> sources[] = {
      {fuzz::seed_delta(DeltaFormat::Compact), "block-"}, {compact_v2, "block-v2-"}, {tiled, "block-tiled-"}, {tiled_v2, "block-v2-tiled-"}};
  for (const auto& [bytes, prefix] : sources) {
    const st::File compact = st::File::from_bytes(bytes, "seed");
    const uint8_t flags = static_cast<uint8_t>((compact.metadata().at("compact_version") == "2" ? 0x80 : 0) |
                                               (compact::read_index_version(compact.metadata(), "seed") == 2 ? 0x40 : 0));
    for (size_t t = 0; t < meta.size(); ++t) {
      const st::TensorInfo* index = compact.find(meta[t].name + ".cindex");
      const st::TensorInfo* payload = compact.find(meta[t].name + ".cdata");
      if (!index || !payload) continue;
      std::vector<uint8_t> framed{static_cast<uint8_t>(t | flags)};
      const uint32_t n = static_cast<uint32_t>(index->nbytes());
      for (int b = 0; b < 4; ++b) framed.push_back(static_cast<uint8_t>(n >> (8 * b)));
      for (auto* part : {index, payload}) {
        const auto part_bytes = compact.bytes(*part);
        framed.insert(framed.end(), part_bytes.begin(), part_bytes.end());
      }
      put("compact_block", prefix + std::to_string(t), framed);
    }
  }
  {  // every element of tensor 0 changed, version 2: full 32-change groups (the SIMD decode path)
    const HostModel base = fuzz::base_model();
    const uint64_t n = meta[0].numel();
    const uint32_t w = meta[0].width();
    SparseDelta dense;
    dense.offsets = {0, n, n, n, n};
    dense.value_offsets = {0, n * w, n * w, n * w, n * w};
    for (uint64_t i = 0; i < n; ++i) {
      dense.indices.push_back(static_cast<int64_t>(i));
      for (uint32_t b = 0; b < w; ++b) {
        const uint8_t old = base.data[0][i * w + b];
        dense.base_values.push_back(old);
        dense.values.push_back(b == 0 ? static_cast<uint8_t>(old ^ (1 + i % 3)) : old);
      }
    }
    compact::Options options;
    options.version = compact::kFormatVersion2;
    options.max_tiles = 1;
    const auto encoded = compact::encode(meta, dense.view(), options).at(0);
    std::vector<uint8_t> framed{0x80};
    const uint32_t len = static_cast<uint32_t>(encoded.block_index.size());
    for (int b = 0; b < 4; ++b) framed.push_back(static_cast<uint8_t>(len >> (8 * b)));
    framed.insert(framed.end(), encoded.block_index.begin(), encoded.block_index.end());
    framed.insert(framed.end(), encoded.payload.begin(), encoded.payload.end());
    put("compact_block", "block-v2-dense-0", framed);
  }

  // The index of the checkpoint folder fuzz_checkpoint_index holds (two shards).
  WeightMap map;
  uint64_t total = 0;
  for (size_t t = 0; t < meta.size(); ++t) {
    map[meta[t].name] = "model-0000" + std::to_string(t / 2 + 1) + "-of-00002.safetensors";
    total += meta[t].numel() * meta[t].width();
  }
  put("checkpoint_index", "index.json", index_json(map, total));
  put("checkpoint_index", "index-no-metadata.json", R"({"weight_map": {"layers.0.attn.w": "model-00001-of-00002.safetensors", "layers.0.norm": "model-00001-of-00002.safetensors", "embed": "model-00002-of-00002.safetensors", "head.scale": "model-00002-of-00002.safetensors"}})");
}

void protocol_files() {
  const HostModel next = fuzz::next_model();
  protocol::Manifest m;
  m.version = fuzz::kNextVersion;
  m.base_version = fuzz::kBaseVersion;
  const auto delta = fuzz::seed_delta(DeltaFormat::Compact);
  m.delta = protocol::ObjectRef{protocol::delta_key(m.version, "0123456789ab"), delta.size(), sha256_hex(delta)};
  m.delta_format = "compact";
  m.changed_elements = 40;
  m.latest_anchor = fuzz::kBaseVersion;
  m.total_elements = next.elements();
  m.model_bytes = next.bytes();
  m.digest_algorithm = std::string(integrity::kDigestAlgorithm);
  for (size_t t = 0; t < next.tensors.size(); ++t) m.digests[next.tensors[t].name] = digest_to_hex(next.digests[t]);
  m.created_unix_ms = 1764633600000;
  put("manifest", "delta.json", protocol::to_json(m));
  const auto anchor = fuzz::seed_anchor();
  m.anchor_parts = {protocol::ObjectRef{protocol::anchor_part_key(m.version, "abcdef012345", 0), anchor.size(), sha256_hex(anchor)}};
  m.latest_anchor = m.version;
  put("manifest", "anchor-delta.json", protocol::to_json(m));
  m.delta.reset();
  m.base_version.reset();
  m.delta_format.clear();
  put("manifest", "anchor.json", protocol::to_json(m));
  put("manifest", "latest", "6\n");
  put("manifest", "manifest-key", protocol::manifest_key(6));
}

void store_answers() {
  put("s3_xml", "list.xml",
      R"(<?xml version="1.0" encoding="UTF-8"?>
<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Name>bucket</Name><Prefix>run/manifests/</Prefix><KeyCount>2</KeyCount><MaxKeys>1000</MaxKeys><IsTruncated>true</IsTruncated><NextContinuationToken>1ueGcxLPRx1Tr/XYExHnhbYLgveDs2J/wm36Hy4vbOwM=</NextContinuationToken><Contents><Key>run/manifests/00000000000000000005.json</Key><LastModified>2026-12-01T22:00:00.000Z</LastModified><ETag>&quot;9b2cf535f27731c974343645a3985328&quot;</ETag><Size>812</Size><StorageClass>STANDARD</StorageClass></Contents><Contents><Key>run/manifests/00000000000000000006.json</Key><ETag>"a1"</ETag><Size>790</Size></Contents></ListBucketResult>)");
  put("s3_xml", "list-folders.xml",
      R"(<ListBucketResult><Prefix>run/</Prefix><Delimiter>/</Delimiter><IsTruncated>false</IsTruncated><CommonPrefixes><Prefix>run/anchors/</Prefix></CommonPrefixes><CommonPrefixes><Prefix>run/deltas/</Prefix></CommonPrefixes></ListBucketResult>)");
  put("s3_xml", "initiate.xml",
      R"(<?xml version="1.0" encoding="UTF-8"?>
<InitiateMultipartUploadResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Bucket>bucket</Bucket><Key>run/anchors/x/part-00000.safetensors</Key><UploadId>VXBsb2FkIElEIGZvciA2aWWpbmcncyBteS1tb3ZpZS5tMnRzIHVwbG9hZA</UploadId></InitiateMultipartUploadResult>)");
  put("s3_xml", "complete.xml",
      R"(<CompleteMultipartUploadResult><Location>https://bucket.s3.amazonaws.com/k</Location><Bucket>bucket</Bucket><Key>k</Key><ETag>"3858f62230ac3c915f300c664312c11f-9"</ETag></CompleteMultipartUploadResult>)");
  put("s3_xml", "error.xml",
      R"(<?xml version="1.0" encoding="UTF-8"?>
<Error><Code>SignatureDoesNotMatch</Code><Message>The request signature we calculated does not match the signature you provided.</Message><RequestId>4442587FB7D0A2F9</RequestId></Error>)");
  put("s3_xml", "entities.xml", R"(<!DOCTYPE a [<!ENTITY e "x&amp;y">]><Error><Code>&e;&#65;&lt;</Code><![CDATA[<raw>]]></Error>)");

  // Byte 0 picks the original request (see fuzz_http_headers.cpp): 0x60 = signed GET of the
  // S3 URL with the pre-signed policy; 0x00 = unsigned GET, same-origin policy.
  auto headers = [](uint8_t pick, std::string lines) {
    std::string out(1, static_cast<char>(pick));
    return out + lines;
  };
  put("http_headers", "presigned-redirect",
      headers(0x60, "HTTP/1.1 307 Temporary Redirect\r\nLocation: https://cdn-lfs.hf.co/repos/ab/cd/part?X-Amz-Signature=abc&X-Amz-Expires=3600\r\nContent-Length: 0\r\n\r\n"));
  put("http_headers", "relative-redirect", headers(0x00, "HTTP/1.1 301 Moved Permanently\r\nlocation: ../other/key\r\n\r\n"));
  put("http_headers", "absolute-path-redirect", headers(0x02, "HTTP/1.1 302 Found\r\nLocation:   /bucket/LATEST?x=1 \r\n"));
  put("http_headers", "continue-then-ok",
      headers(0x01, "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nETag: \"abc\"\r\nContent-Range: bytes 0-99/1000\r\nx-amz-request-id: 1\r\n\r\n"));
  put("http_headers", "loopback-redirect", headers(0x62, "HTTP/1.1 307 Temporary Redirect\r\nLocation: http://localhost:9001/presigned/obj?sig=1\r\n"));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: fuzz_make_seeds DIR\n");
    return 2;
  }
  g_root = argv[1];
  model_files();
  protocol_files();
  store_answers();
  return 0;
}
