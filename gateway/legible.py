"""Text a person reads: which names and labels the audit keeps, and how a terminal is shown any text.

One rule, in one place, for two uses. :func:`flaw` says why an operator's name or an agent's run or
step label cannot be kept; :func:`printable` escapes every character of any text (a body, a key, an
error) that the rule refuses, so a name the audit keeps is printed exactly as it is, and nothing
printed can act on the terminal or hide in a word. Pure: no I/O, nothing of the gateway's.

The rule refuses a character that a screen would obey, hide or reorder rather than show, or show as
another one:

- controls (Cc: C0, DEL and C1, the tab too): they start escape sequences that clear the screen or
  set the window's title, a carriage return overwrites the line, a NUL cannot be kept in jsonb, and a
  tab is a gap of no fixed width ("run<TAB>1" and "run 1" look alike on a page);
- line and paragraph separators (Zl, Zp): a value holding one passes for two lines;
- every space but U+0020 (Zs): a no-break, narrow, hair or ideographic space passes for U+0020, or
  for two, or for none ("run-1" and "run-1" with a no-break space after it read alike);
- characters drawn as blank that are not spaces, such as the braille pattern blank U+2800;
- lone surrogates (Cs): bytes that were not UTF-8, which a terminal cannot even be sent;
- bidi controls: a right-to-left override makes "bob" + "live" read "bobevil";
- format characters (Cf) and Unicode's Default_Ignorable_Code_Point set (below): a zero-width space,
  a soft hyphen, a Hangul filler or a variation selector after "run-1" make ten distinct labels that
  all look like "run-1".

Except a joiner or a variation selector where it changes what is drawn, as Unicode defines it (the
tables in :mod:`gateway.unicode_tables`):

- a zero-width non-joiner where it parts two letters that would otherwise join (Persian writes
  words with it), or after a virama and before a letter of its script, where it shows the virama
  instead of a conjunct (Hindi, Bengali...): the rule IDNA holds domain names to (RFC 5892, appendix
  A), with the letters around the virama held to one script;
- a zero-width joiner after a virama (a half form; Sinhala writes "shri" with it), between a letter
  and a virama of one script (Bengali's ya-phala after a full ra), beside a letter that nothing else
  joins on that side (a letter's joined form, shown alone), or between two emoji (a family, a
  rainbow flag);
- a variation selector in a sequence Unicode lists: an emoji's text or emoji style (U+FE0E, U+FE0F), a
  keycap (``1`` U+FE0F U+20E3), a standardized variant (a Mongolian letter's form, a CJK compatibility
  ideograph, a mathematical symbol's), never after ASCII but in a keycap. An ideographic variation
  sequence (U+E0100 and on) is refused: most screens draw the plain ideograph for it.

A name in ASCII therefore cannot be imitated by adding an invisible character. What remains is up to
fonts and is not this rule's to decide: a terminal that does not join Arabic letters shows a Persian
word with and without its non-joiner alike (the audit page, in a browser, does not); two emoji that
Unicode does not join are drawn side by side as if the joiner were not there; and beyond ASCII,
letters that look alike exist anyway (a Cyrillic "а" for a Latin "a"): no rule of characters stops
those, and this one does not try.
"""

from __future__ import annotations

import bisect
import re
import unicodedata
from collections.abc import Sequence

from gateway import unicode_tables

