"""Text a person reads: which names and labels the audit keeps, and how a terminal is shown any text.

One rule, in one place, for two uses. :func:`flaw` says why an operator's name or an agent's run or
step label cannot be kept; :func:`printable` escapes every character of any text (a body, a key, an
error) that a terminal would obey or hide instead of showing. Pure: no I/O, nothing of the gateway's.
"""

from __future__ import annotations

import re
import unicodedata

# What a terminal obeys or hides instead of showing, by Unicode's general category. Controls (Cc: C0,
# DEL and C1) start escape sequences that clear the screen, set the window's title or move the cursor,
# and a carriage return overwrites the line; the line and paragraph separators (Zl, Zp) break lines for
# str.splitlines and some terminals, so a value holding one passes for another line.
CONTROLS = frozenset({"Cc", "Zl", "Zp"})
# Format characters (Cf) are invisible: bidi overrides and isolates reorder what follows them (a name
# that reads "bobevil" is "bob" and "live" reversed), zero-width spaces and joiners hide in a word.
INVISIBLE = "Cf"
# Lone surrogates (Cs) stand for bytes that were not UTF-8; a terminal cannot even be sent one.
NOT_TEXT = "Cs"
UNSHOWN = CONTROLS | {INVISIBLE, NOT_TEXT}
# Printable ASCII is shown as itself: only the rest is looked up (a body is mostly ASCII).
_BEYOND_ASCII = re.compile(r"[^\x20-\x7e]")


def flaw(name: str) -> str | None:
    """Say why ``name`` cannot be kept in the audit and shown as a name, or None when it can.

    The one rule for the names people read in the audit: an operator's, and an agent's run and step
    labels. No control characters (a NUL, which Postgres's jsonb cannot hold; a line break, which
    would pass for another line of the history where it is shown as text), no invisible formatting
    characters (a right-to-left override or a zero-width space makes one name look like another on
    the page and in the history), and only UTF-8 (bytes from the command line, or a header sent in
    another encoding, that are not).
    """
    categories = {unicodedata.category(char) for char in name}
    if categories & CONTROLS:
        return "may not hold control characters"
    if INVISIBLE in categories:
        return "may not hold invisible formatting characters"
    if NOT_TEXT in categories:
        return "is not UTF-8 text"
    return None


def printable(value: object) -> str:
    """Return ``value`` as text whose every character a terminal shows as itself: those it would obey or
    hide instead (UNSHOWN) are escaped as Python writes them (``\\x1b``, ``\\u202e``).

    Every line the command line prints for a person goes through here: an effect's text comes from
    agents, upstreams and earlier versions of the gateway, and an error may quote any of them. A
    backslash is left as it is (bodies are full of JSON's own escapes), so ``\\x1b`` on the screen may
    also be those four characters; ``--json`` tells them apart.
    """
    return _BEYOND_ASCII.sub(_escape_unshown, str(value))


def _escape_unshown(match: re.Match[str]) -> str:
    char = match.group()
    if unicodedata.category(char) in UNSHOWN:
        return char.encode("unicode_escape").decode("ascii")
    return char
