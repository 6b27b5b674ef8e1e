"""``hixl demo``: prefill/decode-disaggregated generation on a real transformer.

Three processes: this one (the router: it builds the reference, hands out
block ids and relays the first token, as a serving proxy would), a prefill
instance and a decode instance (:mod:`hixl.demo.worker`). The KV cache moves
between the two instances through DataDist — pulled layer by layer by decode,
or pushed layer by layer by prefill while it is still computing — and the
generated tokens must equal a colocated, single-process generation. With
``hosts``, prefill and decode run on two :class:`hixl.testing.hosts.Hosts`
(network and PID namespaces of their own): the KV cache crosses a network.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .._tools import plot as _plot
from .._tools.child import ChildProcess
from ..testing.hosts import Host, Hosts, hosts_unavailable
from .report import format_report

_IMPORTED = time.monotonic()  # see _command_start
_PYTHON_START_MAX = 5.0  # seconds from exec to this import: the interpreter and numpy, on a busy slow machine

PREFILL_CLUSTER, DECODE_CLUSTER = 1, 2


@dataclass(frozen=True)
class DemoConfig:
    """What ``hixl demo`` runs (its command-line options)."""

    tokens: int = 32
    prompt_len: int = 512
    layers: int = 4
    block_size: int = 16
    transport: str = "auto"
    mode: str = "pull"
    seed: int = 0
    hosts: bool = False
    """Prefill and decode on two hosts (network and PID namespaces of their own), not on this one."""


class _Worker:
    """The router's handle on one worker process."""

    def __init__(self, setup: dict[str, Any], host: Host | None) -> None:
        self.child = ChildProcess("hixl.demo.worker", timeout=120.0, prefix=host.prefix if host is not None else ())
        self.child.send({**setup, "ip": host.ip if host is not None else "127.0.0.1"})

    def ready(self) -> dict[str, Any]:
        return self.child.receive()  # type: ignore[no-any-return]

    def call(self, command: str, **kwargs: Any) -> Any:
        status, value = self.child.request((command, kwargs))
        if status != "ok":
            raise RuntimeError(f"{command} failed in the worker: {value}")
        return value

    def close(self) -> None:
        self.child.close(goodbye=("exit", {}))


def _colocated(cfg: DemoConfig, spec_kwargs: dict[str, Any], prompt: list[int], num_blocks: int) -> dict[str, Any]:
    """Reference tokens (transformers' own generate) and a single-process timeline (seconds from its start)."""
    import torch

    from .model import ModelSpec, PagedKVCache, build_model, colocated_generate, decode, prefill

    torch.set_num_threads(1)  # like each worker: a fair comparison on a small machine
    spec = ModelSpec(**spec_kwargs)
    model = build_model(spec)
    reference = colocated_generate(model, prompt, cfg.tokens)
    cache = PagedKVCache(spec, num_blocks, cfg.block_size)
    blocks = list(range(cache.blocks_for(len(prompt))))
    token_times: list[float] = []
    layer_done: list[float] = []
    start = time.monotonic()
    first = prefill(model, prompt, cache, blocks, on_layer_done=lambda _: layer_done.append(time.monotonic() - start))
    computed = time.monotonic()
    tokens = decode(model, first, len(prompt), cache, blocks, cfg.tokens, on_token=lambda _: token_times.append(time.monotonic()))
    end = time.monotonic()
    return {"reference": reference, "tokens": tokens, "prefill": computed - start, "ttft": computed - start,
            "t2": (token_times[0] - start) if token_times else None, "total": end - start, "layer_done": layer_done}


def _quiet(message: str) -> None:
    """The default ``progress`` of :func:`run_demo`: say nothing."""


