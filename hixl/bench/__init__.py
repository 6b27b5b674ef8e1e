"""``hixl bench``: the engine measured against the raw calls it is built on.

Theory of operation. A run executes one or more *scenarios* (see
:mod:`hixl.bench.scenarios`); each returns :class:`Row`\\ s — a figure, the
raw baseline it is compared with, their ratio and the target that ratio
must meet. The ``engine`` scenario (:mod:`hixl.bench.engine_bench`) drives a
target engine in a child process (:mod:`hixl.bench.target`) and times hixl
and its baseline (:mod:`hixl.bench.baselines`) interleaved, so noise on a
small machine hits both alike (:mod:`hixl.bench.timing`). Reports are
:mod:`hixl.bench.report`; the command line is :mod:`hixl.bench.cli`.
Targets are reported as PASS/FAIL and enforced only with ``--check``; a
``--quick`` smoke run judges only the targets that hold at any size.
"""

from .config import BenchConfig
from .progress import Progress
from .results import Row, ScenarioResult, Target
from .scenarios import SCENARIOS

__all__ = ["SCENARIOS", "BenchConfig", "Progress", "Row", "ScenarioResult", "Target"]