# Default_Ignorable_Code_Point, from DerivedCoreProperties.txt of Unicode 14.0.0 (the version of
# Python 3.11's unicodedata, which has no property for it): first and last code point of each range.
# Characters a renderer shows as nothing when it has no glyph for them; reserved ones included, so a
# later Unicode cannot make one visible to newer screens and invisible to older ones.
DEFAULT_IGNORABLE = (
    (0x00AD, 0x00AD),  # Cf  SOFT HYPHEN
    (0x034F, 0x034F),  # Mn  COMBINING GRAPHEME JOINER
    (0x061C, 0x061C),  # Cf  ARABIC LETTER MARK
    (0x115F, 0x1160),  # Lo  HANGUL CHOSEONG FILLER..HANGUL JUNGSEONG FILLER
    (0x17B4, 0x17B5),  # Mn  KHMER VOWEL INHERENT AQ..KHMER VOWEL INHERENT AA
    (0x180B, 0x180D),  # Mn  MONGOLIAN FREE VARIATION SELECTOR ONE..THREE
    (0x180E, 0x180E),  # Cf  MONGOLIAN VOWEL SEPARATOR
    (0x180F, 0x180F),  # Mn  MONGOLIAN FREE VARIATION SELECTOR FOUR
    (0x200B, 0x200F),  # Cf  ZERO WIDTH SPACE..RIGHT-TO-LEFT MARK
    (0x202A, 0x202E),  # Cf  LEFT-TO-RIGHT EMBEDDING..RIGHT-TO-LEFT OVERRIDE
    (0x2060, 0x2064),  # Cf  WORD JOINER..INVISIBLE PLUS
    (0x2065, 0x2065),  # Cn  <reserved-2065>
    (0x2066, 0x206F),  # Cf  LEFT-TO-RIGHT ISOLATE..NOMINAL DIGIT SHAPES
    (0x3164, 0x3164),  # Lo  HANGUL FILLER
    (0xFE00, 0xFE0F),  # Mn  VARIATION SELECTOR-1..VARIATION SELECTOR-16
    (0xFEFF, 0xFEFF),  # Cf  ZERO WIDTH NO-BREAK SPACE
    (0xFFA0, 0xFFA0),  # Lo  HALFWIDTH HANGUL FILLER
    (0xFFF0, 0xFFF8),  # Cn  <reserved-FFF0>..<reserved-FFF8>
    (0x1BCA0, 0x1BCA3),  # Cf  SHORTHAND FORMAT LETTER OVERLAP..SHORTHAND FORMAT UP STEP
    (0x1D173, 0x1D17A),  # Cf  MUSICAL SYMBOL BEGIN BEAM..MUSICAL SYMBOL END PHRASE
    (0xE0000, 0xE0000),  # Cn  <reserved-E0000>
    (0xE0001, 0xE0001),  # Cf  LANGUAGE TAG
    (0xE0002, 0xE001F),  # Cn  <reserved-E0002>..<reserved-E001F>
    (0xE0020, 0xE007F),  # Cf  TAG SPACE..CANCEL TAG
    (0xE0080, 0xE00FF),  # Cn  <reserved-E0080>..<reserved-E00FF>
    (0xE0100, 0xE01EF),  # Mn  VARIATION SELECTOR-17..VARIATION SELECTOR-256
    (0xE01F0, 0xE0FFF),  # Cn  <reserved-E01F0>..<reserved-E0FFF>
)
_STARTS = [first for first, _ in DEFAULT_IGNORABLE]
# Bidi_Control (PropList.txt): each reorders the text around it.
BIDI_CONTROLS = frozenset({0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)})
ZWNJ, ZWJ = "\u200c", "\u200d"
ZERO_WIDTH_JOINERS = frozenset({ord(ZWNJ), ord(ZWJ)})
# Variation selectors (StandardizedVariants.txt, emoji-variation-sequences.txt, the Ideographic
# Variation Database) and Mongolian's free variation selectors.
VARIATION_SELECTORS = frozenset(
    {*range(0xFE00, 0xFE10), *range(0xE0100, 0xE01F0), *range(0x180B, 0x180E), 0x180F}
)
# The selectors of an emoji's text style and emoji style (emoji-variation-sequences.txt).
_EMOJI_STYLES = frozenset({0xFE0E, 0xFE0F})
# Graphic characters that fonts draw as an empty cell, though Unicode gives them no space's category:
# the braille pattern with no dots (Unicode's own note: "imaged as a fixed-width blank"), the filler
# of an empty place in a Khitan character, and the notehead music draws as nothing.
BLANKS = frozenset({0x2800, 0x16FE4, 0x1D159})
# The skin tones an emoji in a joined sequence may carry before the joiner (Emoji_Modifier).
_SKIN_TONES = range(0x1F3FB, 0x1F400)
# Canonical_Combining_Class of a virama (UnicodeData.txt), the mark that kills a consonant's vowel.
_VIRAMA = 9
# A keycap emoji: one of these, U+FE0F (or U+FE0E), COMBINING ENCLOSING KEYCAP.
_KEYCAP_BASES = frozenset("0123456789#*")
_KEYCAP = "\u20e3"
_NOT_UTF8 = "not UTF-8"
_JOINER = "a joiner, kept only where it changes how the letters or emoji beside it are drawn"
_SELECTOR = (
    "a variation selector, kept only in a sequence Unicode lists (an emoji's style, a standardized variant)"
)
# Printable ASCII is shown as itself: only the rest is looked up (a body is mostly ASCII).
_BEYOND_ASCII = re.compile(r"[^\x20-\x7e]")


