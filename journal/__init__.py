"""The agent-side step journal, and the httpx and MCP integrations that give every effect a key."""

from journal.errors import JournalError, NotJSON, RunFinished, StepMismatch
from journal.http import KeyedTransport, keyed_client, stamp, step_headers
from journal.journal import Journal, Run, StepContext, current_step, open_journal
from journal.mcp import call_tool, tool_meta

__all__ = [
    "Journal",
    "JournalError",
    "KeyedTransport",
    "NotJSON",
    "Run",
    "RunFinished",
    "StepContext",
    "StepMismatch",
    "call_tool",
    "current_step",
    "keyed_client",
    "open_journal",
    "stamp",
    "step_headers",
    "tool_meta",
]
