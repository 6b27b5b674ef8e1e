"""``hixl bench --scenario vllm --overlap``: how much of the KV transfer still shows in the time to first token.

Prefill/decode disaggregation costs the time to first token (TTFT) whatever
part of the KV transfer is not hidden behind prefill's compute. This measures
it, prompt length by prompt length (``vllm_lengths``, ``--lengths``: 256,
1024 and 2048 tokens; ``--quick``: 256), for each contender, each on fresh
servers (the ``vllm`` scenario's :class:`~.vllm_bench.Deployment`, the same
flags, no timeline file: its reference pull runs before decode's first token):

* **alone** — one vLLM server, no KV connector, asked directly: prefill with no
  transfer at all;
* **hixl-pull** — 1P1D behind ``hixl proxy`` with hixl's connector as it is by
  default: decode pulls every layer once prefill has finished;
* **hixl-push** — the same with ``kv_connector_extra_config: {"mode": "push"}``
  on both servers and ``--kv-mode push`` on the proxy: prefill writes each
  layer into decode's blocks while it computes the next;
* **nixl** — vLLM's NIXL connector, where installed (the ``nixl`` extra).

Per contender: ``warmup`` requests, then ``vllm_requests`` (5; ``--quick``: 1)
per length, one at a time, each prompt new to the servers (no prefix-cache
hits), each a streamed completion of ``vllm_max_tokens`` tokens; TTFT from
sending it (to the proxy; alone: to the server) to its first token. Before the
servers, with the machine quiet: one ``transfer_sync`` READ of one layer's KV
at each length (float32, as served), between this process and a bench target
(:class:`~.target.BenchTarget`), over the transport hixl picks (cma here), the
median of ``repeat``.

Rows, per length (the rows' op, ``2048 tok``):

* **time to first token, median** per contender, the PD ones against alone's;
* **exposed transfer (TTFT - alone's)** per PD contender: its median TTFT less
  alone's, against one layer's ``transfer_sync``, so that the ratio is "how
  many layers' transfers still show"; hixl-push's has the target ``<= 1.5x``;
* **one layer's KV transfer (transfer_sync)** and **one layer's compute
  (alone's TTFT / layers)**, the second against the first: how much compute
  each layer's transfer can hide behind;
* **hixl-push's phases, median** (:data:`PHASES`): where a pushed request's
  TTFT goes, from both servers' per-request records (``records``, joined by
  the request's ``X-Request-Id``): the way to decode's grant and prefill's
  first step, prefill's forward, the **transfer tail** (from prefill's last
  layer computed to decode holding every byte: the part of the transfer no
  compute hid, against one layer's transfer), the windows' withdrawal, and
  decode's way to the first token. They add up to the TTFT.

A contender whose servers fail (hixl-push until push mode works, NIXL where it
is missing) gives no rows, a note quotes the error, the others go on. The
model: ``vllm_model`` (``--model``, a local folder: its ``config.json`` gives
the layers and KV sizes), else :data:`hixl.testing.tiny_llama.WIDE` built in
the run's temp folder.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .. import Engine, Op, TransferOpDesc, empty
from ..testing.tiny_llama import WIDE, Sizes, build
from .config import BenchConfig
from .progress import Progress
from .results import Row, ScenarioResult, Target, median
from .target import BenchTarget
from .timing import interleaved_reps
from .vllm_bench import (
    CONNECTORS,
    LONGEST,
    MAX_MODEL_LEN,
    SHAPES,
    Connector,
    Deployment,
    Shape,
    ShapeFailed,
    _reason,
    cpu_binds,
    first_token,
    nixl_missing,
    prompt,
)

__all__ = [
    "ALONE", "PHASES", "PUSH", "TARGET", "Contender", "contenders", "cpu_shares", "describe", "knobs", "layer_sizes",
    "push_phases", "rows", "run",
]  # fmt: skip

LENGTHS = (256, 1024, 2048)
QUICK_LENGTHS = (256,)
DEFAULTS = {"vllm_requests": 5, "vllm_max_tokens": 8}
QUICK = {"vllm_requests": 1, "vllm_max_tokens": 4}
ALONE, PUSH = "alone", "hixl-push"
TARGET = Target("<=", 1.5)  # push mode's exposed transfer: at most 1.5 layers' transfers (issue 37)
TRANSFER_TIMEOUT = 30.0
PD, ALONE_SHAPE = SHAPES["1p1d"], Shape("alone", (1,), ())

TTFT = "time to first token, median"
EXPOSED = "exposed transfer (TTFT - alone's), median"
LAYER_TRANSFER = "one layer's KV transfer (transfer_sync), median"
LAYER_COMPUTE = "one layer's compute (alone's TTFT / layers)"
RECORDS_TIMEOUT = 10.0  # seconds for a request's records to be written (decode's after its windows are withdrawn)
#: hixl-push's phases, in order (they add up to the TTFT): name -> (from, to), each point a record's
#: (``sent``: the bench sent the request; ``first``: its first token came; else ``role.field``, ``prefill.computed``
#: being prefill's last layer computed).
PHASES = {
    "proxy to decode's grant": ("sent", "decode.start"),
    "grant to grants sent (windows opened)": ("decode.start", "decode.issued"),
    "grants sent to prefill's first step": ("decode.issued", "prefill.start"),
    "prefill's forward": ("prefill.start", "prefill.computed"),
    "transfer tail (last layer computed to every byte in)": ("prefill.computed", "decode.usable"),
    "windows withdrawn": ("decode.usable", "decode.reported"),
    "decode's way to the first token": ("decode.reported", "first"),
}
TAIL = "transfer tail (last layer computed to every byte in)"


@dataclass(frozen=True)
class Contender:
    """A deployment to time: its connector (None: the prefill alone, asked directly) and the proxy's extra flags."""

    name: str
    connector: Connector | None
    proxy_flags: tuple[str, ...] = ()


