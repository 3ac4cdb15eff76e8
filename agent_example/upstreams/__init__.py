"""The demo's upstreams, each a real HTTP service in a process of its own (so it outlives a gateway crash).

- shop: no idempotency of its own; orders can be searched by a stamped reference.
- mail: honours Idempotency-Key and forgets keys after a TTL (default 24 h).
- payments: Stripe-like: form-encoded, native keys with a TTL, search by metadata.

Run one: ``python -m agent_example.upstreams shop --port 0``; it prints ``shop listening on URL``.
"""
