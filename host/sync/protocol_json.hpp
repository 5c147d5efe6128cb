// The JSON form of the protocol's records that other writers embed: an object reference
// {key, size, sha256}, written by manifests and by the receipts of a sharded publish
// (sync/shard_publish.hpp), read by one strict parser.
#pragma once
#include <nlohmann/json.hpp>
#include <string>

#include "sync/protocol.hpp"

namespace deltasync::protocol {

nlohmann::json object_json(const ObjectRef& ref);
// Strict: BadInputError("LABEL: ...") for a missing or mistyped field, a malformed sha256 or an
// object key that could leave the store's root.
ObjectRef object_from_json(const nlohmann::json& j, const std::string& label);

}  // namespace deltasync::protocol
