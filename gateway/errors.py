"""The gateway's own exceptions; third-party ones are mapped to these at the store and upstream seams.

Every one derives from :class:`GatewayError`; :func:`gateway.replies.problem_of_error` is the one table
that says which problem an agent or operator gets for each. Those about a request's own bytes are
ValueErrors too, as the parsers that raise them are.
"""


class GatewayError(Exception):
    """Base of every error the gateway raises on purpose."""


class ConfigError(GatewayError):
    """The configuration cannot be used; the message is one line naming the setting."""


class CannotListen(GatewayError):
    """A listening socket could not be bound (a port in use, an address not here); says which setting."""


class StoreUnavailable(GatewayError):
    """Postgres could not be reached or answered with an error we cannot act on."""


class LoginRefused(StoreUnavailable):
    """Postgres is up but refuses the configured password, role or database, and will go on refusing:
    to a request an outage like any other (503), to a command a configuration to fix (exit 2)."""


class SchemaNewer(GatewayError):
    """The database was migrated by a newer version of the gateway, whose rows this one could misread."""


class SchemaBehind(GatewayError):
    """The database's schema is older than this gateway, and its role may not migrate it: the owner must."""


class PrivilegesMissing(GatewayError):
    """The gateway's database role lacks a privilege that serving needs; the message names each."""


class NoSuchRole(GatewayError):
    """The role to grant privileges to is not in the database (roles are made by the DBA, not by us)."""


class BodyUnreadable(GatewayError):
    """A stored body this gateway cannot read back: a coding it does not know, or bytes that fail their
    check. Never replayed as garbage, and never a reason to send the effect again."""

    def __init__(self, message: str, effect_id: int | None = None) -> None:
        super().__init__(message)
        self.effect_id = effect_id


class WritesLost(GatewayError):
    """The database has forgotten writes a gateway committed (gateway.lost_writes): no new effect until
    an operator has reconciled. Not an outage: retrying cannot help."""


class StoreRejected(GatewayError):
    """Postgres is up but refused a statement (data it cannot hold); retrying it cannot help."""


class ProbeFailed(GatewayError):
    """A probe could not say whether the effect exists (timeout, bad status, garbage answer)."""


class CursorUnknown(GatewayError):
    """A page of the audit read by time was asked to go on from an effect its viewer cannot see."""


class NotAwaitingOperator(GatewayError):
    """An operator's verdict on a record that is not waiting for one, or that changed since it was judged."""

    def __init__(self, message: str, effect_id: int | None = None) -> None:
        super().__init__(message)
        self.effect_id = effect_id


class NoSuchEffect(GatewayError):
    """No effect has this id (or none the caller may see)."""


class BadName(GatewayError):
    """An operator's name that the history cannot keep as given."""


# --- what a request is refused for, before anything is claimed or sent ---------------------------------


class UnsupportedCoding(GatewayError, ValueError):
    """A content coding the gateway does not decode."""


class BadCoding(GatewayError, ValueError):
    """The body is not valid data of its declared coding."""


class DecodedTooLarge(GatewayError, ValueError):
    """Decoded, the body would pass the limit."""


class NotAsFirstSent(GatewayError, ValueError):
    """The request the effect was claimed with cannot be sent again (not on record, or not readable)."""


class JsonRefused(GatewayError, ValueError):
    """The body is not one unambiguous JSON document."""


class KeySyntaxError(GatewayError, ValueError):
    """The header value is not a key."""


# --- what an upstream, an agent or a command line did that the gateway cannot go on with -------------


class NotASearchAnswer(GatewayError, ValueError):
    """The answer does not have the shape ``found`` describes: it says nothing about the effect."""


class ClientGone(GatewayError):
    """The agent hung up before its request was whole: nobody is left to answer, and nothing was sent."""


class StampError(GatewayError, ValueError):
    """The request has no place for the stamp (e.g. a JSON field on a body that is not an object)."""


class FormRefused(GatewayError, ValueError):
    """The form body has more fields than the gateway reads."""


class HeaderRefused(GatewayError, ValueError):
    """A header that cannot be written without breaking (or injecting into) the response head."""


class UsageError(GatewayError):
    """A command line that cannot be carried out as given; the message says what to change (exit 2)."""
