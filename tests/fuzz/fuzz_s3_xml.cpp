// Fuzzes the S3 response bodies we parse (host/store/s3_xml.cpp through expat): ListObjectsV2
// pages, multipart upload start and completion, and <Error> bodies, which describe_failure and
// error_code read out of any failed response. The harness walks the element tree the way
// store_s3.cpp reads each response (names, child texts, repeated children).
#include "core/error.hpp"
#include "fuzz_model.hpp"
#include "store/http_transport.hpp"
#include "store/s3_xml.hpp"

using namespace deltasync;

namespace {

size_t walk(const s3xml::Element& e, int depth) {
  size_t n = e.name.size() + e.text.size();
  if (depth > 64) return n;
  for (const auto& c : e.children) n += walk(c, depth + 1);
  return n;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  try {
    const s3xml::Element doc = s3xml::parse(body, "fuzz response");
    walk(doc, 0);
    for (const s3xml::Element* item : doc.all("Contents")) {
      (void)item->child_text("Key");
      (void)item->child_text("Size");
      (void)item->child_text("ETag");
    }
    for (const s3xml::Element* common : doc.all("CommonPrefixes")) (void)common->child_text("Prefix");
    (void)doc.child_text("IsTruncated");
    (void)doc.child_text("NextContinuationToken");
    (void)doc.child_text("UploadId");
    if (const s3xml::Element* code = doc.child("Code"); code && code->text != doc.child_text("Code"))
      fuzz::fail("child and child_text disagree");
    // What we write back into a request body must parse to the same text (a carriage return,
    // which XML reads as a line end, aside: no ETag or key we send holds one).
    if (doc.text.find('\r') == std::string::npos) {
      const std::string escaped = "<ETag>" + s3xml::escape(doc.text) + "</ETag>";
      if (s3xml::parse(escaped, "fuzz escape").text != doc.text) fuzz::fail("escaped text does not parse back");
    }
  } catch (const Error&) {
  }
  // Describing a failure never fails itself, whatever the body.
  http::Response r;
  r.status = 400 + static_cast<long>(size % 200);
  r.body.assign(data, data + size);
  (void)http::error_code(r);
  (void)http::describe_failure(r);
  return 0;
}
