"""Other engines' figures next to hixl's: NIXL and Mooncake, when they are installed.

hixl never imports either. The project's peers folder (``setup.sh``, ``run.sh`` and one
benchmark script per engine; default ``../shared/peers`` beside the source checkout, or
``$HIXL_PEERS_DIR``) installs them in private virtual environments (under ``$PEERS``,
default ``~/.cache/hixl-peers``) and runs their benchmarks, which measure what the engine
scenario measures and write it as JSON. ``hixl bench --compare nixl,mooncake`` runs
``run.sh NAME --json FILE`` for each after hixl's own measurements (alone: never beside
them); ``--peer-json FILE`` reads a file ``run.sh`` wrote before. Either way the figures
become :class:`PeerFigure`\\ s in hixl's units (GiB/s, µs), keyed like the engine
scenario's rows (name, op, size), and :func:`hixl.bench.report.format_peers` puts them in
columns beside hixl's. An engine that is not installed is reported so, never guessed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "ENGINES",
    "PeerEngine",
    "PeerFigure",
    "PeerResult",
    "default_install_dir",
    "default_peers_dir",
    "not_installed",
    "read_peer_json",
    "run_peer",
]

GiB = 1 << 30
RUN_TIMEOUT = 1200.0
"""Seconds a peer's whole benchmark may take (Mooncake's failing batch alone waits ~4 x 60 s)."""


@dataclass(frozen=True)
class PeerFigure:
    """One figure of another engine, named like the engine scenario's row it stands beside.

    ``value`` is None where the engine failed to produce it (``note`` says how)."""

    name: str
    op: str
    size: int
    value: float | None
    unit: str
    note: str = ""


@dataclass(frozen=True)
class PeerResult:
    """What is known of one engine: its figures, and where they came from (``status``)."""

    engine: str
    status: str
    """``measured``, ``read from FILE``, ``not installed (...)`` or ``failed (...)``."""
    figures: list[PeerFigure] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (the ``--json`` file's ``peers`` entries)."""
        spec = ENGINES[self.engine]
        return {
            "engine": self.engine,
            "label": spec.label,
            "compared_with": spec.like,
            "timed": spec.timed,
            "status": self.status,
            "figures": [vars(f) for f in self.figures],
        }


