"""Python records made from the C++ ones at import: the native library lists each record's fields
(name, type, default, help) from its one field table (core/fields.hpp; publisher_option_fields,
version_stats_fields, sync_report_fields), and the dataclasses and keyword lists here are built
from those rows, so a field added in C++ reaches Python without an edit here."""
from __future__ import annotations

import inspect
from dataclasses import field, make_dataclass

from ._library import native


def record_class(name: str, rows, doc: str, extra: tuple = (), namespace: dict | None = None, module: str = __name__):
    """A dataclass with one field per row (in order), then `extra` (dataclass field specs)."""
    specs = []
    for field_name, type_name, default, help_text in rows:
        if isinstance(default, list):
            spec = field(default_factory=list, metadata={"help": help_text})
        else:
            spec = field(default=default, metadata={"help": help_text})
        specs.append((field_name, type_name, spec))
    cls = make_dataclass(name, specs + list(extra), namespace=namespace or {})
    cls.__doc__ = doc + "".join(f"\n    {n}: {h}" for n, _, _, h in rows if h)
    cls.__module__ = module
    return cls


def publisher_option_rows():
    return native().publisher_option_fields()


def keyword_parameters(rows) -> list[inspect.Parameter]:
    """Keyword-only parameters (default None: the C++ default) for options rows."""
    return [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=f"{type_name} | None")
            for name, type_name, _, _ in rows]


def version_stats_rows():
    return native().version_stats_fields()


def update_report_rows():
    return native().update_report_fields()
