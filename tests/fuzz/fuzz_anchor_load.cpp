// Fuzzes an anchor part on its way into a fixed small model, through the subscriber's path:
// verify_anchor (parse, versions, every tensor once, digests recomputed and compared with the
// part's and the manifest's), then Receiver::load_anchor (TensorReceiver, which refuses an
// anchor of another model before writing). The manifest is the one the publisher wrote for the
// seed anchor, with the part's size and SHA-256 taken from the input (a party that can write
// the bucket can make those match), so the fuzzer works on what lies behind the object check.
// A refused anchor must leave the model's bits, version and digests as they were; an accepted
// one must leave exactly the manifest's weights.
#include <cstring>

#include "core/error.hpp"
#include "engine/cpu_sync_engine.hpp"
#include "fuzz_model.hpp"
#include "format/sha256.hpp"
#include "sync/receiver.hpp"
#include "sync/subscriber.hpp"

using namespace deltasync;

namespace {

struct Fixture {
  HostModel pristine = fuzz::base_model();
  HostModel expected = fuzz::next_model();
  HostModel model = fuzz::base_model();
  engine::CpuSyncEngine engine;
  TensorReceiver receiver{model.tensors, model.refs(), engine};
  protocol::Manifest manifest;

  Fixture() {
    manifest.version = fuzz::kNextVersion;
    manifest.latest_anchor = fuzz::kNextVersion;
    manifest.digest_algorithm = std::string(integrity::kDigestAlgorithm);
    for (size_t t = 0; t < expected.tensors.size(); ++t)
      manifest.digests[expected.tensors[t].name] = digest_to_hex(expected.digests[t]);
  }
  void reset() {
    std::vector<std::span<const uint8_t>> bytes;
    for (const auto& d : pristine.data) bytes.emplace_back(d);
    receiver.load_anchor(pristine.tensors, bytes, pristine.digests, fuzz::kBaseVersion);
  }
  bool bits_equal(const HostModel& other) const {
    for (size_t t = 0; t < model.data.size(); ++t)
      if (std::memcmp(model.data[t].data(), other.data[t].data(), model.data[t].size()) != 0) return false;
    return true;
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Fixture* f = new Fixture;
  f->reset();
  std::vector<uint8_t> part(data, data + size);
  protocol::Manifest manifest = f->manifest;
  manifest.anchor_parts = {protocol::ObjectRef{"anchors/fuzz/part-00000.safetensors", part.size(), sha256_hex(part)}};
  try {
    protocol::verify_object(manifest.anchor_parts[0], part, "fuzz anchor");
    VerifiedAnchor verified = verify_anchor(manifest, {std::move(part)}, "fuzz anchor");
    f->receiver.load_anchor(verified.tensors, verified.bytes, verified.digests, manifest.version);
  } catch (const Error& e) {
    fuzz::note("refused", e.what());
    if (!f->bits_equal(f->pristine)) fuzz::fail("a refused anchor changed the weights");
    if (f->receiver.version() != fuzz::kBaseVersion) fuzz::fail("a refused anchor changed the version");
    if (f->receiver.digests() != f->pristine.digests) fuzz::fail("a refused anchor changed the digests");
    return 0;
  }
  if (f->receiver.version() != fuzz::kNextVersion) fuzz::fail("an accepted anchor left the wrong version");
  if (f->receiver.digests() != f->expected.digests) fuzz::fail("an accepted anchor left digests other than the manifest's");
  f->receiver.recompute_digests();
  if (f->receiver.digests() != f->expected.digests) fuzz::fail("an accepted anchor's digests are not its bits'");
  fuzz::note("accepted");
  return 0;
}
