"""effect-gateway: the sidecar that makes an agent's side effects safe to retry."""

__version__ = "0.1.0"
