"""Support shared by hixl's tools (``hixl bench``, ``hixl demo``, :mod:`hixl.testing`), not by the library.

* :mod:`.child` — a Python child process driven over a pipe (test peers, bench
  targets, the demo's workers);
* :mod:`.plot` — optional matplotlib figures for ``--plot``.
"""
