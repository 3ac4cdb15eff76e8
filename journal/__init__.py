"""The agent-side step journal and the httpx integration that gives every effect a key."""

from journal.errors import JournalError, NotJSON, RunFinished, StepMismatch
from journal.http import KeyedTransport, keyed_client, stamp, step_headers
from journal.journal import Journal, Run, StepContext, current_step, open_journal

__all__ = [
    "Journal",
    "JournalError",
    "KeyedTransport",
    "NotJSON",
    "Run",
    "RunFinished",
    "StepContext",
    "StepMismatch",
    "current_step",
    "keyed_client",
    "open_journal",
    "stamp",
    "step_headers",
]
