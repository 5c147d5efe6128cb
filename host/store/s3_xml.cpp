#include "store/s3_xml.hpp"

#include <expat.h>

#include <memory>

#include "core/error.hpp"

namespace deltasync::s3xml {
namespace {

// S3 answers nest three or four elements deep. A deeper body is refused: the tree (and its
// destructor) recurses per level, so a hostile endpoint could otherwise overflow the stack.
constexpr size_t kMaxDepth = 64;

struct Builder {
  Element root;
  std::vector<Element*> open;  // path from the root to the element being filled
  bool have_root = false;
  bool too_deep = false;
  XML_Parser parser = nullptr;
};

void on_start(void* user, const XML_Char* name, const XML_Char**) {
  auto* b = static_cast<Builder*>(user);
  if (b->open.size() >= kMaxDepth) {
    b->too_deep = true;
    XML_StopParser(b->parser, XML_FALSE);
    return;
  }
  if (b->open.empty()) {
    b->root.name = name;
    b->have_root = true;
    b->open.push_back(&b->root);
    return;
  }
  Element& parent = *b->open.back();
  parent.children.push_back(Element{name, {}, {}});
  b->open.push_back(&parent.children.back());  // stable until parent gets another child, i.e. after this one closes
}

void on_end(void* user, const XML_Char*) {
  auto* b = static_cast<Builder*>(user);
  if (!b->too_deep) b->open.pop_back();
}

void on_text(void* user, const XML_Char* text, int length) {
  auto* b = static_cast<Builder*>(user);
  if (!b->open.empty()) b->open.back()->text.append(text, static_cast<size_t>(length));
}

struct ParserFree {
  void operator()(XML_Parser p) const { XML_ParserFree(p); }
};

}  // namespace

const Element* Element::child(std::string_view child_name) const {
  for (const Element& c : children)
    if (c.name == child_name) return &c;
  return nullptr;
}

std::optional<std::string> Element::child_text(std::string_view child_name) const {
  const Element* c = child(child_name);
  if (!c) return std::nullopt;
  return c->text;
}

std::vector<const Element*> Element::all(std::string_view child_name) const {
  std::vector<const Element*> out;
  for (const Element& c : children)
    if (c.name == child_name) out.push_back(&c);
  return out;
}

Element parse(std::string_view xml, const std::string& label) {
  std::unique_ptr<XML_ParserStruct, ParserFree> parser(XML_ParserCreate("UTF-8"));
  if (!parser) throw Error(label + ": cannot create an XML parser (out of memory)");
  Builder builder;
  builder.parser = parser.get();
  XML_SetUserData(parser.get(), &builder);
  XML_SetElementHandler(parser.get(), &on_start, &on_end);
  XML_SetCharacterDataHandler(parser.get(), &on_text);
  if (xml.size() > static_cast<size_t>(INT32_MAX)) throw Error(label + ": XML response too large");
  const XML_Status status = XML_Parse(parser.get(), xml.data(), static_cast<int>(xml.size()), XML_TRUE);
  if (builder.too_deep)
    throw Error(label + ": malformed XML in the response: elements nested deeper than " + std::to_string(kMaxDepth));
  if (status != XML_STATUS_OK) {
    throw Error(label + ": malformed XML in the response: " + XML_ErrorString(XML_GetErrorCode(parser.get())) +
                " at line " + std::to_string(XML_GetCurrentLineNumber(parser.get())));
  }
  if (!builder.have_root) throw Error(label + ": malformed XML in the response: no root element");
  return std::move(builder.root);
}

std::string escape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    if (c == '&') out += "&amp;";
    else if (c == '<') out += "&lt;";
    else if (c == '>') out += "&gt;";
    else if (c == '\r') out += "&#13;";  // a literal CR would reach the server as LF (XML end-of-line handling)
    else out += c;
  }
  return out;
}

}  // namespace deltasync::s3xml
