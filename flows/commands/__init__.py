"""The commands of `shardflow`, one module per family; each has a ``register``."""