def run_demo(cfg: DemoConfig, progress: Callable[[str], None] = _quiet) -> dict[str, Any]:
    """Run the demo and return its measurements (see :func:`format_report`).

    ``progress`` is called with a line of text as each stage starts (the
    command prints them, so the seconds of model building are not silent).
    """
    from .model import ModelSpec, make_prompt

    spec = ModelSpec(num_layers=cfg.layers, seed=cfg.seed)
    spec_kwargs = asdict(spec)
    prompt = make_prompt(spec, cfg.prompt_len, cfg.seed)
    needed = -(-cfg.prompt_len // cfg.block_size)
    num_blocks = needed * 2  # room to scatter: the blocks a request gets are not contiguous
    push = cfg.mode == "push"
    what = f"each builds the {cfg.layers}-layer model and warms it up"
    if cfg.hosts:
        what += "; a host is network and PID namespaces of its own, joined to the other's by veth pairs"
    progress(f"starting the prefill and decode processes{' on two hosts' if cfg.hosts else ''} ({what})")
    began = time.monotonic()
    # Engines listening on another host's address talk only with a secret: a fresh one for the run.
    options = {"auth_secret": secrets.token_hex(16)} if cfg.hosts else {}
    common = {
        "spec": spec_kwargs, "num_blocks": num_blocks, "block_size": cfg.block_size, "transport": cfg.transport,
        "threads": 1, "engine_options": options,
    }  # fmt: skip
    with Hosts(2, pid_namespaces=[0, 1]) if cfg.hosts else contextlib.nullcontext() as hosts:
        prefill_host, decode_host = hosts.hosts if hosts is not None else (None, None)
        prefill_w = _Worker({"role": "PROMPT", "cluster_id": PREFILL_CLUSTER, "listen": not push, **common}, prefill_host)
        decode_w = _Worker({"role": "DECODER", "cluster_id": DECODE_CLUSTER, "listen": push, **common}, decode_host)
        # The side that linked closes first, so its peer never sees a vanished link.
        workers = [prefill_w, decode_w] if push else [decode_w, prefill_w]
        try:
            prefill_info, decode_info = prefill_w.ready(), decode_w.ready()
            progress(f"both ready {time.monotonic() - began:.1f} s after they were started; timing the colocated reference (one process)")
            # Timed only once both workers are idle: the machine is small.
            colocated = _colocated(cfg, spec_kwargs, prompt, num_blocks)
            rng = np.random.default_rng(cfg.seed)
            src_blocks = sorted(rng.choice(num_blocks, needed, replace=False).tolist())
            dst_blocks = rng.permutation(num_blocks)[:needed].tolist()
            progress(f"linking {'prefill -> decode' if push else 'decode -> prefill'} (the side that links moves the data)")
            if push:
                link = prefill_w.call("link", ip_info=decode_info["ip_info"], cluster_id=DECODE_CLUSTER)
            else:
                link = decode_w.call("link", ip_info=prefill_info["ip_info"], cluster_id=PREFILL_CLUSTER)
            if link["status"] != "SUCCESS":
                raise RuntimeError(f"link failed: {link['status']}")
            req_id = 1
            progress(
                f"one request: prefill computes {cfg.prompt_len} prompt tokens, "
                f"{'prefill pushes' if push else 'decode pulls'} the KV cache, decode generates {cfg.tokens} tokens"
            )
            start = time.monotonic()
            pre = prefill_w.call(
                "prefill", prompt=prompt, block_ids=src_blocks, req_id=req_id,
                push_to={"cluster_id": DECODE_CLUSTER, "dst_blocks": dst_blocks} if push else None,
            )
            dec = decode_w.call(
                "decode", first_token=pre["first_token"], prompt_len=cfg.prompt_len, block_ids=dst_blocks,
                num_tokens=cfg.tokens, req_id=req_id,
                pull_from=None if push else {"cluster_id": PREFILL_CLUSTER, "src_blocks": src_blocks},
            )
            end = time.monotonic()
            notified = _await_completion(decode_w if push else prefill_w, req_id)
            progress(f"done; closing the workers ({time.monotonic() - began:.1f} s since they were started)")
        finally:
            closing = time.monotonic()
            for worker in workers:
                worker.close()
    shutdown = time.monotonic() - closing  # the workers' exit, and with hosts their removal too
    landed = pre["landed"] if push else dec["landed"]
    transfer_start = pre["start"] if push else dec["start"]
    kv_bytes = needed * cfg.block_size * spec.num_kv_heads * spec.head_dim * 4 * 2 * cfg.layers
    return {
        "config": asdict(cfg),
        "transport": link["transport"],
        "kv_bytes": kv_bytes,
        "reference": colocated["reference"],
        "tokens": dec["tokens"],
        "identical": dec["tokens"] == colocated["reference"],
        "colocated_matches_reference": colocated["tokens"] == colocated["reference"],
        "completion_notified": notified,
        "shutdown": shutdown,
        "colocated": {k: colocated[k] for k in ("prefill", "ttft", "t2", "total")},
        "disaggregated": {
            "prefill": pre["computed"] - pre["start"],
            "transfer": max(landed) - transfer_start,
            "first_layer_landed": landed[0] - transfer_start,
            # Push overlaps compute: what counts is how long after the last layer was computed the data landed.
            "tail_after_compute": max(0.0, max(landed) - pre["computed"]) if push else None,
            "decode_layer0_start": (dec["usable"][0] - start) if dec["usable"] else None,
            "layers_landed": [t - transfer_start for t in landed],
            "ttft": pre["computed"] - start,
            "t2": dec["token_times"][0] - start if dec["token_times"] else None,
            "total": end - start,
        },
        # Points in time, seconds since the request arrived, for the --plot timeline.
        "timeline": {
            "colocated": {k: colocated[k] for k in ("layer_done", "ttft", "t2")},
            "disaggregated": {
                "layer_done": [t - start for t in pre["layer_done"]],
                "transfer_start": transfer_start - start,
                "landed": [t - start for t in landed],
                "decode_layers": [dec["usable"][i] - start for i in sorted(dec["usable"])],
                "ttft": pre["computed"] - start,
                "t2": dec["token_times"][0] - start if dec["token_times"] else None,
            },
        },
    }


def _await_completion(worker: _Worker, req_id: int, timeout: float = 5.0) -> bool:
    """Whether the completion notification for ``req_id`` reached ``worker``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(r == req_id for _, r, _ in worker.call("completed")):
            return True
        time.sleep(0.01)
    return False


DESCRIPTION = """\
Prefill/decode-disaggregated generation on a small real transformer (a seeded
Llama-architecture model from transformers; nothing is downloaded). Three
processes: this router, a prefill instance and a decode instance. Decode pulls
the prompt's KV cache layer by layer while it starts its first step (--mode pull),
or prefill pushes each layer as soon as it is computed (--mode push). With
--hosts, prefill and decode run on two "hosts" (network and PID namespaces of
their own, joined by veth pairs and a bridge; needs root), so the KV cache
crosses a network, over TCP, as between machines. The tokens
must equal a colocated single-process generation (exit status 1 if they differ or
the completion notification is missing). Progress goes to stderr; the timeline
table, with a legend, to stdout. Needs the 'demo' extra (torch, transformers).
"""


def add_parser(subparsers: Any) -> None:
    """Register ``hixl demo``."""
    parser = subparsers.add_parser(
        "demo",
        help="PD-disaggregated generation on a small real transformer",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    defaults = DemoConfig()
    number = {"type": int, "metavar": "N"}
    parser.add_argument("--tokens", default=defaults.tokens, **number, help="tokens to generate (default: %(default)s)")
    parser.add_argument(
        "--prompt-len", default=defaults.prompt_len, **number, help="prompt length in tokens (default: %(default)s)"
    )
    parser.add_argument("--layers", default=defaults.layers, **number, help="decoder layers (default: %(default)s)")
    parser.add_argument(
        "--block-size", default=defaults.block_size, **number, help="tokens per KV block (default: %(default)s)"
    )
    parser.add_argument(
        "--transport",
        default=defaults.transport,
        choices=["auto", "cma", "tcp"],
        help="engine transport (default: %(default)s)",
    )
    parser.add_argument(
        "--mode",
        default=defaults.mode,
        choices=["pull", "push"],
        help="who moves the KV cache: decode pulls or prefill pushes (default: %(default)s)",
    )
    parser.add_argument("--seed", default=defaults.seed, **number, help="model and prompt seed (default: %(default)s)")
    parser.add_argument(
        "--hosts",
        action="store_true",
        help="run prefill and decode on two hosts: network and PID namespaces of their own, joined by veth pairs "
        "(the KV cache crosses a network, over TCP; needs root)",
    )
    parser.add_argument(
        "--plot",
        metavar="FILE",
        help="also draw the request's timeline, colocated vs disaggregated, to FILE "
        "(.png, .svg, .pdf; needs the 'plot' extra)",
    )
    parser.set_defaults(run=_main)


def _progress(message: str) -> None:
    print(f"hixl demo: {message} ...", file=sys.stderr, flush=True)


def _command_start() -> float:
    """When the command started, on the monotonic clock the phases use.

    By the kernel's record of this process's start, not by a clock read in this module: the
    interpreter's start and the imports before hixl's first line ran belong to what the user
    waited for. But a shell that ran ``hixl demo`` as its last command (``bash -c "...; hixl
    demo"``) exec'd it in its own process, whose start is the shell's: when the process is older
    than this module's import by more than Python ever takes to get here, it was something else
    first, and the command starts at the import.
    """
    with open("/proc/self/stat") as stat:
        # Field 22, starttime, in clock ticks after boot. Fields are counted after the command
        # name's closing parenthesis: the name itself may hold spaces and parentheses.
        start_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    process_start = time.monotonic() - age
    return process_start if _IMPORTED - process_start <= _PYTHON_START_MAX else _IMPORTED


def _main(args: argparse.Namespace) -> int:
    started = _command_start()
    # Every check that needs no torch comes first: a mistake is reported at once, not after seconds of imports.
    for name in ("tokens", "prompt_len", "layers", "block_size"):
        if getattr(args, name) < 1:
            print(f"hixl demo: error: --{name.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    if args.plot and not _plot.plotting_available():
        print(f"hixl demo: error: {_plot.MISSING}", file=sys.stderr)
        return 2
    if args.hosts and args.transport == "cma":
        print("hixl demo: error: --hosts puts prefill and decode in different PID namespaces: cma cannot cross them", file=sys.stderr)
        return 2
    if args.hosts and (reason := hosts_unavailable()) is not None:
        print(f"hixl demo: error: --hosts: {reason}", file=sys.stderr)
        return 2
    _progress("loading torch and transformers")
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        print("hixl demo: error: it needs torch and transformers: pip install 'hixl[demo]'", file=sys.stderr)
        return 2
    cfg = DemoConfig(
        args.tokens, args.prompt_len, args.layers, args.block_size, args.transport, args.mode, args.seed, args.hosts
    )
    loaded = time.monotonic()
    result = run_demo(cfg, _progress)
    closed = time.monotonic()
    print(format_report(result))
    if args.plot:
        from .plot import plot_timeline

        plot_timeline(result, args.plot)
        print(f"plot written to {args.plot} ({time.monotonic() - closed:.1f} s)")
    sys.stdout.flush()  # the report comes before the summary below, also when stdout is a pipe
    print(
        f"hixl demo: {time.monotonic() - started:.1f} s in all, from the command's start to its end: "
        f"{loaded - started:.1f} s starting Python and loading torch and transformers, "
        f"{closed - loaded - result['shutdown']:.1f} s running the demo, "
        f"{result['shutdown']:.1f} s waiting for the workers to exit",
        file=sys.stderr,
    )
    return 0 if result["identical"] and result["completion_notified"] else 1
