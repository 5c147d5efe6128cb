// Fuzzes resolving and applying a delta file of any layout (compact, trl, trl-idx, trl-idx-raw:
// resolve_delta tells them apart by the file's metadata) to a fixed small model, through the
// subscriber's own apply path: st::File::from_bytes, then Receiver::apply (TensorReceiver over
// the CPU engine, the verified and transactional apply every receiver runs).
// After every refused input the model's bits, version and digests must be what they were;
// after an accepted one the model must be at the delta's version with digests that are the
// digests of its bits (the result digests the delta promised held).
#include <cstring>

#include "core/error.hpp"
#include "engine/cpu_sync_engine.hpp"
#include "fuzz_model.hpp"
#include "sync/receiver.hpp"

using namespace deltasync;

namespace {

struct Fixture {
  HostModel pristine = fuzz::base_model();
  HostModel model = fuzz::base_model();
  engine::CpuSyncEngine engine;
  TensorReceiver receiver{model.tensors, model.refs(), engine};

  // Back to the base model at kBaseVersion, the way a subscriber starts: from an anchor.
  void reset() {
    std::vector<std::span<const uint8_t>> bytes;
    for (const auto& d : pristine.data) bytes.emplace_back(d);
    receiver.load_anchor(pristine.tensors, bytes, pristine.digests, fuzz::kBaseVersion);
  }
  bool bits_unchanged() const {
    for (size_t t = 0; t < model.data.size(); ++t)
      if (std::memcmp(model.data[t].data(), pristine.data[t].data(), model.data[t].size()) != 0) return false;
    return true;
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Fixture* f = new Fixture;  // never destroyed: libFuzzer exits without unwinding
  f->reset();
  std::optional<st::File> file;
  try {
    file.emplace(st::File::from_bytes(std::vector<uint8_t>(data, data + size), "fuzz delta"));
  } catch (const Error& e) {
    fuzz::note("refused", e.what());
    return 0;  // refused before the weights were involved
  }
  const engine::DeltaToApply delta{&*file, fuzz::kNextVersion, fuzz::kBaseVersion};
  engine::TransferCounters transfer;
  try {
    f->receiver.apply(delta, transfer);
  } catch (const Error& e) {
    fuzz::note("refused", e.what());
    if (!f->bits_unchanged()) fuzz::fail("a refused delta changed the weights");
    if (f->receiver.version() != fuzz::kBaseVersion) fuzz::fail("a refused delta changed the version");
    if (f->receiver.digests() != f->pristine.digests) fuzz::fail("a refused delta changed the digests");
    return 0;
  }
  if (f->receiver.version() != fuzz::kNextVersion) fuzz::fail("an accepted delta left the wrong version");
  const std::vector<uint64_t> claimed = f->receiver.digests();
  f->receiver.recompute_digests();
  if (f->receiver.digests() != claimed) fuzz::fail("an accepted delta left digests that are not its bits'");
  fuzz::note("accepted");
  return 0;
}
