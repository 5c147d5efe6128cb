// The one number parser (core/parse_number.hpp): exactly the decimal digits are accepted, in
// range of the target type, and every refusal is one line of the documented shape. The inputs
// are the ones the parsers it replaced got wrong: std::stoull read " 7" and "+7" as 7 and "-1"
// as 2^64-1, and two hand-written parsers capped the length at 19 or 20 digits.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>

#include "core/error.hpp"
#include "core/parse_number.hpp"
#include "engine/host_model.hpp"
#include "format/safetensors.hpp"
#include "store/store.hpp"
#include "sync/protocol.hpp"
#include "test_support.hpp"

namespace deltasync {
namespace {

constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();

// The message parse_decimal<T> throws for `text`, and its kind.
template <class T>
std::pair<std::string, ErrorKind> decimal_refusal(const std::string& text, ErrorKind kind = ErrorKind::kBadInput) {
  try {
    parse_decimal<T>(text, "f.safetensors: metadata model_version", kind);
  } catch (const Error& e) {
    return {e.what(), e.kind()};
  }
  ADD_FAILURE() << "'" << text << "' was accepted";
  return {};
}

std::string not_decimal(const std::string& quoted) {
  return "f.safetensors: metadata model_version " + quoted + ": not a decimal integer";
}

TEST(ParseDecimal, AcceptsDigitsOnly) {
  EXPECT_EQ(parse_decimal<uint64_t>("0", "x"), 0u);
  EXPECT_EQ(parse_decimal<uint64_t>("7", "x"), 7u);
  EXPECT_EQ(parse_decimal<uint64_t>("1234567890", "x"), 1234567890u);
}

TEST(ParseDecimal, RefusesSignsSpacesAndTrailingText) {
  for (const char* text : {" 7", "7 ", "+7", "-1", "-0", "", "7x", "0x10", "1e3", "7.0", "1_000", "7\n", "\t7"})
    EXPECT_EQ(decimal_refusal<uint64_t>(text).first, not_decimal(quoted_input(text))) << "input '" << text << "'";
  EXPECT_EQ(decimal_refusal<uint64_t>("+7").first, not_decimal("'+7'"));
  EXPECT_EQ(decimal_refusal<uint64_t>("").first, not_decimal("''"));
}

TEST(ParseDecimal, RefusesDigitsOfOtherScripts) {
  // Arabic-Indic three (U+0663) and fullwidth seven (U+FF17): std::isdigit in some locales and
  // Python's str.isdigit say yes; the rule says ASCII only. The message shows the bytes.
  EXPECT_EQ(decimal_refusal<uint64_t>("\xd9\xa3").first, not_decimal("'\\xd9\\xa3'"));
  EXPECT_EQ(decimal_refusal<uint64_t>("1\xef\xbc\x97").first, not_decimal("'1\\xef\\xbc\\x97'"));
}

TEST(ParseDecimal, RangeIsTheTargetType) {
  EXPECT_EQ(parse_decimal<uint64_t>("18446744073709551615", "x"), kMax);  // 20 digits, exactly max
  EXPECT_EQ(decimal_refusal<uint64_t>("18446744073709551616").first,
            "f.safetensors: metadata model_version '18446744073709551616': out of range (max 18446744073709551615)");
  EXPECT_EQ(decimal_refusal<uint64_t>("99999999999999999999").first,  // 20 digits above max
            "f.safetensors: metadata model_version '99999999999999999999': out of range (max 18446744073709551615)");
  EXPECT_EQ(decimal_refusal<uint64_t>("184467440737095516150").first,  // 21 digits
            "f.safetensors: metadata model_version '184467440737095516150': out of range (max 18446744073709551615)");
  // A 19-digit cap (the old checkpoint reader) refused valid versions from 10^19 up.
  EXPECT_EQ(parse_decimal<uint64_t>("10000000000000000000", "x"), 10000000000000000000u);

  EXPECT_EQ(parse_decimal<uint32_t>("4294967295", "x"), 4294967295u);
  EXPECT_EQ(decimal_refusal<uint32_t>("4294967296").first,
            "f.safetensors: metadata model_version '4294967296': out of range (max 4294967295)");
  EXPECT_EQ(parse_decimal<uint8_t>("255", "x"), 255u);
  EXPECT_EQ(decimal_refusal<uint8_t>("256").first, "f.safetensors: metadata model_version '256': out of range (max 255)");
  // A signed target takes its non-negative range: no sign is ever read.
  EXPECT_EQ(parse_decimal<int>("2147483647", "x"), 2147483647);
  EXPECT_EQ(decimal_refusal<int>("2147483648").first,
            "f.safetensors: metadata model_version '2147483648': out of range (max 2147483647)");
  EXPECT_EQ(decimal_refusal<int>("-1").first, not_decimal("'-1'"));
}

TEST(ParseDecimal, CallersMaximum) {
  EXPECT_EQ(parse_decimal("62", 62, "axis Elements exponent of 2"), 62u);
  try {
    parse_decimal("63", 62, "axis Elements exponent of 2");
    FAIL() << "63 was accepted";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "axis Elements exponent of 2 '63': out of range (max 62)");
  }
  // A maximum below one digit's value (the guard against max - digit wrapping).
  EXPECT_EQ(try_parse_decimal("5", 5), 5u);
  EXPECT_EQ(try_parse_decimal("7", 5), std::nullopt);
  EXPECT_EQ(try_parse_decimal("0", 0), 0u);
  EXPECT_EQ(try_parse_decimal("1", 0), std::nullopt);
}

TEST(ParseDecimal, LeadingZerosChangeNothing) {
  // Documented choice: the store's keys are zero-padded to 20 digits, and decimal text has no
  // octal reading, so "007" is 7 and a padded maximum still fits.
  EXPECT_EQ(parse_decimal<uint64_t>("007", "x"), 7u);
  EXPECT_EQ(parse_decimal<uint64_t>("00000000000000000007", "x"), 7u);
  EXPECT_EQ(parse_decimal<uint64_t>("00", "x"), 0u);
  EXPECT_EQ(parse_decimal<uint64_t>("000018446744073709551615", "x"), kMax);
  EXPECT_EQ(parse_decimal<uint8_t>("0000255", "x"), 255u);
}

TEST(ParseDecimal, TryFormSaysNothingAndTakesTheSameRule) {
  EXPECT_EQ(try_parse_decimal("42"), 42u);
  for (const char* text : {"", " 7", "+7", "-1", "7x", "18446744073709551616"})
    EXPECT_EQ(try_parse_decimal(text), std::nullopt) << "input '" << text << "'";
}

TEST(ParseDecimal, KindIsTheCallersBadInputIsItsOwnType) {
  EXPECT_EQ(decimal_refusal<uint64_t>("x", ErrorKind::kInvalidArgument).second, ErrorKind::kInvalidArgument);
  EXPECT_THROW(parse_decimal<uint64_t>("x", "f"), BadInputError);  // callers catch file errors by type
}

TEST(ParseDecimal, MessageStaysOneLineAndShort) {
  const std::string long_text = "1" + std::string(100, 'x') + "\n";
  const std::string message = decimal_refusal<uint64_t>(long_text).first;
  EXPECT_EQ(message, not_decimal("'1" + std::string(39, 'x') + "...'"));
  EXPECT_EQ(message.find('\n'), std::string::npos);
  EXPECT_EQ(quoted_input("a\nb\\c\x7f"), "'a\\x0ab\\x5cc\\x7f'");
}

double real_or_refusal(const std::string& text, std::string* message) {
  try {
    return parse_decimal_real(text, "option --anchor-share", ErrorKind::kInvalidArgument);
  } catch (const Error& e) {
    *message = e.what();
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    return -1;
  }
}

TEST(ParseDecimalReal, AcceptsDecimalAndExponentForms) {
  std::string message;
  EXPECT_EQ(real_or_refusal("0.5", &message), 0.5);
  EXPECT_EQ(real_or_refusal("2", &message), 2.0);
  EXPECT_EQ(real_or_refusal(".25", &message), 0.25);
  EXPECT_EQ(real_or_refusal("3.", &message), 3.0);
  EXPECT_EQ(real_or_refusal("1e-6", &message), 1e-6);
  EXPECT_EQ(real_or_refusal("1E+3", &message), 1000.0);
  EXPECT_EQ(real_or_refusal("1e-05", &message), 1e-5);  // how to_chars and Python write small values
  EXPECT_TRUE(message.empty()) << message;
}

TEST(ParseDecimalReal, RefusesSignsSpacesWordsAndHex) {
  for (const char* text : {"", " 0.5", "0.5 ", "+0.5", "-0.5", "-0", ".", "e5", "1e", "1e+", "1.5x", "inf", "nan",
                           "infinity", "0x1p3", "1,5", "5%"}) {
    std::string message;
    real_or_refusal(text, &message);
    EXPECT_EQ(message, "option --anchor-share " + quoted_input(text) + ": not a decimal number") << "input '" << text << "'";
  }
}

TEST(ParseDecimalReal, RefusesWhatADoubleCannotHold) {
  std::string message;
  real_or_refusal("1e999", &message);
  EXPECT_EQ(message, "option --anchor-share '1e999': out of range of a double");
}

TEST(ParseHex64, SixteenLowercaseDigitsExactly) {
  EXPECT_EQ(parse_hex64("0123456789abcdef", "x"), 0x0123456789abcdefull);
  EXPECT_EQ(parse_hex64("ffffffffffffffff", "x"), kMax);
  for (const char* text : {"", "0123456789ABCDEF", "0123456789abcde", "0123456789abcdef0", " 123456789abcdef",
                           "+123456789abcdef", "0x23456789abcdef", "g123456789abcdef"}) {
    try {
      parse_hex64(text, "d.st: digest");
      ADD_FAILURE() << "'" << text << "' was accepted";
    } catch (const BadInputError& e) {
      EXPECT_EQ(std::string(e.what()), "d.st: digest " + quoted_input(text) + ": not 16 lowercase hex digits");
    }
  }
}

// ---- call sites without a test file of their own (delta files, compact deltas and checkpoint
// folders are tested beside their readers) ------------------------------------------------------

// HostModel used std::stoull: " 7" and "+7" loaded as version 7, "-1" as 2^64-1.
TEST(NumberCallSites, HostModelVersion) {
  TempDir dir;
  const std::string path = dir.file("m.safetensors");
  const std::vector<uint8_t> bytes(4, 0);
  auto load = [&](const std::string& version) -> std::string {
    st::write_file(path, std::vector<st::WriteTensor>{{"w", DType::BF16, {2}, bytes}}, {{"model_version", version}});
    try {
      EXPECT_EQ(HostModel::load(path).version, std::optional<uint64_t>(7));
      return "";
    } catch (const BadInputError& e) {
      return e.what();
    }
  };
  EXPECT_EQ(load("7"), "");
  EXPECT_EQ(load("007"), "");
  EXPECT_EQ(load(" 7"), path + ": metadata model_version ' 7': not a decimal integer");
  EXPECT_EQ(load("+7"), path + ": metadata model_version '+7': not a decimal integer");
  EXPECT_EQ(load("-1"), path + ": metadata model_version '-1': not a decimal integer");
}

// LATEST was trimmed of any trailing spaces and CRs; now one line end, no more.
TEST(NumberCallSites, LatestPointerAndObjectKeys) {
  EXPECT_EQ(protocol::parse_latest("7\n", "b/LATEST"), 7u);
  EXPECT_EQ(protocol::parse_latest("7\r\n", "b/LATEST"), 7u);
  EXPECT_EQ(protocol::parse_latest("7", "b/LATEST"), 7u);
  for (const char* text : {"+7\n", " 7\n", "7 \n", "7\n\n", "-1\n", "\n"}) {
    std::string_view body(text);
    body.remove_suffix(body.ends_with('\n') ? 1 : 0);
    EXPECT_EQ(error_message([&] { protocol::parse_latest(text, "b/LATEST"); }),
              "b/LATEST: LATEST pointer " + quoted_input(body) + ": not a decimal integer");
  }
  // A key whose 20 version characters are not all digits is not one of the store's.
  EXPECT_EQ(protocol::version_of_manifest_key(protocol::manifest_key(7)), 7u);
  EXPECT_EQ(protocol::version_of_manifest_key("manifests/+0000000000000000007.json"), std::nullopt);
  EXPECT_EQ(protocol::version_of_manifest_key("manifests/ 0000000000000000007.json"), std::nullopt);
  EXPECT_EQ(protocol::version_of_manifest_key("manifests/99999999999999999999.json"), std::nullopt);
}

// The store's environment knobs, each range-checked against its option's type (the old reader
// cast a 64-bit value down to int).
TEST(NumberCallSites, StoreEnvironment) {
  TempDir dir;
  auto open_with = [&](const char* name, const char* value) {
    setenv(name, value, 1);
    std::string message;
    try {
      open_store("file://" + dir.path().string());
    } catch (const Error& e) {
      message = e.what();
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    }
    unsetenv(name);
    return message;
  };
  EXPECT_EQ(open_with("DELTASYNC_STORE_PARALLELISM", "4"), "");
  EXPECT_EQ(open_with("DELTASYNC_STORE_PARALLELISM", "+4"), "DELTASYNC_STORE_PARALLELISM '+4': not a decimal integer");
  EXPECT_EQ(open_with("DELTASYNC_STORE_RETRIES", " 3"), "DELTASYNC_STORE_RETRIES ' 3': not a decimal integer");
  EXPECT_EQ(open_with("DELTASYNC_STORE_RETRIES", "2147483648"), "DELTASYNC_STORE_RETRIES '2147483648': out of range (max 2147483647)");
  EXPECT_EQ(open_with("DELTASYNC_STORE_PART_SIZE", "-1"), "DELTASYNC_STORE_PART_SIZE '-1': not a decimal integer");
}

}  // namespace
}  // namespace deltasync