def flaw(name: str) -> str | None:
    """Say why ``name`` cannot be kept in the audit and shown as a name, or None when it can.

    The rule for the names people read in the audit: an operator's, and an agent's run and step
    labels (see the module's docstring). The reason names the first character at fault.
    """
    for match in _BEYOND_ASCII.finditer(name):
        why = _refused(name, match.start())
        if why == _NOT_UTF8:
            return "is not UTF-8 text"
        if why is not None:
            return f"may not hold U+{ord(match.group()):04X}, {why}"
    return None


def printable(value: object) -> str:
    """Return ``value`` as text whose every character a terminal shows as itself: those :func:`flaw`
    refuses are escaped as Python writes them (``\\x1b``, ``\\u202e``).

    Every line the command line prints for a person goes through here, and every line of the text
    log: an effect's text comes from agents, upstreams and earlier versions of the gateway, and an
    error may quote any of them. A backslash is left as it is (bodies are full of JSON's own escapes),
    so ``\\x1b`` on the screen may also be those four characters; ``--json`` tells them apart.
    """
    text = str(value)
    return _BEYOND_ASCII.sub(lambda match: _shown(text, match.start()), text)


def _shown(text: str, at: int) -> str:
    char = text[at]
    return char if _refused(text, at) is None else char.encode("unicode_escape").decode("ascii")


def _refused(text: str, at: int) -> str | None:
    """Why the character at ``at`` is refused where it stands, or None."""
    char = text[at]
    category = unicodedata.category(char)
    code = ord(char)
    if category == "Cc":
        return "a control character"
    if category in ("Zl", "Zp"):
        return "a line or paragraph separator"
    if category == "Zs":  # U+0020 is ASCII, never looked up
        return "a space other than U+0020, which passes for it"
    if category == "Cs":
        return _NOT_UTF8
    if code in ZERO_WIDTH_JOINERS:
        return None if _joins(text, at) else _JOINER
    if code in VARIATION_SELECTORS:
        return None if _selects(text, at) else _SELECTOR
    if code in BIDI_CONTROLS:
        return "a bidi control, which reorders the text around it"
    if ignorable(code):
        return "an invisible character"
    if code in BLANKS:
        return "a character drawn as blank"
    if category == "Cf":
        return "a format character"
    return None


def ignorable(code: int) -> bool:
    """Whether the code point is one of Unicode's Default_Ignorable_Code_Point."""
    at = bisect.bisect_right(_STARTS, code) - 1
    return at >= 0 and code <= DEFAULT_IGNORABLE[at][1]


def _joins(text: str, at: int) -> bool:
    """Whether the joiner at ``at`` changes how the characters beside it are drawn."""
    return _in_indic_cluster(text, at) or _changes_joining(text, at) or _joins_emoji(text, at)


def _in_indic_cluster(text: str, at: int) -> bool:
    """Whether the joiner follows a virama that follows a letter of its script: a non-joiner before
    another letter of that script shows the virama instead of a conjunct (at the end of a word it
    would change nothing); a joiner asks for a half form or a conjunct (Sinhala's "shri"), or at the
    end of a word for Malayalam's chillu as written before Unicode 5.1. Or whether a zero-width joiner
    stands between a letter and a virama of one script (Bengali's ra, joiner, virama, ya: a ya-phala
    after a full ra)."""
    before, after = _at(text, at - 1), _at(text, at + 1)
    if _is_virama(before):
        script = _virama_script(before)
        if script is None or _virama_script(_at(text, at - 2)) != script:
            return False
        return text[at] == ZWJ or _letter(after, script)
    if text[at] == ZWJ and _is_virama(after):
        script = _virama_script(after)
        return script is not None and _letter(before, script) and _letter(_at(text, at + 2), script)
    return False


def _changes_joining(text: str, at: int) -> bool:
    """Whether the joiner changes how the letters of a joining script (Arabic, Syriac, N'Ko...) are
    drawn: a non-joiner between two letters that would join parts them; a joiner beside a letter
    that would join nothing there gives it the joined form."""
    before_joins_forward = _joining_type(text, at, -1) in ("L", "D")
    after_joins_back = _joining_type(text, at, +1) in ("R", "D")
    if text[at] == ZWNJ:
        return before_joins_forward and after_joins_back
    return before_joins_forward != after_joins_back


def _joins_emoji(text: str, at: int) -> bool:
    """Whether the zero-width joiner is between two emoji, the one before it perhaps in emoji style
    or with a skin tone (a family, a rainbow flag, a woman technologist)."""
    before = at - 1
    if before >= 0 and (text[before] == "\ufe0f" or ord(text[before]) in _SKIN_TONES):
        before -= 1
    return (
        text[at] == ZWJ
        and _at(text, before) in _EXTENDED_PICTOGRAPHIC
        and _at(text, at + 1) in _EXTENDED_PICTOGRAPHIC
    )


