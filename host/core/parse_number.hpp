// The one parser for every number deltasync reads as text: safetensors metadata (model_version,
// element counts, publisher state), the store's object keys and LATEST pointer, S3 XML listings
// and HTTP headers, environment variables and CLI flags. Each of these used to have its own rule
// (std::stoull reads " 7" and "+7" as 7 and "-1" as 2^64-1); now they share this one.
//
// Decimal integers: one or more ASCII digits '0'-'9' and nothing else. No sign (not even '+'),
// no spaces, no empty text, no trailing characters, no digits of other scripts. Leading zeros are
// accepted and change nothing ("007" is 7): the store's keys carry versions zero-padded to 20
// digits, and decimal text has no octal reading to confuse. The value must fit the target type
// (a signed type gets its non-negative range only) or the caller's stricter maximum.
//
// Real numbers (shares, intervals, learning rates): DIGITS[.DIGITS] or .DIGITS, then optionally
// e or E, an optional sign and DIGITS. No leading sign, no spaces, no inf/nan/hex; the value
// must be finite.
//
// Hex digests: exactly 16 lowercase hex digits (what digest_to_hex writes).
//
// Every refusal is a one-line Error of the caller's kind (BadInput by default), shaped
//   "<what> '<text>': not a decimal integer"
//   "<what> '<text>': out of range (max N)"
//   "<what> '<text>': not a decimal number"
//   "<what> '<text>': not 16 lowercase hex digits"
// where `what` names the file, tensor, header or flag ("m.safetensors: metadata model_version",
// "option --version"). The text is quoted with control and non-ASCII bytes as \xNN and cut
// after 40 bytes, so the message stays one line whatever the input holds.
#pragma once
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>

#include "core/error.hpp"

namespace deltasync {

// The decimal rule with an explicit maximum; nullopt when `text` breaks it. For callers to whom
// a non-number is not an error (an object key that is not one of the store's).
std::optional<uint64_t> try_parse_decimal(std::string_view text, uint64_t max = std::numeric_limits<uint64_t>::max());

// The decimal rule with an explicit maximum; throws Error(kind) in the shape above.
uint64_t parse_decimal(std::string_view text, uint64_t max, std::string_view what, ErrorKind kind = ErrorKind::kBadInput);

// The decimal rule, range-checked against T (any integer type but bool).
template <class T>
  requires(std::is_integral_v<T> && !std::is_same_v<T, bool>)
T parse_decimal(std::string_view text, std::string_view what, ErrorKind kind = ErrorKind::kBadInput) {
  return static_cast<T>(parse_decimal(text, static_cast<uint64_t>(std::numeric_limits<T>::max()), what, kind));
}

// The real-number rule; throws Error(kind) in the shape above.
double parse_decimal_real(std::string_view text, std::string_view what, ErrorKind kind = ErrorKind::kBadInput);

// Exactly 16 lowercase hex digits; throws Error(kind) in the shape above.
uint64_t parse_hex64(std::string_view text, std::string_view what, ErrorKind kind = ErrorKind::kBadInput);

// `text` as the messages above quote it: '...', \xNN for bytes outside printable ASCII, cut
// after 40 bytes. For callers that refuse a number on their own terms (a version not newer).
std::string quoted_input(std::string_view text);

}  // namespace deltasync
