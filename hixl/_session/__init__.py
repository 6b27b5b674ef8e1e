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
- :mod:`.target` — the listening side (:class:`~.target.TargetServer`): admission,
  REVOKEs, holds; its parts are :mod:`.serve_loop` (one I/O loop for every connection),
  :mod:`.served` (one initiator's connection: handshake, then requests in order),
  :mod:`.admission` (connection slots), :mod:`.outbox` (non-blocking sends) and
  :mod:`.pool` (the few workers for what may block).
- :mod:`.contract` — what a transport's target half and the served connections ask of
  each other (:class:`~.contract.ServedSession`, :class:`~.contract.TargetHalf`): defined
  here, so that this layer runs without importing the transports above it.
"""