def contenders() -> tuple[list[Contender], list[str]]:
    """Alone, hixl pull, hixl push, then NIXL if it is installed; and notes on what was left out."""
    hixl = CONNECTORS["hixl"]
    push = {**hixl.config, "kv_connector_extra_config": {"mode": "push"}}
    found = [
        Contender(ALONE, None),
        Contender("hixl-pull", replace(hixl, name="hixl-pull")),
        Contender(PUSH, replace(hixl, name=PUSH, config=push), ("--kv-mode", "push")),
    ]
    if (reason := nixl_missing()) is not None:
        return found, [f"vllm overlap: {reason}"]
    return [*found, Contender("nixl", CONNECTORS["nixl"])], []


def knobs(config: BenchConfig) -> tuple[tuple[int, ...], dict[str, int]]:
    """The prompt lengths (``vllm_lengths``, else the defaults, ``--quick``'s) and ``vllm_requests`` /
    ``vllm_max_tokens`` per length; ValueError for a request longer than the scenario takes, or a ``vllm_model``
    that is not a local model folder (its ``config.json`` gives the layers and KV sizes the rows need)."""
    given = config.extra.get("vllm_lengths")
    lengths = tuple(given) if isinstance(given, (tuple, list)) else (QUICK_LENGTHS if config.quick else LENGTHS)
    base = QUICK if config.quick else DEFAULTS
    chosen = {key: given if isinstance(given := config.extra.get(key), int) else value for key, value in base.items()}
    if max(lengths) + chosen["vllm_max_tokens"] > LONGEST:
        raise ValueError(
            f"vllm --overlap: {max(lengths)} prompt + {chosen['vllm_max_tokens']} generated tokens exceed the scenario's "
            f"longest request, {LONGEST} tokens"
        )
    if given_model := config.extra.get("vllm_model"):
        layer_sizes(Path(str(given_model)))
    return lengths, chosen


