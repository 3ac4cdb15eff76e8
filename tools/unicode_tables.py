"""Write gateway/unicode_tables.py from the files of the Unicode Character Database.

Run: ``python tools/unicode_tables.py UCD_DIR > gateway/unicode_tables.py``, where UCD_DIR holds the
unpacked UCD.zip of the Unicode version of the oldest Python the gateway supports (14.0.0 for Python
3.11): ArabicShaping.txt, Scripts.txt, UnicodeData.txt, StandardizedVariants.txt and emoji/. A table
of another version than Python's own unicodedata would judge a character by two different Unicodes.

Only the standard library is used, and nothing of the gateway's: the tables are facts about
characters, checked here against the files they come from before they are written.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path

# The project's line length (pyproject.toml): the tables are packed to it to stay short.
_LINE_LENGTH = 110


def _fields(path: Path) -> Iterator[list[str]]:
    """Yield the fields of each line of a UCD file that holds data, comments dropped."""
    for line in path.read_text(encoding="utf-8").splitlines():
        data = line.split("#", 1)[0].strip()
        if data:
            yield [field.strip() for field in data.split(";")]


def _span(text: str) -> range:
    first, _, last = text.partition("..")
    return range(int(first, 16), int(last or first, 16) + 1)


def _ranges(codes: Iterable[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for code in sorted(set(codes)):
        if out and out[-1][1] + 1 == code:
            out[-1] = (out[-1][0], code)
        else:
            out.append((code, code))
    return out


def _rows(items: list[str], indent: str = "    ") -> str:
    """Lay the items out as rows of a tuple, as many on a line as fit."""
    lines = [indent]
    for item in items:
        if len(lines[-1]) + len(item) + 2 > _LINE_LENGTH:
            lines.append(indent)
        lines[-1] += ("" if lines[-1] == indent else " ") + item + ","
    return "\n".join(lines)


def _hex(code: int) -> str:
    return f"0x{code:04X}"


def _version(ucd: Path) -> str:
    for line in (ucd / "ReadMe.txt").read_text(encoding="utf-8").splitlines():
        if "Version" in line and "of the Unicode Standard" in line:
            return line.split("Version", 1)[1].split()[0]
    raise SystemExit("ReadMe.txt does not say which Unicode version this is")


def joining_types(ucd: Path) -> list[tuple[int, int, str]]:
    """Every code point ArabicShaping.txt lists, as ranges of one joining type."""
    by_type: dict[str, list[int]] = defaultdict(list)
    for code, _name, kind, *_ in _fields(ucd / "ArabicShaping.txt"):
        by_type[kind].append(int(code, 16))
    return sorted((first, last, kind) for kind, codes in by_type.items() for first, last in _ranges(codes))


def virama_scripts(ucd: Path) -> list[tuple[int, int, str]]:
    """The letters and marks of each script that has a virama (combining class 9), as ranges that
    bridge code points holding no letter or mark of any other script."""
    script: dict[int, str] = {}
    for span, name in _fields(ucd / "Scripts.txt"):
        for code in _span(span):
            script[code] = name
    category: dict[int, str] = {}
    with_virama: set[str] = set()
    for fields in _fields(ucd / "UnicodeData.txt"):
        code = int(fields[0], 16)
        category[code] = fields[2]
        if fields[3] == "9":
            with_virama.add(script[code])
    letters = sorted(code for code, cat in category.items() if cat[0] in "LM" and code in script)
    out: list[tuple[int, int, str]] = []
    for code in letters:
        name = script[code]
        if out and out[-1][2] == name:
            out[-1] = (out[-1][0], code, name)
        else:
            out.append((code, code, name))
    return [span for span in out if span[2] in with_virama]


def extended_pictographic(ucd: Path) -> list[tuple[int, int]]:
    codes = [
        code
        for span, prop in _fields(ucd / "emoji" / "emoji-data.txt")
        if prop == "Extended_Pictographic"
        for code in _span(span)
    ]
    return _ranges(codes)


def emoji_variation_bases(ucd: Path) -> list[tuple[int, int]]:
    bases = set()
    for sequence, *_ in _fields(ucd / "emoji" / "emoji-variation-sequences.txt"):
        base, selector = (int(code, 16) for code in sequence.split())
        assert selector in (0xFE0E, 0xFE0F), sequence
        bases.add(base)
    return _ranges(bases)


def standardized_variants(ucd: Path) -> list[tuple[int, int]]:
    """Every (base, selector) that StandardizedVariants.txt lists, but those of the CJK compatibility
    ideographs, which gateway.legible derives from the decompositions (checked equal here)."""
    decomposes_to: dict[int, list[int]] = defaultdict(list)
    for fields in _fields(ucd / "UnicodeData.txt"):
        if fields[1].startswith("CJK COMPATIBILITY IDEOGRAPH-") and fields[5]:
            decomposes_to[int(fields[5], 16)].append(int(fields[0], 16))
    derived = {(base, 0xFE00 + n) for base, compats in decomposes_to.items() for n in range(len(compats))}
    listed, compat = set(), set()
    for sequence, description, *_ in _fields(ucd / "StandardizedVariants.txt"):
        base, selector = (int(code, 16) for code in sequence.split())
        (compat if description.startswith("CJK COMPATIBILITY IDEOGRAPH-") else listed).add((base, selector))
    if compat != derived:
        raise SystemExit("the CJK compatibility variants no longer follow from the decompositions")
    return sorted(listed)


def render(ucd: Path) -> str:
    version = _version(ucd)
    joining = [f'({_hex(a)}, {_hex(b)}, "{kind}")' for a, b, kind in joining_types(ucd)]
    scripts = [f'({_hex(a)}, {_hex(b)}, "{name}")' for a, b, name in virama_scripts(ucd)]
    pictographic = [f"({_hex(a)}, {_hex(b)})" for a, b in extended_pictographic(ucd)]
    emoji_bases = [f"({_hex(a)}, {_hex(b)})" for a, b in emoji_variation_bases(ucd)]
    variants = [f"({_hex(base)}, {_hex(selector)})" for base, selector in standardized_variants(ucd)]
    return f'''"""Facts about characters that Python's unicodedata does not carry, from Unicode {version}.

