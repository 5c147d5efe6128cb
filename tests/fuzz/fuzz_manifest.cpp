// Fuzzes what a subscriber reads from the store before any object: a version's manifest JSON
// (protocol::manifest_from_json), the LATEST pointer (parse_latest) and manifest keys from a
// listing (version_of_manifest_key). The same input goes to all three.
// An accepted manifest must survive a round trip: its JSON parses back to the same JSON (so a
// publisher and a subscriber agree on what it says).
#include <string>

#include "core/error.hpp"
#include "fuzz_model.hpp"
#include "sync/protocol.hpp"

using namespace deltasync;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const protocol::Manifest m = protocol::manifest_from_json(text, "fuzz manifest");
    const std::string again = protocol::to_json(m);
    if (protocol::to_json(protocol::manifest_from_json(again, "fuzz manifest (again)")) != again)
      fuzz::fail("a manifest's JSON does not round-trip");
  } catch (const Error&) {
  }
  try {
    if (const auto v = protocol::parse_latest(text, "fuzz LATEST"))
      if (protocol::parse_latest(std::to_string(*v) + "\n", "fuzz LATEST (again)") != v)
        fuzz::fail("LATEST written for a version does not read back as it");
  } catch (const Error&) {
  }
  try {
    const protocol::LatestPointer p = protocol::parse_latest_pointer(text, "fuzz LATEST");
    const protocol::LatestPointer back = protocol::parse_latest_pointer(protocol::latest_text(p), "fuzz LATEST (again)");
    if (back.version != p.version || back.fence != p.fence) fuzz::fail("a LATEST pointer with its fence does not round-trip");
  } catch (const Error&) {
  }
  if (const auto v = protocol::version_of_manifest_key(std::string(text)))
    if (protocol::version_of_manifest_key(protocol::manifest_key(*v)) != v)
      fuzz::fail("a manifest key does not name its version");
  return 0;
}
