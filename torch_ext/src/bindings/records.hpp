// C++ records (options and reports) for Python through their field tables (core/fields.hpp):
// a record becomes a dict, its table becomes the (name, type, default, help) rows from which
// deltasync/_records.py makes the Python dataclasses at import, and a dict of keywords sets an
// options record. Nothing here names a field: a field added to a table reaches Python as is.
#pragma once
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "core/error.hpp"
#include "core/fields.hpp"

namespace deltasync::torch_ext {

template <class T>
struct PythonType {
  static std::string name() {
    if constexpr (std::is_same_v<T, bool>) return "bool";
    else if constexpr (std::is_integral_v<T>) return "int";
    else if constexpr (std::is_floating_point_v<T>) return "float";
    else if constexpr (std::is_same_v<T, std::string>) return "str";
    else static_assert(sizeof(T) == 0, "a record field of a type Python has no name for here");
  }
};
template <class T>
struct PythonType<std::optional<T>> {
  static std::string name() { return PythonType<T>::name() + " | None"; }
};
template <class T>
struct PythonType<std::vector<T>> {
  static std::string name() { return "list[" + PythonType<T>::name() + "]"; }
};

// {name: value} of every field of the table (optionals: None when empty).
template <class Record, class Fields>
pybind11::dict record_dict(const Record& record, const Fields& table) {
  pybind11::dict d;
  fields::for_each(table, [&](const auto& f) { d[pybind11::str(std::string(f.name))] = pybind11::cast(f.get(record)); });
  return d;
}

// [(name, Python type, default, help)] in table order; the defaults are a default-constructed
// record's (the one set of defaults).
template <class Record, class Fields>
pybind11::list describe_fields(const Fields& table) {
  const Record defaults{};
  pybind11::list rows;
  fields::for_each(table, [&](const auto& f) {
    using T = typename std::decay_t<decltype(f)>::value_type;
    rows.append(pybind11::make_tuple(std::string(f.name), PythonType<T>::name(), pybind11::cast(f.get(defaults)),
                                     std::string(f.help)));
  });
  return rows;
}

// Sets the fields named in `given` (None: keep the default); returns the keys no field has.
template <class Record, class Fields>
std::vector<std::string> set_fields(Record& record, const Fields& table, const pybind11::dict& given, const char* what) {
  std::vector<std::string> unknown;
  for (auto [key, value] : given) {
    const std::string k = pybind11::cast<std::string>(key);
    bool found = false;
    fields::for_each(table, [&](const auto& f) {
      using Field = std::decay_t<decltype(f)>;
      if constexpr (Field::writable) {
        if (f.name != k) return;
        found = true;
        if (value.is_none()) return;
        try {
          f.get(record) = pybind11::cast<typename Field::value_type>(value);
        } catch (const pybind11::cast_error&) {
          throw Error(std::string(what) + ": option " + k + " expects " + PythonType<typename Field::value_type>::name() +
                          " in range, got " + pybind11::cast<std::string>(pybind11::repr(value)),
                      ErrorKind::kInvalidArgument);
        }
      }
    });
    if (!found) unknown.push_back(k);
  }
  return unknown;
}

}  // namespace deltasync::torch_ext
