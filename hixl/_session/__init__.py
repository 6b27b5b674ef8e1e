"""The session layer: authenticated connections between engines, over sockets.

Below it, :mod:`hixl._protocol` (sans-IO frames and the connection state
machine); above it, :mod:`hixl.transports` (how bytes move) and the
:class:`~hixl.Engine`. Its modules, one job each:

- :mod:`.backend` — where sockets come from (the injectable network backend).
- :mod:`.address` — engine names (``"ip:port"``) and this host's identity.
- :mod:`.wire` — one socket driving one :class:`~hixl._protocol.connection.Connection`
  (frames out, events in, bulk data, liveness).
- :mod:`.initiator` — a connection to a target (:class:`~.initiator.PeerLink`): the
  handshake, requests and their replies, the peer's regions as seen from here.
- :mod:`.target` — the listening side: one I/O loop for every connection, admission,
  REVOKEs, holds; :mod:`.admission` (connection slots), :mod:`.outbox` (non-blocking
  sends) and :mod:`.pool` (the few workers for what may block) are its parts.
"""
