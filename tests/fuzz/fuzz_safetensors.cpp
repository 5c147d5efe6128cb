// Fuzzes the strict safetensors reader (st::File::from_bytes): every file a receiver parses
// (deltas, anchors, checkpoints) goes through it first.
// An accepted file must hold what the reader promises: tensors whose byte ranges lie inside the
// file, of dtype x shape bytes, that serialize() writes back into a file the reader accepts with
// the same tensors and metadata.
#include <algorithm>

#include "core/error.hpp"
#include "format/safetensors.hpp"
#include "fuzz_model.hpp"

using namespace deltasync;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::optional<st::File> file;
  try {
    file.emplace(st::File::from_bytes(std::vector<uint8_t>(data, data + size), "fuzz file"));
  } catch (const Error&) {
    return 0;
  }
  std::vector<st::WriteTensor> tensors;
  for (const st::TensorInfo& t : file->tensors()) {
    const std::span<const uint8_t> bytes = file->bytes(t);
    if (bytes.size() != t.nbytes() || t.nbytes() != t.numel() * dtype_width(t.dtype))
      fuzz::fail("an accepted tensor's bytes are not dtype x shape");
    tensors.push_back({t.name, t.dtype, t.shape, bytes});
  }
  const std::vector<uint8_t> again = st::serialize(tensors, file->metadata());
  const st::File reread = st::File::from_bytes(again, "fuzz file (rewritten)");
  if (reread.metadata() != file->metadata() || reread.tensors().size() != file->tensors().size())
    fuzz::fail("a rewritten file reads back differently");
  for (size_t k = 0; k < reread.tensors().size(); ++k) {
    const auto& a = reread.tensors()[k];
    const auto& b = file->at(a.name);
    if (a.dtype != b.dtype || a.shape != b.shape) fuzz::fail("a rewritten tensor reads back with another dtype or shape");
    const auto x = reread.bytes(a), y = file->bytes(b);
    if (!std::equal(x.begin(), x.end(), y.begin(), y.end())) fuzz::fail("a rewritten tensor's bytes differ");
  }
  return 0;
}
