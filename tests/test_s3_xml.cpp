// S3 response XML through expat: the elements the store reads, entities and CDATA decoded, and
// anything that is not well-formed refused with the request named.
#include <gtest/gtest.h>

#include "core/error.hpp"
#include "store/s3_xml.hpp"
#include "test_support.hpp"

namespace {

using deltasync::s3xml::parse;

TEST(S3Xml, ListBucketResultWithEntitiesAndNamespace) {
  const auto doc = parse(
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      "<ListBucketResult xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\"><IsTruncated>true</IsTruncated>"
      "<Contents><Key>run/a&amp;b &#x263A;.json</Key><Size>12</Size><ETag>&quot;e1&quot;</ETag></Contents>"
      "<Contents><Key><![CDATA[run/<raw>]]></Key><Size>0</Size></Contents>"
      "<CommonPrefixes><Prefix>run/anchors/</Prefix></CommonPrefixes>"
      "<NextContinuationToken>1+/x==</NextContinuationToken></ListBucketResult>",
      "LIST");
  EXPECT_EQ(doc.name, "ListBucketResult");
  EXPECT_EQ(doc.child_text("IsTruncated"), "true");
  const auto contents = doc.all("Contents");
  ASSERT_EQ(contents.size(), 2u);
  EXPECT_EQ(contents[0]->child_text("Key"), "run/a&b \xE2\x98\xBA.json");
  EXPECT_EQ(contents[0]->child_text("ETag"), "\"e1\"");
  EXPECT_EQ(contents[1]->child_text("Key"), "run/<raw>");
  EXPECT_EQ(contents[1]->child_text("ETag"), std::nullopt);
  EXPECT_EQ(doc.child("CommonPrefixes")->child_text("Prefix"), "run/anchors/");
  EXPECT_EQ(doc.child_text("NextContinuationToken"), "1+/x==");
}

TEST(S3Xml, MalformedDocumentsAreErrorsNamingTheRequest) {
  for (const char* bad : {"", "<a><b></a>", "<a>&bogus;</a>", "<a></a><b></b>", "<ListBucketResult><Contents>",
                          "not xml at all", "<a>\x01</a>"}) {
    const std::string message = error_message([&] { parse(bad, "s3://b/run/manifests/* (LIST)"); });
    EXPECT_EQ(message.rfind("s3://b/run/manifests/* (LIST): malformed XML in the response: ", 0), 0u) << bad << " -> " << message;
  }
}

TEST(S3Xml, DeeplyNestedBodyIsRefusedNotRecursedInto) {
  // A hostile endpoint's 200,000-deep body overflowed the stack building (and freeing) the tree.
  std::string deep;
  for (int i = 0; i < 200000; ++i) deep += "<a>";
  for (int i = 0; i < 200000; ++i) deep += "</a>";
  EXPECT_EQ(error_message([&] { parse(deep, "s3://b/k (LIST)"); }),
            "s3://b/k (LIST): malformed XML in the response: elements nested deeper than 64");
  std::string ok;  // 64 levels are fine
  for (int i = 0; i < 64; ++i) ok += "<a>";
  for (int i = 0; i < 64; ++i) ok += "</a>";
  EXPECT_EQ(parse(ok, "x").name, "a");
}

TEST(S3Xml, EscapeForElementText) {
  EXPECT_EQ(deltasync::s3xml::escape("\"etag\"&<x>"), "\"etag\"&amp;&lt;x&gt;");
  EXPECT_EQ(parse("<E>" + deltasync::s3xml::escape("a<&>b") + "</E>", "x").text, "a<&>b");
}

TEST(S3Xml, EscapeKeepsCarriageReturns) {
  // An XML parser reads a literal CR (alone or before LF) as LF; a character reference survives.
  EXPECT_EQ(deltasync::s3xml::escape("a\r\nb\rc"), "a&#13;\nb&#13;c");
  EXPECT_EQ(parse("<E>" + deltasync::s3xml::escape("a\r\nb\rc") + "</E>", "x").text, "a\r\nb\rc");
  EXPECT_EQ(parse("<E>a\r\nb\rc</E>", "x").text, "a\nb\nc");  // what the unescaped text would become
}

}  // namespace
