"""The values Go's parsers accept, as llm-d's flags read them: exactly those, nothing more.

Python's ``int()`` takes what Go refuses — surrounding spaces (``--port= 8000``), any Unicode
decimal digit (``８０００``), underscores anywhere between digits — and refuses what Go takes
(``010``, octal in Go). So each parser here follows its Go counterpart (Go's ``src/strconv/atoi.go``
and ``src/time/format.go``; the rules are restated, no code is copied):

- ``go_int(text, base=0)``: ``strconv.ParseInt(s, 0, 64)``, what Go's ``flag`` and ``pflag``
  int flags call. One optional sign, then ASCII digits; a base prefix ``0x``/``0X`` (hex),
  ``0o``/``0O`` or a bare leading ``0`` (octal), ``0b``/``0B`` (binary); an underscore only
  between two digits or between the prefix and a digit; the value within int64.
- ``go_int(text, base=10)``: ``strconv.ParseInt(s, 10, bits)``, i.e. ``strconv.Atoi`` (64 bits:
  llm-d's ``--port`` and ``--model-server-port`` are string flags it checks with ``Atoi``) and
  klog's ``-v`` (32 bits). Sign and ASCII decimal digits only: no prefix, no underscore.
- ``GO_BOOL``: ``strconv.ParseBool``.
- ``go_duration``: ``time.ParseDuration``.

No llm-d flag is a float or an unsigned integer, so ``ParseFloat`` and ``ParseUint`` have no
counterpart here.
"""

from __future__ import annotations

from typing import Literal

GO_BOOL = {
    "1": True, "t": True, "T": True, "true": True, "TRUE": True, "True": True,
    "0": False, "f": False, "F": False, "false": False, "FALSE": False, "False": False,
}  # fmt: skip
"""strconv.ParseBool, which Go's flag packages use."""

_DECIMAL = "0123456789"
_DIGIT = {c: i for i, c in enumerate(_DECIMAL + "abcdefghijklmnopqrstuvwxyz")} | {
    c: i + 10 for i, c in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
}
"""The ASCII digits of bases up to 36, either case: no other character is a digit to Go."""
_PREFIXES = {"b": 2, "B": 2, "o": 8, "O": 8, "x": 16, "X": 16}


def go_int(text: str, *, base: Literal[0, 10] = 0, bits: int = 64) -> int | None:
    """What ``strconv.ParseInt(text, base, bits)`` returns, or None where it returns an error
    (a syntax error, or a value outside a signed ``bits``-bit integer)."""
    sign = text[:1]
    magnitude = _unsigned(text[1:] if sign in ("+", "-") else text, base)
    if magnitude is None:
        return None
    limit = 1 << (bits - 1)
    if magnitude > (limit if sign == "-" else limit - 1):
        return None
    return -magnitude if sign == "-" else magnitude


def _unsigned(text: str, base: Literal[0, 10]) -> int | None:
    if not text:
        return None
    radix, body = 10, text
    if base == 0 and text[0] == "0":
        # Go takes the prefix letter only with a digit (or underscore) after it: "0x" alone is
        # octal 0 followed by the digit "x", which base 8 refuses.
        if len(text) >= 3 and text[1] in _PREFIXES:
            radix, body = _PREFIXES[text[1]], text[2:]
        else:
            radix, body = 8, text[1:]
    value = 0
    for char in body:
        if char == "_" and base == 0:
            continue
        digit = _DIGIT.get(char)
        if digit is None or digit >= radix:
            return None
        value = value * radix + digit
    if "_" in body and not _underscores_fit(text):
        return None
    return value


def _underscores_fit(text: str) -> bool:
    """Go's rule for underscores in a number (base 0 only): each between two digits, or
    between a base prefix and a digit."""
    hexadecimal = False
    last = "start"  # the class of the character before: start, digit, underscore, other
    rest = text
    if len(text) >= 2 and text[0] == "0" and text[1] in _PREFIXES:
        hexadecimal = text[1] in "xX"
        last, rest = "digit", text[2:]  # a base prefix counts as a digit here
    for char in rest:
        if char in _DECIMAL or (hexadecimal and char in "abcdefABCDEF"):
            last = "digit"
        elif char == "_":
            if last != "digit":
                return False
            last = "underscore"
        elif last == "underscore":
            return False
        else:
            last = "other"
    return last != "underscore"


_NS_PER_UNIT = {
    "ns": 1,
    "us": 1_000,
    "µs": 1_000,  # U+00B5, the micro sign
    "μs": 1_000,  # U+03BC, the Greek letter mu
    "ms": 1_000_000,
    "s": 1_000_000_000,
    "m": 60_000_000_000,
    "h": 3_600_000_000_000,
}
_MAX_NS = 1 << 63
"""A Go duration is an int64 of nanoseconds: magnitudes above this overflow."""


def go_duration(text: str) -> float | None:
    """Seconds in a Go duration (``time.ParseDuration``: ``300ms``, ``1h2m``, ``-1.5s``,
    ``0``), or None where Go returns an error.

    One optional sign, then one or more parts, each a decimal number (ASCII digits, an optional
    fraction: ``1``, ``1.5``, ``1.``, ``.5``) and a unit (ns, us, µs, μs, ms, s, m, h); ``0``
    alone needs no unit. The total, in nanoseconds, must fit an int64."""
    negative = text[:1] == "-"
    rest = text[1:] if text[:1] in ("+", "-") else text
    if rest == "0":
        return 0.0
    if not rest:
        return None
    total = 0
    while rest:
        if rest[0] != "." and rest[0] not in _DECIMAL:
            return None
        whole, rest = _leading_digits(rest)
        fraction, scale, has_fraction = 0, 1.0, False
        if rest[:1] == ".":
            fraction, scale, after = _leading_fraction(rest[1:])
            has_fraction = len(after) < len(rest) - 1
            rest = after
        if not whole and not has_fraction:
            return None  # no digit on either side of the point: ".s"
        unit_end = next((i for i, c in enumerate(rest) if c == "." or c in _DECIMAL), len(rest))
        unit, rest = rest[:unit_end], rest[unit_end:]
        per_unit = _NS_PER_UNIT.get(unit)
        if per_unit is None:  # a missing unit, an unknown one, or a space or other character
            return None
        value = int(whole or "0")
        if value > _MAX_NS // per_unit:
            return None
        value *= per_unit
        if fraction:
            # As Go computes it, in float64, truncated: exact to the nanosecond for any unit.
            value += int(float(fraction) * (float(per_unit) / scale))
            if value > _MAX_NS:
                return None
        total += value
        if total > _MAX_NS:
            return None
    if not negative and total > _MAX_NS - 1:
        return None
    return (-total if negative else total) / 1e9


def _leading_digits(text: str) -> tuple[str, str]:
    """The ASCII digits ``text`` begins with, and what follows them."""
    end = next((i for i, c in enumerate(text) if c not in _DECIMAL), len(text))
    return text[:end], text[end:]


def _leading_fraction(text: str) -> tuple[int, float, str]:
    """The digits after a decimal point as Go reads them: the integer of those that fit an int64
    (later ones are read and dropped), the power of ten they are over, and what follows."""
    digits, rest = _leading_digits(text)
    fraction, scale = 0, 1.0
    for char in digits:
        following = fraction * 10 + int(char)
        if following > _MAX_NS:
            break
        fraction, scale = following, scale * 10
    return fraction, scale, rest