def _gib_per_s(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / GiB


def _parse_nixl(doc: dict[str, Any]) -> list[PeerFigure]:
    """``nixl_bench.py --json``: a prepared transfer handle reposted (bandwidth, latency, batch)."""
    run = doc.get("run", {})
    if not run.get("ok", False):
        raise ValueError(f"the NIXL run failed: {str(run.get('error', 'no result')).strip().splitlines()[-1:]}")
    figures = [
        PeerFigure("bandwidth", r["op"], r["size"], _gib_per_s(r["size"], r["median_us"] / 1e6), "GiB/s")
        for r in run.get("bandwidth", [])
    ]
    for r in run.get("latency", []):
        figures.append(PeerFigure("latency median", r["op"], r["size"], r["median_us"], "us"))
        figures.append(PeerFigure("latency p99", r["op"], r["size"], r["p99_us"], "us"))
    for r in run.get("batch", []):
        seconds = r["repost_median_ms"] / 1e3
        figures.append(PeerFigure("batch", r["op"], r["total_bytes"], _gib_per_s(r["total_bytes"], seconds), "GiB/s"))
    return figures


def _parse_mooncake(doc: dict[str, Any]) -> list[PeerFigure]:
    """``mooncake_bench.py --json``: ``transfer_sync_read/write`` and ``batch_transfer_sync``."""
    figures = []
    for r in doc.get("bandwidth", []):
        for op in ("read", "write"):
            if op in r:
                figures.append(
                    PeerFigure("bandwidth", op.upper(), r["size"], _gib_per_s(r["size"], r[op]["med_s"]), "GiB/s")
                )
    for r in doc.get("latency", []):
        figures.append(PeerFigure("latency median", r["op"].upper(), r["size"], r["med_us"], "us"))
        figures.append(PeerFigure("latency p99", r["op"].upper(), r["size"], r["p99_us"], "us"))
    blocks, block = 4096, 16 << 10  # mooncake_bench.py's BATCH_N x BATCH_LEN (its --batch-n is not recorded)
    for r in doc.get("batch", []):
        if not r["name"].startswith("batch_transfer_sync "):
            continue  # (its async variants time the same transfers)
        op = r["name"].split()[-1]
        ok = not r.get("failed_calls")
        value = _gib_per_s(blocks * block, r["med_s"]) if ok else None
        note = "" if ok else f"its batch failed, rc={r.get('bad_rc')}"
        figures.append(PeerFigure("batch", op, blocks * block, value, "GiB/s", note))
    return figures


@dataclass(frozen=True)
class PeerEngine:
    """An engine ``--compare`` knows: how the peers folder installs and runs it, and how to read its JSON."""

    name: str
    label: str
    """Its column's heading."""
    venv: str
    """Its virtual environment under the install folder (what ``setup.sh`` makes)."""
    like: str
    """The hixl transport it does the same job as (a same-host copy, or TCP)."""
    timed: str
    """What its benchmark times, in a few words (printed under the table)."""
    parse: Callable[[dict[str, Any]], list[PeerFigure]]
    marker: str
    """A key only its benchmark's JSON has at the top level (how a ``--peer-json`` file is recognised)."""


ENGINES: dict[str, PeerEngine] = {
    "nixl": PeerEngine(
        "nixl", "NIXL (UCX cma)", "nixl-venv", "cma", "a prepared transfer handle reposted", _parse_nixl, "nixl_version"
    ),
    "mooncake": PeerEngine(
        "mooncake",
        "Mooncake (TCP)",
        "mooncake-noncuda-venv",
        "tcp",
        "transfer_sync_read/write, batch_transfer_sync",
        _parse_mooncake,
        "protocol",
    ),
}


def default_peers_dir() -> Path:
    """``$HIXL_PEERS_DIR``, else ``../shared/peers`` beside the checkout hixl is imported from."""
    env = os.environ.get("HIXL_PEERS_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2].parent / "shared" / "peers"


def default_install_dir() -> Path:
    """Where ``setup.sh`` puts the virtual environments (and ``run.sh`` looks): ``$PEERS`` or
    ``~/.cache/hixl-peers``."""
    env = os.environ.get("PEERS")
    return Path(env) if env else Path.home() / ".cache" / "hixl-peers"


def not_installed(engine: str, peers_dir: Path, install_dir: Path | None = None) -> str | None:
    """Why ``engine`` cannot be run from ``peers_dir`` (``install_dir``: :func:`default_install_dir`),
    or None when it can."""
    install_dir = install_dir or default_install_dir()
    run_sh = peers_dir / "run.sh"
    if not run_sh.is_file():
        return f"not installed (no {run_sh}: give --peers-dir, the folder with the peers' setup.sh and run.sh)"
    python = install_dir / ENGINES[engine].venv / "bin" / "python"
    if not python.exists():
        return f"not installed (no {python}: run {peers_dir / 'setup.sh'} once)"
    return None


def run_peer(
    engine: str,
    peers_dir: Path,
    *,
    quick: bool = False,
    sizes: Sequence[int] = (),
    install_dir: Path | None = None,
    timeout: float = RUN_TIMEOUT,
) -> PeerResult:
    """Run ``engine``'s benchmark (``run.sh ENGINE [--quick] --json FILE``) and read its figures.

    ``sizes``: bandwidth sizes to ask for, where the engine's benchmark takes them (Mooncake's;
    NIXL's are fixed). Never raises for the engine's own failures: they are its ``status``.
    """
    install_dir = install_dir or default_install_dir()
    reason = not_installed(engine, peers_dir, install_dir)
    if reason is not None:
        return PeerResult(engine, reason)
    args = ["--quick"] if quick else []
    if sizes and engine == "mooncake" and not quick:
        args += ["--sizes", ",".join(str(max(1, s >> 10)) for s in sizes)]
    with tempfile.TemporaryDirectory(prefix=f"hixl-bench-{engine}-") as tmp:
        out = Path(tmp) / f"{engine}.json"
        env = {**os.environ, "PEERS": str(install_dir)}
        command = ["bash", str(peers_dir / "run.sh"), engine, *args, "--json", str(out)]
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
        )
        try:
            log, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the benchmark's children go too
            proc.communicate()
            return PeerResult(engine, f"failed (did not finish within {timeout:g} s)")
        if not out.exists():
            last = [line for line in log.splitlines() if line.strip()][-1:]
            return PeerResult(engine, f"failed (exit status {proc.returncode}, no JSON written: {' '.join(last)})")
        try:
            figures = ENGINES[engine].parse(json.loads(out.read_text()))
        except (ValueError, KeyError, TypeError) as exc:
            return PeerResult(engine, f"failed ({exc})")
    status = "measured" if proc.returncode == 0 else f"measured, exit status {proc.returncode} (a check failed)"
    return PeerResult(engine, status, figures)


def read_peer_json(path: str | Path) -> PeerResult:
    """The figures in a JSON file that ``run.sh nixl|mooncake --json FILE`` wrote.

    Raises ``ValueError`` (with the file's name) for a file that is not one.
    """
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--peer-json {path}: cannot read it as JSON ({exc})") from exc
    engines = [e for e in ENGINES.values() if isinstance(doc, dict) and e.marker in doc]
    if len(engines) != 1:
        raise ValueError(
            f"--peer-json {path}: not a file written by the peers' run.sh nixl|mooncake --json "
            f"(no top-level {' or '.join(repr(e.marker) for e in ENGINES.values())})"
        )
    engine = engines[0]
    try:
        figures = engine.parse(doc)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"--peer-json {path}: a {engine.label} file without the expected fields ({exc!r})") from exc
    except ValueError as exc:  # the file records a run that failed: that is its result
        return PeerResult(engine.name, f"failed ({exc}; read from {path})")
    return PeerResult(engine.name, f"read from {path}", figures)