Written by tools/unicode_tables.py from the Unicode Character Database {version}, the version of
Python 3.11's unicodedata: run it again rather than edit this file. Ranges are first and last code
point, in order. Used by gateway.legible to tell where a joiner or a variation selector changes what
a screen shows, and where it would only make two names look alike.
"""

# fmt: off
# Joining_Type (ArabicShaping.txt) of the scripts that join their letters (Arabic, Syriac, N'Ko,
# Mongolian...): D joins on both sides, R only to the letter before it (an alef), L only to the letter
# after it, C makes its neighbours join (a tatweel, the zero-width joiner), T is passed over (a vowel
# mark), U joins nothing. A code point not listed is T if it is a mark (Mn, Me) or a format character
# (Cf), else U.
JOINING_TYPES: tuple[tuple[int, int, str], ...] = (
{_rows(joining)}
)

# The letters and marks of each script that has a virama (Scripts.txt; canonical combining class 9 in
# UnicodeData.txt): Devanagari, Bengali, Tamil, Sinhala, Khmer, Myanmar... Each range bridges code
# points that hold no letter or mark of another script.
VIRAMA_SCRIPTS: tuple[tuple[int, int, str], ...] = (
{_rows(scripts)}
)

# Extended_Pictographic (emoji-data.txt): the emoji and the pictographs that emoji sequences join.
EXTENDED_PICTOGRAPHIC: tuple[tuple[int, int], ...] = (
{_rows(pictographic)}
)

# The characters that have a text and an emoji style, chosen by U+FE0E or U+FE0F
# (emoji-variation-sequences.txt).
EMOJI_VARIATION_BASES: tuple[tuple[int, int], ...] = (
{_rows(emoji_bases)}
)

# (base, selector) of each standardized variant (StandardizedVariants.txt) but those of the CJK
# compatibility ideographs: each base followed by U+FE00 (then U+FE01, U+FE02) stands for the n-th
# compatibility ideograph that decomposes to it, which gateway.legible reads from unicodedata.
STANDARDIZED_VARIANTS: tuple[tuple[int, int], ...] = (
{_rows(variants)}
)
# fmt: on
'''


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ucd", type=Path, help="the unpacked UCD.zip of one Unicode version")
    args = parser.parse_args(argv)
    sys.stdout.write(render(args.ucd))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
