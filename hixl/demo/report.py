"""What ``hixl demo`` prints: the timeline table, its legend, and the verdict.

Rows follow the request's life: prefill computes and emits the first token,
the KV cache moves, decode starts and emits the second token. Points in time
are counted from the moment the request arrived; the transfer rows are
durations. The legend under the table says so row by row, because the order
surprises: the first token comes from prefill, so it precedes everything
decode does.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LEGEND", "format_report"]

_LABEL = 34  # width of the row-label column

LEGEND = """\
legend (points in time are ms since the request arrived; the transfer rows are durations):
  prefill compute          the prompt's forward pass through every layer (in the prefill process)
  time to first token      prefill's output is the first token, so it comes before decode does anything
  KV transfer              moving every layer's KV blocks to decode (pull: once decode has the first
                           token; push: while prefill is still computing, layer by layer)
  landed after compute...  (push only) how long after prefill's last layer the last layer landed
  first layer landed       from the transfer's start to layer 0 landing: decode can start on it while
                           the other layers still arrive
  decode starts layer 0    decode's first step begins its first layer (after the first token was relayed)
  time to second token     the first token decode computes: TTFT + relay + the wait for layer 0 + one step
  total                    the whole request. Expect disaggregated to be slower on one machine: both
                           processes share its cores and the KV cache moves once (on a busy machine,
                           noise can flip small differences). What it buys shows on separate machines:
                           prefill no longer stalls other requests' decode steps, each side scales alone."""


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:9.1f} ms"


def _row(label: str, colocated: float | None, disaggregated: float | None, remark: str = "") -> str:
    line = f"{label:{_LABEL}}{_ms(colocated):>14}{_ms(disaggregated):>16}"
    return f"{line}   {remark}" if remark else line


def format_report(result: dict[str, Any]) -> str:
    """The table, its legend and the verdict, as printed by ``hixl demo`` (``result``: :func:`run_demo`'s)."""
    cfg, col, dis = result["config"], result["colocated"], result["disaggregated"]
    mib = result["kv_bytes"] / 2**20
    rate = result["kv_bytes"] / dis["transfer"] / 2**30 if dis["transfer"] > 0 else float("inf")
    push = cfg["mode"] == "push"
    what = "prefill pushes layer by layer while computing" if push else "decode pulls layer by layer"
    landed = dis["layers_landed"]
    share = dis["first_layer_landed"] / dis["transfer"] * 100 if dis["transfer"] else 0.0
    lines = [
        f"hixl demo: {cfg['layers']}-layer Llama (seed {cfg['seed']}), prompt {cfg['prompt_len']} tokens, "
        f"{cfg['tokens']} tokens generated, block {cfg['block_size']} tokens",
        f"mode {cfg['mode']} ({what}), transport {result['transport']}, KV cache moved {mib:.2f} MiB"
        + (", prefill and decode on two hosts (namespaces)" if cfg["hosts"] else ""),
        "",
        f"{'':{_LABEL}}{'colocated':>14}{'disaggregated':>16}",
        _row("prefill compute", col["prefill"], dis["prefill"]),
        _row("time to first token", col["ttft"], dis["ttft"]),
        _row("KV transfer", None, dis["transfer"], "overlapped with prefill compute" if push else f"{rate:.2f} GiB/s"),
        *([_row("  landed after compute ended", None, dis["tail_after_compute"])] if push else []),
        _row("first layer landed", None, dis["first_layer_landed"], f"({share:.0f}% of the transfer time)"),
        _row("decode starts layer 0", None, dis["decode_layer0_start"]),
        _row("time to second token", col["t2"], dis["t2"]),
        _row("total", col["total"], dis["total"]),
        "",
        LEGEND,
        "",
        "layers landed at (ms after the transfer started): " + ", ".join(f"{t * 1e3:.1f}" for t in landed),
        f"completion notification received by the {'decode' if push else 'prefill'} side: "
        f"{'yes' if result['completion_notified'] else 'NO'}",
        f"tokens identical to colocated generation: {'YES' if result['identical'] else 'NO'} "
        f"({sum(a == b for a, b in zip(result['tokens'], result['reference']))}/{len(result['reference'])})",
    ]
    if not result["identical"]:
        lines.append(f"  reference: {result['reference']}\n  got:       {result['tokens']}")
    return "\n".join(lines)
