"""A job kind's parameters, typed: each with its type, default, range or choices, and how it
appears in a job file. One schema serves the client (a job file's table, checked before
anything is uploaded, every problem naming the file and the field), the broker and the
provider (a signed spec's parameters, checked again). No grpc here."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
UINT32 = 2**32 - 1
UINT64 = 2**64 - 1

# A parameter's type: how a job file gives it, and what the spec holds.
#   int, float, bool, str  plain values (str may have choices)
#   strings                a list of strings
#   file                   a local file, uploaded as the input ``input_name``; the spec holds
#                          that name
#   file_or_dir            a file, or a directory sent as a tar (``input_name``)
TYPES = ("int", "float", "bool", "str", "strings", "file", "file_or_dir")
TYPE_WORDS = {"int": "an integer", "float": "a number", "bool": "true or false",
              "str": "a string", "strings": "a list of strings", "file": "a file path",
              "file_or_dir": "a path"}


class ParamError(Exception):
    """A parameter that cannot be run: ``field`` (like ``training.steps``) and what is wrong
    (like ``must be between 1 and 10,000,000``)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


@dataclass(frozen=True)
class Param:
    name: str                          # the spec's field (and the job file's, unless file_name)
    type: str                          # one of TYPES
    default: Any = None                # the value when not given (None: the type's zero)
    required: bool = False
    min: float | None = None           # numbers: inclusive bounds
    max: float | None = None
    above: float | None = None         # numbers: exclusive lower bound
    below: float | None = None         # numbers: exclusive upper bound
    choices: tuple[str, ...] = ()      # str: the values allowed ("" = not given)
    max_items: int = 0                 # strings: at most this many ...
    max_chars: int = 0                 # ... of 1 to this many characters
    input_name: str = ""               # file, file_or_dir: the input's name in the spec
    dir_needs: str = ""                # file_or_dir: a file a directory must hold
    suffix: str = ""                   # file: the ending a job file's path must have
    file_name: str = ""                # its name in a job file, if not ``name``
    from_file: Callable[[Any], Any] | None = None   # job file value -> spec value
    doc: str = ""

    @property
    def field_in_file(self) -> str:
        return self.file_name or self.name

    def zero(self) -> Any:
        if self.default is not None:
            return self.default
        return {"int": 0, "float": 0.0, "bool": False, "strings": []}.get(self.type, "")

    def accepts_type(self, value: Any) -> bool:
        """Whether a job file's value has this parameter's type (bool is not a number)."""
        if isinstance(value, bool):
            return self.type == "bool"
        return {"int": isinstance(value, int), "float": isinstance(value, (int, float)),
                "bool": False, "str": isinstance(value, str),
                "strings": isinstance(value, list) and all(isinstance(v, str) for v in value),
                "file": isinstance(value, str), "file_or_dir": isinstance(value, str),
                }[self.type]

    def check(self, value: Any, where: str) -> None:
        """Raise ParamError unless ``value`` (of the right type) is in range."""
        field = f"{where}.{self.name}"
        if self.type in ("int", "float"):
            lo = self.min if self.min is not None else (0 if self.type == "int" else None)
            hi = self.max if self.max is not None else (UINT64 if self.type == "int" else None)
            if self.above is not None and not value > self.above or \
                    self.below is not None and not value < self.below:
                raise ParamError(field, f"must be in ({_n(self.above)}, {_n(self.below)})")
            if lo is not None and value < lo or hi is not None and value > hi:
                raise ParamError(field, _range_words(lo, hi))
        elif self.type == "str" and self.choices and value not in self.choices:
            shown = sorted(c for c in self.choices if c)
            raise ParamError(field, f"must be one of {shown}")
        elif self.type == "strings" and self.max_items and (
                len(value) > self.max_items
                or any(not 0 < len(s) <= self.max_chars for s in value)):
            raise ParamError(field, f"at most {self.max_items} strings of 1 to"
                                    f" {self.max_chars} characters")


def _n(x: float | None) -> str:
    return "" if x is None else f"{x:g}"


def _range_words(lo: float | None, hi: float | None) -> str:
    if lo is not None and hi is not None:
        if hi >= UINT64:
            return f"must be at least {lo:,}"
        return f"must be between {lo:,} and {hi:,}"
    if lo is not None:
        return f"must be at least {lo:,}"
    return f"must be at most {hi:,}"


def check_values(params: tuple[Param, ...], values: dict[str, Any], where: str,
                 inputs: set[str]) -> None:
    """Raise ParamError for the first parameter that is missing, out of range, or names an
    input the spec does not carry."""
    for p in params:
        value = values.get(p.name, p.zero())
        if p.required and value in ("", None):
            raise ParamError(f"{where}.{p.name}", "required")
        if p.type in ("file", "file_or_dir"):
            if value and value not in inputs:
                raise ParamError(f"{where}.{p.name}", f"names no input ({value!r})")
            continue
        p.check(value, where)
