"""``hixl demo``: prefill/decode-disaggregated generation on a real transformer.

Three processes: this one (the router: it builds the reference, hands out
block ids and relays the first token, as a serving proxy would), a prefill
instance and a decode instance (:mod:`hixl.demo.worker`). The KV cache moves
between the two instances through DataDist — pulled layer by layer by decode,
or pushed layer by layer by prefill while it is still computing — and the
generated tokens must equal a colocated, single-process generation.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .._child import ChildProcess

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


class _Worker:
    """The router's handle on one worker process."""

    def __init__(self, setup: dict[str, Any]) -> None:
        self.child = ChildProcess("hixl.demo.worker", timeout=120.0)
        self.child.send(setup)

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
    """Reference tokens (transformers' own generate) and a single-process timeline."""
    import torch

    from .model import ModelSpec, PagedKVCache, build_model, colocated_generate, decode, prefill

    torch.set_num_threads(1)  # like each worker: a fair comparison on a small machine
    spec = ModelSpec(**spec_kwargs)
    model = build_model(spec)
    reference = colocated_generate(model, prompt, cfg.tokens)
    cache = PagedKVCache(spec, num_blocks, cfg.block_size)
    blocks = list(range(cache.blocks_for(len(prompt))))
    token_times: list[float] = []
    start = time.monotonic()
    first = prefill(model, prompt, cache, blocks)
    computed = time.monotonic()
    tokens = decode(model, first, len(prompt), cache, blocks, cfg.tokens, on_token=lambda _: token_times.append(time.monotonic()))
    end = time.monotonic()
    return {"reference": reference, "tokens": tokens, "prefill": computed - start, "ttft": computed - start,
            "t2": (token_times[0] - start) if token_times else None, "total": end - start}


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    """Run the demo and return its measurements (see :func:`format_report`)."""
    from .model import ModelSpec, make_prompt

    spec = ModelSpec(num_layers=cfg.layers, seed=cfg.seed)
    spec_kwargs = asdict(spec)
    prompt = make_prompt(spec, cfg.prompt_len, cfg.seed)
    needed = -(-cfg.prompt_len // cfg.block_size)
    num_blocks = needed * 2  # room to scatter: the blocks a request gets are not contiguous
    push = cfg.mode == "push"
    common = {"spec": spec_kwargs, "num_blocks": num_blocks, "block_size": cfg.block_size, "transport": cfg.transport, "threads": 1}
    prefill_w = _Worker({"role": "PROMPT", "cluster_id": PREFILL_CLUSTER, "listen": not push, **common})
    decode_w = _Worker({"role": "DECODER", "cluster_id": DECODE_CLUSTER, "listen": push, **common})
    # The side that linked closes first, so its peer never sees a vanished link.
    workers = [prefill_w, decode_w] if push else [decode_w, prefill_w]
    try:
        prefill_info, decode_info = prefill_w.ready(), decode_w.ready()
        # Timed only once both workers are idle: the machine is small.
        colocated = _colocated(cfg, spec_kwargs, prompt, num_blocks)
        rng = np.random.default_rng(cfg.seed)
        src_blocks = sorted(rng.choice(num_blocks, needed, replace=False).tolist())
        dst_blocks = rng.permutation(num_blocks)[:needed].tolist()
        if push:
            link = prefill_w.call("link", ip_info=decode_info["ip_info"], cluster_id=DECODE_CLUSTER)
        else:
            link = decode_w.call("link", ip_info=prefill_info["ip_info"], cluster_id=PREFILL_CLUSTER)
        if link["status"] != "SUCCESS":
            raise RuntimeError(f"link failed: {link['status']}")
        req_id = 1
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
    finally:
        for worker in workers:
            worker.close()
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
    }


