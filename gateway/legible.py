"""Text a person reads: which names and labels the audit keeps, and how a terminal is shown any text.

One rule, in one place, for two uses. :func:`flaw` says why an operator's name or an agent's run or
step label cannot be kept; :func:`printable` escapes every character of any text (a body, a key, an
error) that the rule refuses, so a name the audit keeps is printed exactly as it is, and nothing
printed can act on the terminal or hide in a word. Pure: no I/O, nothing of the gateway's.

The rule refuses a character that a screen would obey, hide or reorder rather than show:

- controls (Cc: C0, DEL and C1, the tab too): they start escape sequences that clear the screen or
  set the window's title, a carriage return overwrites the line, a NUL cannot be kept in jsonb, and a
  tab is a gap of no fixed width ("run<TAB>1" and "run 1" look alike on a page);
- line and paragraph separators (Zl, Zp): a value holding one passes for two lines;
- lone surrogates (Cs): bytes that were not UTF-8, which a terminal cannot even be sent;
- bidi controls: a right-to-left override makes "bob" + "live" read "bobevil";
- format characters (Cf) and Unicode's Default_Ignorable_Code_Point set (below): a zero-width space,
  a soft hyphen, a Hangul filler or a variation selector after "run-1" make ten distinct labels that
  all look like "run-1".

Except where real text needs them and they change what is seen: a zero-width joiner or non-joiner
between two letters, marks or symbols beyond ASCII (Persian writes words with the non-joiner, emoji
sequences such as a family or a rainbow flag are joined with the joiner), and a variation selector
right after a letter, mark or symbol beyond ASCII (an emoji's colour form, a CJK ideograph's variant,
a Mongolian letter's form) or in a keycap (``1`` U+FE0F U+20E3). A name in ASCII therefore cannot be
imitated by adding an invisible character. Beyond ASCII, letters that look alike exist anyway (a
Cyrillic "а" for a Latin "a"): no rule of characters stops those, and this one does not try.
"""

from __future__ import annotations

import bisect
import re
import unicodedata

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
ZERO_WIDTH_JOINERS = frozenset({0x200C, 0x200D})  # ZWNJ, ZWJ
# Variation selectors (StandardizedVariants.txt, emoji-variation-sequences.txt, the Ideographic
# Variation Database) and Mongolian's free variation selectors.
VARIATION_SELECTORS = frozenset(
    {*range(0xFE00, 0xFE10), *range(0xE0100, 0xE01F0), *range(0x180B, 0x180E), 0x180F}
)
# A keycap emoji: one of these, U+FE0F (or U+FE0E), COMBINING ENCLOSING KEYCAP.
_KEYCAP_BASES = frozenset("0123456789#*")
_KEYCAP = "\u20e3"
_NOT_UTF8 = "not UTF-8"
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
    if category == "Cs":
        return _NOT_UTF8
    if code in ZERO_WIDTH_JOINERS:
        if _visible(text, at - 1) and _visible(text, at + 1):
            return None
        return "a joiner, kept only between two letters, marks or symbols beyond ASCII"
    if code in VARIATION_SELECTORS:
        if _base(text, at - 1) or _keycap(text, at):
            return None
        return "a variation selector, kept only right after a letter, mark or symbol beyond ASCII"
    if code in BIDI_CONTROLS:
        return "a bidi control, which reorders the text around it"
    if ignorable(code):
        return "an invisible character"
    if category == "Cf":
        return "a format character"
    return None


def ignorable(code: int) -> bool:
    """Whether the code point is one of Unicode's Default_Ignorable_Code_Point."""
    at = bisect.bisect_right(_STARTS, code) - 1
    return at >= 0 and code <= DEFAULT_IGNORABLE[at][1]


def _visible(text: str, at: int) -> bool:
    """Whether ``text[at]`` is a letter, mark or symbol beyond ASCII (a joiner's neighbour)."""
    if not 0 <= at < len(text) or text[at].isascii():
        return False
    return unicodedata.category(text[at])[0] in "LMS"


def _base(text: str, at: int) -> bool:
    """Whether ``text[at]`` is a visible character a variation selector may follow: not one that is
    itself invisible, such as another selector."""
    return _visible(text, at) and not ignorable(ord(text[at]))


def _keycap(text: str, at: int) -> bool:
    """Whether the selector at ``at`` is the middle of a keycap emoji such as ``1`` U+FE0F U+20E3."""
    return (
        ord(text[at]) in (0xFE0E, 0xFE0F)
        and at >= 1
        and text[at - 1] in _KEYCAP_BASES
        and text[at + 1 : at + 2] == _KEYCAP
    )
