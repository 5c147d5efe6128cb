// S3 response bodies (ListObjectsV2, multipart upload, <Error>) parsed by expat into a small
// element tree. Strict: a body that is not well-formed XML is an error naming the request, never
// a partial answer.
#pragma once
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace deltasync::s3xml {

struct Element {
  std::string name;  // as written (S3's default namespace is not expanded)
  std::string text;  // character data directly inside this element
  std::vector<Element> children;

  // The first child of that name, or null.
  const Element* child(std::string_view child_name) const;
  // The text of the first child of that name, or nullopt when there is none.
  std::optional<std::string> child_text(std::string_view child_name) const;
  std::vector<const Element*> all(std::string_view child_name) const;
};

// The document's root element. Throws Error("LABEL: malformed XML in the response: REASON at
// line N") for anything expat refuses (truncation, mismatched tags, bad entities, junk after the
// root, an empty body).
Element parse(std::string_view xml, const std::string& label);

// Escapes text for an element body (&, <, >, and CR as a character reference: a parser reads a
// literal CR as LF).
std::string escape(std::string_view text);

}  // namespace deltasync::s3xml
