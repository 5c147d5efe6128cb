#include "core/parse_number.hpp"

#include <charconv>
#include <cstdio>
#include <system_error>

namespace deltasync {
namespace {

constexpr size_t kQuotedBytes = 40;

bool is_digit(char c) { return c >= '0' && c <= '9'; }

size_t skip_digits(std::string_view text, size_t at) {
  while (at < text.size() && is_digit(text[at])) ++at;
  return at;
}

// DIGITS[.DIGITS] | .DIGITS, then [(e|E)[+|-]DIGITS]; the whole text.
bool is_real_text(std::string_view text) {
  size_t at = skip_digits(text, 0);
  size_t mantissa_digits = at;
  if (at < text.size() && text[at] == '.') {
    const size_t fraction = at + 1;
    at = skip_digits(text, fraction);
    mantissa_digits += at - fraction;
  }
  if (mantissa_digits == 0) return false;
  if (at < text.size() && (text[at] == 'e' || text[at] == 'E')) {
    ++at;
    if (at < text.size() && (text[at] == '+' || text[at] == '-')) ++at;
    const size_t exponent = at;
    at = skip_digits(text, exponent);
    if (at == exponent) return false;
  }
  return at == text.size();
}

[[noreturn]] void refuse(std::string_view what, std::string_view text, const std::string& reason, ErrorKind kind) {
  const std::string message = std::string(what) + " " + quoted_input(text) + ": " + reason;
  if (kind == ErrorKind::kBadInput) throw BadInputError(message);  // callers catch it by type
  throw Error(message, kind);
}

}  // namespace

std::string quoted_input(std::string_view text) {
  std::string out = "'";
  for (size_t k = 0; k < text.size() && k < kQuotedBytes; ++k) {
    const auto c = static_cast<unsigned char>(text[k]);
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out += static_cast<char>(c);
    } else {
      char escaped[5];
      std::snprintf(escaped, sizeof escaped, "\\x%02x", c);
      out += escaped;
    }
  }
  if (text.size() > kQuotedBytes) out += "...";
  return out + "'";
}

std::optional<uint64_t> try_parse_decimal(std::string_view text, uint64_t max) {
  if (text.empty()) return std::nullopt;
  uint64_t value = 0;
  for (char c : text) {
    if (!is_digit(c)) return std::nullopt;
    const auto digit = static_cast<uint64_t>(c - '0');
    if (digit > max || value > (max - digit) / 10) return std::nullopt;  // value * 10 + digit > max
    value = value * 10 + digit;
  }
  return value;
}

uint64_t parse_decimal(std::string_view text, uint64_t max, std::string_view what, ErrorKind kind) {
  if (const auto value = try_parse_decimal(text, max)) return *value;
  if (text.empty() || skip_digits(text, 0) != text.size()) refuse(what, text, "not a decimal integer", kind);
  refuse(what, text, "out of range (max " + std::to_string(max) + ")", kind);
}

double parse_decimal_real(std::string_view text, std::string_view what, ErrorKind kind) {
  if (!is_real_text(text)) refuse(what, text, "not a decimal number", kind);
  double value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value, std::chars_format::general);
  if (ec == std::errc::result_out_of_range) refuse(what, text, "out of range of a double", kind);
  if (ec != std::errc{} || end != text.data() + text.size()) refuse(what, text, "not a decimal number", kind);
  return value;
}

uint64_t parse_hex64(std::string_view text, std::string_view what, ErrorKind kind) {
  uint64_t value = 0;
  bool ok = text.size() == 16;
  for (size_t k = 0; ok && k < text.size(); ++k) {
    const char c = text[k];
    const int digit = is_digit(c) ? c - '0' : (c >= 'a' && c <= 'f') ? c - 'a' + 10 : -1;
    ok = digit >= 0;
    value = value << 4 | static_cast<uint64_t>(digit & 15);
  }
  if (!ok) refuse(what, text, "not 16 lowercase hex digits", kind);
  return value;
}

}  // namespace deltasync