def describe(config: BenchConfig) -> str:
    """A few words for the run's header line."""
    lengths, chosen = knobs(config)
    model = config.extra.get("vllm_model") or "the wide test Llama"
    return (
        f"vllm overlap on {model}: {chosen['vllm_requests']} requests per length of {','.join(map(str, lengths))} prompt "
        f"+ {chosen['vllm_max_tokens']} generated tokens, alone / pull / push / nixl"
    )


def layer_sizes(model: Path) -> Sizes:
    """The layout of a Hugging Face Llama-like checkpoint in ``model`` (its ``config.json``)."""
    try:
        config = json.loads((model / "config.json").read_text())
    except OSError as exc:
        raise ValueError(f"vllm --overlap needs a model folder with a config.json, not {model}: {exc}") from exc
    heads = int(config["num_attention_heads"])
    return Sizes(
        layers=int(config["num_hidden_layers"]),
        heads=heads,
        kv_heads=int(config.get("num_key_value_heads", heads)),
        head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
        hidden=int(config["hidden_size"]),
        intermediate=int(config["intermediate_size"]),
        positions=int(config.get("max_position_embeddings", MAX_MODEL_LEN)),
    )


def _layer_transfers(nbytes: list[int], config: BenchConfig) -> tuple[str, dict[int, float]]:
    """Seconds of one ``transfer_sync`` READ of each byte count from a bench target (median of ``repeat``),
    and the transport hixl picked for it."""
    seconds: dict[int, float] = {}
    with BenchTarget() as target:
        engine = Engine("127.0.0.1")
        try:
            engine.connect(target.engine, timeout=TRANSFER_TIMEOUT)
            for n in nbytes:
                local = empty(n)
                local.fill(0x11)  # every page resident before anything is timed
                handle = engine.register_mem(local)
                remote = target.alloc(n)
                try:
                    desc = [TransferOpDesc(int(local.ctypes.data), remote.addr, n)]

                    def copy(desc: list[TransferOpDesc] = desc) -> None:
                        engine.transfer_sync(target.engine, Op.READ, desc, TRANSFER_TIMEOUT)

                    times = interleaved_reps({"layer": copy}, 1, config.repeat, max(1, config.warmup))["layer"]
                    seconds[n] = median(times) / 1e9
                finally:
                    target.free(remote)
                    engine.deregister_mem(handle)
            return engine.transport_of(target.engine), seconds
        finally:
            engine.finalize()


def cpu_shares(alone: bool, cpus: list[int]) -> list[str]:
    """Each server's ``VLLM_CPU_OMP_THREADS_BIND``: 1P1D's shares of ``cpus``; alone's prefill gets 1P1D's prefill's
    share, not every CPU: the same compute, less the transfer."""
    shares = cpu_binds([tp for _, tp in PD.instances()], cpus)
    return shares[:1] if alone else shares


def push_phases(sent: float, ttft: float, records: list[dict[str, Any]]) -> dict[str, float]:
    """One pushed request's :data:`PHASES` in milliseconds, from the time it was sent (``time.monotonic()``), its TTFT
    (seconds) and both servers' records of it (one decode rank, one prefill rank)."""
    (decode,) = [r for r in records if r["role"] == "decode"]
    (prefill,) = [r for r in records if r["role"] == "prefill"]
    points = {"sent": sent, "first": sent + ttft, "prefill.computed": prefill["layers"][-1][1]}
    points.update({f"{role}.{key}": record[key] for role, record in (("decode", decode), ("prefill", prefill)) for key in ("start", "issued", "usable", "reported")})
    return {name: (points[end] - points[begin]) * 1e3 for name, (begin, end) in PHASES.items()}


