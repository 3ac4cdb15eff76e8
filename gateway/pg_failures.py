"""What a Postgres failure means to the gateway: try the statement again, an outage, or a refusal.

The store (gateway/store.py) and the migrations (gateway/schema.py) ask :func:`kind` of every
failure, and connect through :func:`connecting`, so one failure is never an outage in one place and a
crash in another. (The partitions' code handles two failures of its own on the spot: a lock it waited too long
for, and a deadlock while detaching, each retried there.)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import asyncpg

from gateway.errors import LoginRefused, StoreUnavailable

# What Postgres rolls back whole and says to try again: the same statement can then succeed. Anything
# else it refuses would be refused again.
# Also a statement prepared on another server connection than the one that was to run it: a pooler in
# transaction mode given as database_url alone (set database_direct_url too, and none is prepared by
# name). The statement never ran; on another try it may meet the connection that knows it.
RETRY = (
    asyncpg.exceptions.SerializationError,
    asyncpg.exceptions.DeadlockDetectedError,
    asyncpg.exceptions.InvalidSQLStatementNameError,
)
# The server went away under a statement: lost connection, or shut down or restarted by an operator
# (57P); or a statement ran past statement_timeout or lock_timeout, which the gateway treats alike: try
# later. asyncpg's InterfaceError is its side of a session that broke (a closed connection, one left
# mid-exchange by a cancelled statement); but see REFUSED.
OUTAGE = (
    OSError,
    TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.ConnectionDoesNotExistError,
    asyncpg.exceptions.OperatorInterventionError,
    asyncpg.exceptions.QueryCanceledError,
    asyncpg.exceptions.LockNotAvailableError,
    asyncpg.InterfaceError,
    # what asyncpg raises when the server cuts a session in the middle of a message exchange
    asyncpg.exceptions.InternalClientError,
)
# asyncpg's own refusals, though they are InterfaceErrors: a value it cannot send as the statement's
# argument (DataError), a database_url it cannot use. The same again would be refused again.
REFUSED = (asyncpg.DataError, asyncpg.ClientConfigurationError)
# What a server that is up answers to a login it will refuse however long one waits: a wrong password
# (28P01, a kind of 28000), a role it does not know, that may not log in or that pg_hba.conf turns away
# (28000), a database that does not exist (3D000). Whatever else stops a connection (the server down or
# starting up, no connection slot free) may pass if tried again.
LOGIN_REFUSED = (
    asyncpg.exceptions.InvalidAuthorizationSpecificationError,
    asyncpg.exceptions.InvalidCatalogNameError,
)
# Everything talking to Postgres may raise: what a handler catches before asking kind(). (asyncpg's
# InternalClientError is neither a PostgresError nor an InterfaceError: it is among the outages.)
FAILURES = (*OUTAGE, asyncpg.PostgresError)

Kind = Literal["retry", "outage", "refused"]


def kind(exc: BaseException) -> Kind:
    """Say what a failure means: ``retry`` the statement, an ``outage`` (try later), or ``refused``
    (Postgres is up and will refuse the same again: data it cannot hold, a setting to fix)."""
    if isinstance(exc, RETRY):
        return "retry"
    if isinstance(exc, REFUSED):
        return "refused"
    if isinstance(exc, OUTAGE):
        return "outage"
    return "refused"


def cannot_connect(exc: BaseException) -> StoreUnavailable:
    """Return the error for a connection that could not be made: :class:`LoginRefused` when trying again
    cannot help, else :class:`StoreUnavailable`."""
    if isinstance(exc, LOGIN_REFUSED):
        return LoginRefused(
            f"Postgres refused the connection: {exc} (check database_url, and database_direct_url if set)"
        )
    if "unsupported startup parameter" in str(exc):
        # PgBouncer's answer to the settings sent at login, which it cannot pass on.
        return LoginRefused(
            f"the pooler at database_url refused the connection: {exc} (set database_direct_url to "
            "Postgres itself, and the gateway sends nothing a pooler cannot pass on: docs/operations.md, "
            "Poolers)"
        )
    return StoreUnavailable(f"cannot connect to Postgres: {exc}")


@contextmanager
def connecting() -> Iterator[None]:
    """Turn a connection that could not be made into :func:`cannot_connect`'s error.

    A database_url that asyncpg cannot use (ClientConfigurationError) goes through as it is: the
    command line names the setting to fix.
    """
    try:
        yield
    except asyncpg.ClientConfigurationError:
        raise
    except FAILURES as exc:
        raise cannot_connect(exc) from exc
