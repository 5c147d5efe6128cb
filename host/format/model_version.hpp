// The "model_version" metadata key that checkpoints, deltas and anchor parts carry: the training
// step their weights belong to. Read here, and only here, so every file kind takes the same
// spellings (core/parse_number.hpp's decimal rule) and refuses the rest with the same message.
#pragma once
#include <cstdint>
#include <optional>
#include <string>

#include "format/safetensors.hpp"

namespace deltasync {

inline constexpr const char* kModelVersionKey = "model_version";

// The version `md` records; nullopt without the key. BadInputError("LABEL: metadata
// model_version '+7': not a decimal integer") when the value breaks the rule.
std::optional<uint64_t> read_model_version(const st::Metadata& md, const std::string& label);

}  // namespace deltasync