def _records(path: Path, request_id: str) -> list[dict[str, Any]]:
    """The push's records of request ``request_id`` (decode's and prefill's), waiting for both; RuntimeError if
    they do not come, or say it failed."""
    deadline = time.monotonic() + RECORDS_TIMEOUT
    while True:
        lines = path.read_text().splitlines() if path.exists() else []
        found = [r for r in map(json.loads, lines) if r["client_id"] == request_id]
        if {r["role"] for r in found} == {"decode", "prefill"}:
            failed = [r["outcome"] for r in found if r["outcome"] != "ok"]
            if failed:
                raise RuntimeError(f"request {request_id}'s push failed: {failed[0]}")
            return found
        if time.monotonic() > deadline:
            raise RuntimeError(f"no push records of request {request_id} in {RECORDS_TIMEOUT} s (found {found})")
        time.sleep(0.05)


def _measure(
    contender: Contender, model: str, folder: Path, lengths: tuple[int, ...], chosen: dict[str, int], warmup: int,
    progress: Progress,
) -> tuple[dict[int, list[float]], dict[int, list[dict[str, float]]]]:  # fmt: skip
    """Each length's measured TTFTs (seconds) on fresh servers, and hixl-push's phases per request (:func:`push_phases`;
    empty for the others); ShapeFailed if they cannot serve."""
    connector = contender.connector
    records = folder / "records.jsonl"
    if contender.name == PUSH and connector is not None:  # both servers record each push
        extra = {**connector.config["kv_connector_extra_config"], "records": str(records)}
        connector = replace(connector, config={**connector.config, "kv_connector_extra_config": extra})
    shape = ALONE_SHAPE if connector is None else PD
    binds = cpu_shares(connector is None, sorted(os.sched_getaffinity(0)))
    max_len = max(MAX_MODEL_LEN, max(lengths) + chosen["vllm_max_tokens"])
    flags: Callable[[Deployment], dict[str, list[str]]] | None = (
        (lambda _: {"proxy": list(contender.proxy_flags)}) if contender.proxy_flags else None
    )
    folder.mkdir()
    what = f"vllm overlap {contender.name}"
    with progress.step(f"{what}: start {', '.join(n for n, _ in shape.instances())}" + (", proxy" if connector else "")):
        deployment = Deployment(connector, shape, model, folder, max_len, flags=flags, timeline=False, binds=binds)
    url = deployment.url("prefill0" if connector is None else "proxy")
    seed = itertools.count()  # every request its own prompt: no prefix-cache hits, the same requests for each contender
    try:
        with progress.step(f"{what}: wait for /health"):
            deployment.wait_ready()
        with progress.step(f"{what}: {chosen['vllm_requests']} requests per length"):
            ttfts: dict[int, list[float]] = {}
            phases: dict[int, list[dict[str, float]]] = {}
            for length in lengths:
                ttfts[length], phases[length] = [], []
                for i in range(warmup + chosen["vllm_requests"]):
                    request_id = f"overlap-{contender.name}-{length}-{i}"
                    sent = time.monotonic()
                    ttft = first_token(url, model, prompt(length, next(seed)), chosen["vllm_max_tokens"], request_id)
                    if i < warmup:
                        continue
                    ttfts[length].append(ttft)
                    if contender.name == PUSH:
                        phases[length].append(push_phases(sent, ttft, _records(records, request_id)))
    except (RuntimeError, OSError) as exc:
        raise ShapeFailed(contender.name, shape, _reason(exc, deployment)) from exc
    finally:
        deployment.close()
    return ttfts, {length: found for length, found in phases.items() if found}


