"""The advisory locks the gateways take on their database, each with its own key.

Any constants will do, as long as no other application on the database uses them for other locks, and
no two of the gateway's own are the same: two jobs sharing a key would each skip their turn whenever
the other held it. They read as "effects" in ASCII, then a number.
"""

from __future__ import annotations

# Held for a session by the one gateway (or `migrate`) applying migrations; the others wait for it.
MIGRATION = 0x65666665637473
# Held for a session by the one gateway maintaining the partitions; the others skip that round. On the
# direct connection: a pooler in transaction mode would leave it on a server connection others use.
MAINTENANCE = 0x6566666563747301
# Held for a transaction by the one worker linking settlements into the audit's chain (gateway.chaining).
CHAIN = 0x6566666563747302
# Held for a transaction by the one worker noticing new waits to tell the webhook (gateway.webhooks).
NOTICE = 0x6566666563747303

ALL = (MIGRATION, MAINTENANCE, CHAIN, NOTICE)