def _selects(text: str, at: int) -> bool:
    """Whether the variation selector at ``at`` ends a sequence Unicode lists, after a base beyond
    ASCII (or in a keycap): there it picks a form a screen draws differently."""
    selector = text[at]
    if ord(selector) in _EMOJI_STYLES and _keycap(text, at):
        return True
    base = _at(text, at - 1)
    if not base or base.isascii():
        return False
    if ord(selector) in _EMOJI_STYLES:
        return base in _EMOJI_VARIATION_BASES
    compatibility = ord(selector) - 0xFE00  # the n-th compatibility ideograph is U+FE00 + n - 1
    return (base, selector) in _STANDARDIZED_VARIANTS or 0 <= compatibility < _COMPATIBILITY_VARIANTS.get(
        base, 0
    )


def _keycap(text: str, at: int) -> bool:
    """Whether the selector at ``at`` is the middle of a keycap emoji such as ``1`` U+FE0F U+20E3."""
    return at >= 1 and text[at - 1] in _KEYCAP_BASES and text[at + 1 : at + 2] == _KEYCAP


def _at(text: str, at: int) -> str:
    """The character at ``at``, or "" beyond either end."""
    return text[at] if 0 <= at < len(text) else ""


def _letter(char: str, script: str) -> bool:
    return char != "" and unicodedata.category(char)[0] == "L" and _virama_script(char) == script


def _is_virama(char: str) -> bool:
    return char != "" and unicodedata.combining(char) == _VIRAMA


def _virama_script(char: str) -> str | None:
    """The script of a letter or mark of a script that has a virama, else None."""
    if not char or unicodedata.category(char)[0] not in "LM":
        return None
    return _VIRAMA_SCRIPTS.get(char)


def _joining_type(text: str, at: int, step: int) -> str:
    """The joining type of the first character from ``at`` in the direction of ``step`` that is not
    passed over (a vowel mark is), or "" at the end of the text."""
    at += step
    while 0 <= at < len(text):
        kind = _JOINING_TYPES.get(text[at])
        if kind is None:
            kind = "T" if unicodedata.category(text[at]) in ("Mn", "Me", "Cf") else "U"
        if kind != "T":
            return kind
        at += step
    return ""


class _Table:
    """Ranges of code points, each (first, last, value) and in order, looked up by bisection."""

    def __init__(self, ranges: Sequence[tuple[int, int, str]]) -> None:
        self._ranges = ranges
        self._starts = [first for first, _, _ in ranges]

    @classmethod
    def of(cls, ranges: Sequence[tuple[int, int]]) -> _Table:
        """Make a table of ranges that have no value: it says only whether a character is in one."""
        return cls([(first, last, "") for first, last in ranges])

    def get(self, char: str) -> str | None:
        """The value of the range holding ``char``, or None when none holds it (or ``char`` is "")."""
        if not char:
            return None
        code = ord(char)
        at = bisect.bisect_right(self._starts, code) - 1
        if at < 0 or code > self._ranges[at][1]:
            return None
        return self._ranges[at][2]

    def __contains__(self, char: str) -> bool:
        return self.get(char) is not None


def _compatibility_variants() -> dict[str, int]:
    """How many CJK compatibility ideographs decompose to each ideograph: StandardizedVariants.txt
    writes the n-th as that ideograph followed by U+FE00 + n - 1 (tools/unicode_tables.py checks it)."""
    counts: dict[str, int] = {}
    for first, last in ((0xF900, 0xFAFF), (0x2F800, 0x2FA1F)):  # the two blocks that hold them
        for code in range(first, last + 1):
            decomposition = unicodedata.decomposition(chr(code))
            if decomposition and not decomposition.startswith("<"):
                base = chr(int(decomposition, 16))
                counts[base] = counts.get(base, 0) + 1
    return counts


_JOINING_TYPES = _Table(unicode_tables.JOINING_TYPES)
_VIRAMA_SCRIPTS = _Table(unicode_tables.VIRAMA_SCRIPTS)
_EXTENDED_PICTOGRAPHIC = _Table.of(unicode_tables.EXTENDED_PICTOGRAPHIC)
_EMOJI_VARIATION_BASES = _Table.of(unicode_tables.EMOJI_VARIATION_BASES)
_STANDARDIZED_VARIANTS = frozenset(
    (chr(base), chr(selector)) for base, selector in unicode_tables.STANDARDIZED_VARIANTS
)
_COMPATIBILITY_VARIANTS = _compatibility_variants()