def rows(
    sizes: Sizes, transport: str, transfers: Mapping[int, float], ttfts: Mapping[str, Mapping[int, list[float]]],
    phases: Mapping[int, list[dict[str, float]]] | None = None,
) -> list[Row]:
    """The rows (see the module docstring) from each length's layer transfer (seconds), each contender's TTFTs
    (seconds, by length; a contender that failed is absent) and hixl-push's phases (milliseconds, by length, per
    request). Without alone's, no exposed transfer, no compute."""
    out: list[Row] = []
    alone = ttfts.get(ALONE, {})
    for length, layer in transfers.items():
        op, request = f"{length} tok", sizes.kv_bytes(length, sizes.layers)
        layer_ms = layer * 1e3
        note = f"{sizes.layers} layers, {sizes.kv_bytes(length) / 2**20:.3g} MiB of KV a layer"
        out.append(Row(LAYER_TRANSFER, transport, op, sizes.kv_bytes(length), layer_ms, "ms", scenario="vllm", note=note))
        base = median(alone[length]) * 1e3 if length in alone else None
        if base is not None:
            out.append(
                Row(
                    LAYER_COMPUTE, ALONE, op, None, base / sizes.layers, "ms", layer_ms, "one layer's transfer",
                    scenario="vllm", note="the ratio: how many layers' transfers one layer's compute can hide",
                )
            )  # fmt: skip
        for name, by_length in ttfts.items():
            if length not in by_length:
                continue
            ttft = median(by_length[length]) * 1e3
            count = f"{len(by_length[length])} requests"
            if name == ALONE or base is None:
                out.append(Row(TTFT, name, op, request, ttft, "ms", scenario="vllm", note=count))
                continue
            out += [
                Row(TTFT, name, op, request, ttft, "ms", base, ALONE, scenario="vllm", note=count),
                Row(
                    EXPOSED, name, op, request, ttft - base, "ms", layer_ms, "one layer's transfer",
                    TARGET if name == PUSH else None, "vllm", f"{count}; the ratio: in layers' transfers",
                ),
            ]  # fmt: skip
        for phase in PHASES if (phases or {}).get(length) else ():
            value = statistics.median(found[phase] for found in (phases or {})[length])
            tail = phase == TAIL
            out.append(
                Row(
                    f"{PUSH} phase: {phase}, median", PUSH, op, request, value, "ms", layer_ms if tail else None,
                    "one layer's transfer" if tail else "", scenario="vllm",
                    note=f"{len((phases or {})[length])} requests" + ("; the ratio: in layers' transfers" if tail else ""),
                )
            )  # fmt: skip
    return out


def run(config: BenchConfig, progress: Progress) -> ScenarioResult:
    """Time the layer's transfer, then each contender on fresh servers; rows per length (see the module docstring)."""
    lengths, chosen = knobs(config)
    found, notes = contenders()
    progress.expect(2 + 3 * len(found))
    ttfts: dict[str, dict[int, list[float]]] = {}
    phases: dict[int, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="hixl-bench-overlap-") as tmp:
        with progress.step("vllm overlap: the model"):
            given = config.extra.get("vllm_model")
            model = Path(str(given)) if given else build(Path(tmp) / "model", sizes=WIDE)
            sizes = layer_sizes(model)
        with progress.step("vllm overlap: one layer's transfer_sync"):
            transport, transfers = _layer_transfers([sizes.kv_bytes(n) for n in lengths], config)
        for contender in found:
            try:
                ttfts[contender.name], its_phases = _measure(
                    contender, str(model), Path(tmp) / contender.name, lengths, chosen, config.warmup, progress
                )
                phases.update(its_phases)
            except ShapeFailed as exc:
                notes.append(f"vllm overlap: {contender.name}'s servers could not serve it: {exc.reason}")
    by_length = {n: transfers[sizes.kv_bytes(n)] for n in lengths}
    notes += [
        (
            "vllm overlap: exposed transfer = a contender's median TTFT - alone's (one vLLM server, no connector, on "
            "the CPUs 1P1D's prefill gets); its ratio = that over one layer's transfer_sync (float32 KV, one descriptor)"
        ),
        "vllm overlap: one layer's compute = alone's median TTFT / layers (the first token's whole path, shared out)",
        (
            "vllm overlap: hixl-push's phases add up to its TTFT; the transfer tail is the part of the transfer no compute "
            "hid (prefill's last layer computed to decode holding every byte), the rest of TTFT - alone's is the PD path"
        ),
        "vllm overlap: servers on a shared CPU machine: indicative figures",
    ]
    return ScenarioResult(rows(sizes, transport, by_length, ttfts, phases), notes)
