"""What each Postgres failure means to the gateway: the agent is told to retry later (an outage, 503),
the statement is tried again (retry), or the answer is that Postgres refused it (refused)."""

from __future__ import annotations

import asyncpg
import pytest

from gateway.pg_failures import FAILURES, kind

CASES = [
    (ConnectionResetError("reset by peer"), "outage"),
    (TimeoutError(), "outage"),
    (asyncpg.ConnectionDoesNotExistError("connection was closed in the middle of operation"), "outage"),
    (asyncpg.exceptions.AdminShutdownError("terminating connection due to administrator command"), "outage"),
    (asyncpg.exceptions.QueryCanceledError("canceling statement due to statement timeout"), "outage"),
    # What a session cut in the middle of a message exchange raises: it reached agents as a 500.
    (
        asyncpg.exceptions.InternalClientError("cannot switch to state 11; another operation is in progress"),
        "outage",
    ),
    (asyncpg.InterfaceError("cannot perform operation: connection is closed"), "outage"),
    (asyncpg.exceptions.DeadlockDetectedError("deadlock detected"), "retry"),
    (asyncpg.exceptions.SerializationError("could not serialize access"), "retry"),
    (asyncpg.exceptions.UniqueViolationError("duplicate key"), "refused"),
    (asyncpg.exceptions.CheckViolationError("new row violates check constraint"), "refused"),
    # asyncpg's own refusals, though they are InterfaceErrors: the same again is refused again.
    (asyncpg.DataError("invalid input for query argument $1"), "refused"),
    (asyncpg.ClientConfigurationError("unknown option"), "refused"),
]


@pytest.mark.parametrize(("failure", "meaning"), CASES, ids=[type(f).__name__ for f, _ in CASES])
def test_each_failure_is_caught_and_has_one_meaning(failure: BaseException, meaning: str) -> None:
    """Every failure talking to Postgres is among those the store catches, and means one thing."""
    assert isinstance(failure, FAILURES)
    assert kind(failure) == meaning
