"""``hixl demo --plot FILE``: one request's timeline, colocated above disaggregated.

Each lane is one activity on a shared time axis (ms since the request
arrived): prefill compute split per layer, each layer's KV transfer, decode's
first step split per layer, and markers for the first and second token. It
shows what the table can only list: how the transfer overlaps the compute, and
how soon decode starts on layer 0 while later layers are still on the wire.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._tools.plot import new_figure, save

__all__ = ["plot_timeline"]

_COMPUTE, _TRANSFER, _DECODE = ("tab:blue", "tab:cyan"), ("tab:orange", "gold"), ("tab:green", "yellowgreen")


def _spans(starts: Sequence[float], ends: Sequence[float]) -> list[tuple[float, float]]:
    """(start, width) in ms for each layer."""
    return [(s * 1e3, max(e - s, 0.0) * 1e3) for s, e in zip(starts, ends)]


def _transfer_starts(dis: dict[str, Any], push: bool) -> list[float]:
    """When each layer's transfer began. Requests to one peer run in order, so layer i starts once
    layer i-1 has landed — and, when prefill pushes, once layer i has been computed."""
    starts, previous = [], dis["transfer_start"]
    for i, landed in enumerate(dis["landed"]):
        start = max(previous, dis["layer_done"][i]) if push else previous
        starts.append(min(start, landed))
        previous = landed
    return starts


def _lane(ax: Any, y: int, spans: list[tuple[float, float]], colours: tuple[str, str]) -> None:
    ax.broken_barh(spans, (y - 0.35, 0.7), facecolors=[colours[i % 2] for i in range(len(spans))], edgecolor="white")
    if spans:  # layer numbers on the bars wide enough to hold them
        right = max(s + w for s, w in spans)
        for i, (s, w) in enumerate(spans):
            if w > right / 40:
                ax.text(s + w / 2, y, str(i), ha="center", va="center", fontsize="x-small", color="white")


def plot_timeline(result: dict[str, Any], path: str) -> None:
    """Draw ``result``'s (:func:`~hixl.demo.run.run_demo`'s) timeline into ``path``."""
    cfg, col, dis = result["config"], result["timeline"]["colocated"], result["timeline"]["disaggregated"]
    push = cfg["mode"] == "push"
    lanes = [
        "colocated: prefill compute",
        "disaggregated: prefill compute",
        f"KV transfer ({'prefill pushes' if push else 'decode pulls'}, {result['transport']})",
        "decode: first step, per layer",
    ]
    figure = new_figure(10, 3.6)
    ax = figure.subplots()
    _lane(ax, 3, _spans([0.0, *col["layer_done"][:-1]], col["layer_done"]), _COMPUTE)
    _lane(ax, 2, _spans([0.0, *dis["layer_done"][:-1]], dis["layer_done"]), _COMPUTE)
    transfers = _spans(_transfer_starts(dis, push), dis["landed"])
    _lane(ax, 1, transfers, _TRANSFER)
    if transfers:  # the KV cache of a small model moves in a sliver of the time: say when it was all there
        last = transfers[-1][0] + transfers[-1][1]
        ax.text(last, 1, f"  {len(transfers)} layers, the last landed at {last:.1f} ms", va="center", fontsize="small")
    if dis["t2"] is not None and dis["decode_layers"]:
        _lane(ax, 0, _spans(dis["decode_layers"], [*dis["decode_layers"][1:], dis["t2"]]), _DECODE)
    # First token: prefill's output, on its lane; second token: the first decode step's output.
    tokens = [
        (3, col["ttft"], "black"),
        (3, col["t2"], "tab:red"),
        (2, dis["ttft"], "black"),
        (0, dis["t2"], "tab:red"),
    ]
    for y, at, colour in tokens:
        if at is not None:
            ax.plot([at * 1e3], [y + 0.45], "v", color=colour, markersize=7)
    ax.plot([], [], "v", color="black", label="first token (prefill's output)")
    ax.plot([], [], "v", color="tab:red", label="second token (decode's first step)")
    ax.set_yticks(range(len(lanes)), list(reversed(lanes)))
    ax.set_ylim(-0.6, len(lanes) - 0.3)
    ax.set_xlim(left=0)
    ax.set_xlabel("ms since the request arrived (numbers on bars: layer)")
    ax.grid(True, axis="x", alpha=0.3)
    figure.legend(fontsize="small", loc="outside lower right", ncols=2)
    ax.set_title(
        "hixl demo: one request, colocated vs disaggregated\n"
        f"{cfg['layers']}-layer Llama, prompt {cfg['prompt_len']} tokens, mode {cfg['mode']}",
        fontsize="medium",
    )
    save(figure, path)
