"""The scenario registry: ``hixl bench --scenario NAME`` runs ``SCENARIOS[NAME]``.

A scenario is a function ``(config, progress) -> ScenarioResult``. It should
call ``progress.expect(n)`` once with its number of steps, wrap each step in
``with progress.step(label):``, and return its rows (each with a baseline,
ratio and target where one applies) plus notes. To add one, write a module
with a ``run`` function and add it below; the CLI, table and JSON pick it up.
Scenario-specific knobs can travel in ``BenchConfig.extra`` — as the ``kv``
scenario's (:mod:`hixl.bench.kv_bench`, a KV cache on :mod:`hixl.datadist`)
``kv_layers`` / ``kv_tokens`` / ``kv_block_sizes`` do (for ``kv-vllm`` too), and
the ``soak`` scenario's ``soak_*`` (:mod:`hixl.bench.soak_bench`), the ``fleet``
scenario's ``fleet_*`` (:mod:`hixl.bench.fleet_bench`), and the ``vllm`` scenario's ``vllm_*``
(:mod:`hixl.bench.vllm_bench`: vLLM servers with hixl's connector and NIXL's), the ``weights``
scenario's ``weights_*`` (:mod:`hixl.bench.weights_bench`) and the ``ps`` scenario's ``ps_rows``
(:mod:`hixl.bench.ps_bench`); ``weights-vllm`` (:mod:`hixl.bench.weights_vllm_bench`) has no knobs, and the
``prefix`` scenario's are ``prefix_*`` (:mod:`hixl.bench.prefix_bench`: ``hixl proxy`` routing by prefix and by load).
"""

from __future__ import annotations

from collections.abc import Callable

from . import engine_bench, fleet_bench, kv_bench, prefix_bench, ps_bench, soak_bench, vllm_bench, weights_bench, weights_vllm_bench
from .config import BenchConfig
from .progress import Progress
from .results import ScenarioResult

__all__ = ["DEFAULT_SCENARIO", "DEFAULT_TRANSPORTS", "SCENARIOS", "Scenario"]

Scenario = Callable[[BenchConfig, Progress], ScenarioResult]

SCENARIOS: dict[str, Scenario] = {
    "engine": engine_bench.run,
    "kv": kv_bench.run,
    "kv-vllm": kv_bench.run_vllm,
    "soak": soak_bench.run,
    "fleet": fleet_bench.run,
    "vllm": vllm_bench.run,
    "weights": weights_bench.run,
    "ps": ps_bench.run,
    "weights-vllm": weights_vllm_bench.run,
    "prefix": prefix_bench.run,
}

DEFAULT_SCENARIO = "engine"

DEFAULT_TRANSPORTS: dict[str, tuple[str, ...]] = {
    "engine": ("cma", "shm", "tcp"),
    "kv": ("cma", "tcp"),
    "kv-vllm": ("cma", "tcp"),
    "soak": ("cma", "tcp"),
    "vllm": vllm_bench.AUTO,
    "weights": ("cma", "shm", "tcp"),
    "ps": ("cma", "shm", "tcp"),
    "weights-vllm": vllm_bench.AUTO,
    "prefix": vllm_bench.AUTO,
}
"""What each scenario measures unless ``--transport`` says: shm needs the peer's memory to come from the
shared pool, which only the engine scenario's target allocates (and hixl.weights' slots and tables)."""
