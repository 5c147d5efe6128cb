// A record's fields listed once, as a tuple of (name, accessor, help) entries, so that everything
// built from a record -- CLI flags and usage, the Python binding's keywords, dicts and dataclasses
// -- walks the same list and a field added to the record and its table reaches all of them.
//
//   inline auto my_fields() { return std::make_tuple(fields::member("a", &My::a, "help"), ...); }
//   fields::for_each(my_fields(), [&](const auto& f) { use(f.name, f.get(record)); });
//
// `member` names a data member (read and write); `computed` reads a value through a function
// (a nested member, a flag turned into a value), for output records only.
#pragma once
#include <cstddef>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>

namespace deltasync::fields {

template <class Record, class T>
struct Member {
  using value_type = T;
  static constexpr bool writable = true;
  std::string_view name;
  T Record::*pointer;
  std::string_view help;
  const T& get(const Record& r) const { return r.*pointer; }
  T& get(Record& r) const { return r.*pointer; }
};

template <class Record, class Get>
struct Computed {
  using value_type = std::decay_t<std::invoke_result_t<Get, const Record&>>;
  static constexpr bool writable = false;
  std::string_view name;
  Get getter;
  std::string_view help;
  value_type get(const Record& r) const { return getter(r); }
};

template <class Record, class T>
constexpr Member<Record, T> member(std::string_view name, T Record::*pointer, std::string_view help = {}) {
  return {name, pointer, help};
}

template <class Record, class Get>
constexpr Computed<Record, Get> computed(std::string_view name, Get getter, std::string_view help = {}) {
  return {name, getter, help};
}

template <class Fields, class F>
constexpr void for_each(const Fields& fields, F&& f) {
  std::apply([&](const auto&... field) { (f(field), ...); }, fields);
}

// How many members an aggregate has (brace-initializable with that many values), so that a
// static_assert can tie a record to its table: a member added without a table entry fails to
// compile instead of silently missing from the CLI and Python.
namespace detail {
struct AnyValue {
  template <class T>
  operator T() const;  // never called: only used in unevaluated braced initializers
};
template <class T, class... A>
constexpr auto braces(int) -> decltype(T{std::declval<A>()...}, true) { return true; }
template <class T, class...>
constexpr bool braces(...) { return false; }
template <class T, class... A>
constexpr size_t count_members() {
  if constexpr (!braces<T, A..., AnyValue>(0)) return sizeof...(A);
  else return count_members<T, A..., AnyValue>();
}
}  // namespace detail

template <class T>
constexpr size_t member_count() { return detail::count_members<T>(); }

}  // namespace deltasync::fields
