"""Data plane: one KV block pool per device and the Ray actor that owns it.

Importing this package stays light (no torch, no Ray) because the pure control plane
imports ``workers.layout``. Import the submodules you need:

* :mod:`workers.layout` - :class:`~workers.layout.KVLayout` (pure).
* :mod:`workers.errors` - the exceptions every worker call may raise (pure).
* :mod:`workers.description` - what a worker reports about itself (pure).
* :mod:`workers.config` - :class:`~workers.config.PoolConfig` (pure).
* :mod:`workers.round` - :class:`~workers.round.Round`, one attention round's worker call
  (pure data).
* :mod:`workers.checks` - validation of every pool request (torch).
* :mod:`workers.sizing` - pool size from a block count or free device memory (torch).
* :mod:`workers.pool` - :class:`~workers.pool.KVPool` (torch).
* :mod:`workers.actor` - :class:`~workers.actor.PoolWorker` (torch, Ray).
* :mod:`workers.launcher` - start, attach and stop named worker actors (Ray).
"""