def _await_completion(worker: _Worker, req_id: int, timeout: float = 5.0) -> bool:
    """Whether the completion notification for ``req_id`` reached ``worker``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(r == req_id for _, r, _ in worker.call("completed")):
            return True
        time.sleep(0.01)
    return False


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:9.1f} ms"


def format_report(result: dict[str, Any]) -> str:
    """The timeline table and the verdict, as printed by ``hixl demo``."""
    cfg, col, dis = result["config"], result["colocated"], result["disaggregated"]
    mib = result["kv_bytes"] / 2**20
    gbps = result["kv_bytes"] / dis["transfer"] / 1e9 if dis["transfer"] > 0 else float("inf")
    what = "decode pulls layer by layer" if cfg["mode"] == "pull" else "prefill pushes layer by layer while computing"
    lines = [
        f"hixl demo: {cfg['layers']}-layer Llama (seed {cfg['seed']}), prompt {cfg['prompt_len']} tokens, "
        f"{cfg['tokens']} tokens generated, block {cfg['block_size']} tokens",
        f"mode {cfg['mode']} ({what}), transport {result['transport']}, KV cache moved {mib:.2f} MiB",
        "",
        f"{'':34}{'colocated':>14}{'disaggregated':>16}",
        f"{'prefill compute':34}{_ms(col['prefill']):>14}{_ms(dis['prefill']):>16}",
        f"{'KV transfer (all layers)':34}{'-':>14}{_ms(dis['transfer']):>16}   "
        + (f"{gbps:.2f} GB/s" if dis["tail_after_compute"] is None else "overlapped with prefill compute"),
        *(
            [f"{'  landed after compute ended':34}{'-':>14}{_ms(dis['tail_after_compute']):>16}"]
            if dis["tail_after_compute"] is not None
            else []
        ),
        f"{'first layer usable (landed)':34}{'-':>14}{_ms(dis['first_layer_landed']):>16}   "
        f"({dis['first_layer_landed'] / dis['transfer'] * 100 if dis['transfer'] else 0:.0f}% of the transfer time)",
        f"{'decode starts layer 0':34}{'-':>14}{_ms(dis['decode_layer0_start']):>16}",
        f"{'time to first token':34}{_ms(col['ttft']):>14}{_ms(dis['ttft']):>16}",
        f"{'time to second token':34}{_ms(col['t2']):>14}{_ms(dis['t2']):>16}",
        f"{'total':34}{_ms(col['total']):>14}{_ms(dis['total']):>16}",
        "",
        "layers landed at (ms after the transfer started): " + ", ".join(f"{t * 1e3:.1f}" for t in dis["layers_landed"]),
        f"completion notification received by the {'decode' if cfg['mode'] == 'push' else 'prefill'} side: "
        f"{'yes' if result['completion_notified'] else 'NO'}",
        f"tokens identical to colocated generation: {'YES' if result['identical'] else 'NO'} "
        f"({sum(a == b for a, b in zip(result['tokens'], result['reference']))}/{len(result['reference'])})",
    ]
    if not result["identical"]:
        lines.append(f"  reference: {result['reference']}\n  got:       {result['tokens']}")
    return "\n".join(lines)


def add_parser(subparsers: Any) -> None:
    """Register ``hixl demo``."""
    parser = subparsers.add_parser("demo", help="PD-disaggregated generation on a small real transformer")
    defaults = DemoConfig()
    parser.add_argument("--tokens", type=int, default=defaults.tokens, help="tokens to generate (default %(default)s)")
    parser.add_argument("--prompt-len", type=int, default=defaults.prompt_len, help="prompt length (default %(default)s)")
    parser.add_argument("--layers", type=int, default=defaults.layers, help="decoder layers (default %(default)s)")
    parser.add_argument("--block-size", type=int, default=defaults.block_size, help="tokens per KV block (default %(default)s)")
    parser.add_argument("--transport", default=defaults.transport, choices=["auto", "cma", "tcp"], help="engine transport")
    parser.add_argument("--mode", default=defaults.mode, choices=["pull", "push"], help="who moves the KV cache")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="model and prompt seed")
    parser.set_defaults(run=_main)


def _main(args: argparse.Namespace) -> int:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        print("hixl demo needs torch and transformers: pip install 'hixl[demo]'")
        return 2
    for name, low in (("tokens", 1), ("prompt_len", 1), ("layers", 1), ("block_size", 1)):
        if getattr(args, name) < low:
            print(f"--{name.replace('_', '-')} must be at least {low}")
            return 2
    cfg = DemoConfig(args.tokens, args.prompt_len, args.layers, args.block_size, args.transport, args.mode, args.seed)
    result = run_demo(cfg)
    print(format_report(result))
    return 0 if result["identical"] and result["completion_notified"] else 1
