"""Tests for hixl.demo.model: paged prefill/decode must match colocated generation."""

from __future__ import annotations

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hixl.demo.model import (  # noqa: E402  (imported only once torch is known to exist)
    ModelSpec,
    PagedKVCache,
    build_model,
    colocated_generate,
    decode,
    make_prompt,
    prefill,
)

# Small enough that every test runs in well under a second on two cores.
SPEC = ModelSpec(
    num_layers=3,
    hidden_size=64,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=128,
    vocab_size=256,
    max_positions=256,
)
NUM_TOKENS = 6


@pytest.fixture(scope="module")
def model():
    return build_model(SPEC)


def _prefill(model, spec: ModelSpec, prompt: list[int], block_size: int, block_ids: list[int]):
    cache = PagedKVCache(spec, num_blocks=max(block_ids) + 1, block_size=block_size)
    first = prefill(model, prompt, cache, block_ids)
    return cache, first


@pytest.mark.parametrize(
    ("num_layers", "prompt_len", "block_size"),
    [(1, 1, 4), (2, 13, 4), (3, 16, 4), (3, 37, 8), (4, 50, 16)],
)
def test_paged_prefill_decode_matches_colocated(num_layers: int, prompt_len: int, block_size: int) -> None:
    spec = replace(SPEC, num_layers=num_layers)
    model = build_model(spec)
    prompt = make_prompt(spec, prompt_len, seed=prompt_len)
    num_blocks = -(-prompt_len // block_size)
    # Scattered, out-of-order blocks, as an allocator would hand them out.
    block_ids = [2 * i + 1 for i in reversed(range(num_blocks))]
    cache, first = _prefill(model, spec, prompt, block_size, block_ids)

    expected = colocated_generate(model, prompt, NUM_TOKENS)
    assert len(expected) == NUM_TOKENS
    assert decode(model, first, prompt_len, cache, block_ids, NUM_TOKENS) == expected

    # Mimic a transfer: a second cache (another process's memory) filled by copy_.
    remote = PagedKVCache(spec, cache.num_blocks, block_size, storage=torch.empty_like(cache.storage))
    remote.storage.copy_(cache.storage)
    assert decode(model, first, prompt_len, remote, block_ids, NUM_TOKENS) == expected


def test_transfer_into_other_block_ids_matches_colocated(model) -> None:
    prompt = make_prompt(SPEC, 21, seed=3)
    src_ids = [4, 0, 2]
    cache, first = _prefill(model, SPEC, prompt, 8, src_ids)
    # The decode side allocated different blocks; move block by block through
    # the per-layer views, as a transfer library would.
    dst_ids = [1, 5, 3]
    remote = PagedKVCache(SPEC, num_blocks=6, block_size=8)
    for src, dst in zip(cache.layer_tensors(), remote.layer_tensors()):
        for src_id, dst_id in zip(src_ids, dst_ids):
            dst[dst_id].copy_(src[src_id])
    assert decode(model, first, len(prompt), remote, dst_ids, NUM_TOKENS) == colocated_generate(
        model, prompt, NUM_TOKENS
    )


def test_on_layer_done_fires_in_order_during_forward(model) -> None:
    events: list[str] = []
    last = SPEC.num_layers - 1
    start_last = model.model.layers[last].register_forward_pre_hook(lambda *_: events.append("start last"))
    try:
        cache = PagedKVCache(SPEC, num_blocks=4, block_size=4)
        prefill(model, make_prompt(SPEC, 10, seed=0), cache, [0, 1, 2], lambda i: events.append(f"done {i}"))
    finally:
        start_last.remove()
    # Every layer but the last is reported before the last layer even starts.
    assert events == [f"done {i}" for i in range(last)] + ["start last", f"done {last}"]


def test_on_layer_done_sees_layer_already_written(model) -> None:
    cache = PagedKVCache(SPEC, num_blocks=4, block_size=4)
    written: list[bool] = []
    prefill(
        model,
        make_prompt(SPEC, 10, seed=0),
        cache,
        [0, 1, 2],
        lambda i: written.append(bool(cache.storage[i].abs().sum() > 0)),
    )
    assert written == [True] * SPEC.num_layers


def test_wait_layer_precedes_each_layer_and_loads_lazily(model) -> None:
    prompt = make_prompt(SPEC, 11, seed=5)
    block_ids = [0, 2, 1]
    source, first = _prefill(model, SPEC, prompt, 4, block_ids)
    # The decode cache starts empty: layer i only "arrives" when wait_layer(i)
    # is called, so any read before that would see zeros and change the tokens.
    arriving = PagedKVCache(SPEC, source.num_blocks, 4)
    events: list[str] = []

    def wait_layer(i: int) -> None:
        events.append(f"wait {i}")
        arriving.storage[i].copy_(source.storage[i])

    ran = [
        layer.register_forward_hook(lambda *_, i=i: events.append(f"ran {i}"))
        for i, layer in enumerate(model.model.layers)
    ]
    try:
        tokens = decode(model, first, len(prompt), arriving, block_ids, NUM_TOKENS, wait_layer)
    finally:
        for handle in ran:
            handle.remove()
    first_pass = [e for i in range(SPEC.num_layers) for e in (f"wait {i}", f"ran {i}")]
    later_passes = [f"ran {i}" for i in range(SPEC.num_layers)] * (NUM_TOKENS - 2)
    assert events == first_pass + later_passes
    assert tokens == colocated_generate(model, prompt, NUM_TOKENS)


def test_hooks_are_removed(model) -> None:
    cache = PagedKVCache(SPEC, num_blocks=2, block_size=4)
    calls: list[int] = []
    first = prefill(model, make_prompt(SPEC, 5, seed=1), cache, [0, 1], calls.append)
    decode(model, first, 5, cache, [0, 1], 3, calls.append)
    calls.clear()
    model(torch.tensor([[1, 2, 3]]))
    assert calls == []
    assert all(not layer._forward_hooks and not layer._forward_pre_hooks for layer in model.model.layers)


def test_hooks_are_removed_when_callback_raises(model) -> None:
    def boom(i: int) -> None:
        raise RuntimeError("transfer failed")

    cache = PagedKVCache(SPEC, num_blocks=2, block_size=4)
    with pytest.raises(RuntimeError, match="transfer failed"):
        prefill(model, make_prompt(SPEC, 5, seed=1), cache, [0, 1], boom)
    with pytest.raises(RuntimeError, match="transfer failed"):
        decode(model, 7, 5, cache, [0, 1], 3, boom)
    assert all(not layer._forward_hooks and not layer._forward_pre_hooks for layer in model.model.layers)


def test_decode_single_token_runs_no_forward(model) -> None:
    waited: list[int] = []
    cache = PagedKVCache(SPEC, num_blocks=1, block_size=4)
    assert decode(model, 42, 3, cache, [0], 1, waited.append) == [42]
    assert waited == []


def test_corrupted_kv_changes_tokens(model) -> None:
    prompt = make_prompt(SPEC, 24, seed=9)
    block_ids = [0, 1, 2]
    cache, first = _prefill(model, SPEC, prompt, 8, block_ids)
    expected = colocated_generate(model, prompt, NUM_TOKENS)
    assert decode(model, first, len(prompt), cache, block_ids, NUM_TOKENS) == expected
    cache.storage.zero_()
    assert decode(model, first, len(prompt), cache, block_ids, NUM_TOKENS) != expected


def test_write_read_round_trip_with_scattered_blocks() -> None:
    cache = PagedKVCache(SPEC, num_blocks=6, block_size=4)
    block_ids = [5, 1, 3]
    shape = (1, SPEC.num_kv_heads, 10, SPEC.head_dim)
    key, value = torch.randn(shape), torch.randn(shape)
    cache.write_layer(1, key, value, block_ids)

    read_key, read_value = cache.read_layer(1, 10, block_ids)
    assert torch.equal(read_key, key) and torch.equal(read_value, value)
    # Token t sits in block block_ids[t // 4], slot t % 4, as (heads, dim).
    k1, v1 = cache.layer_tensors()[2:4]
    assert torch.equal(k1[5, 0], key[0, :, 0])
    assert torch.equal(k1[1, 0], key[0, :, 4])
    assert torch.equal(v1[3, 1], value[0, :, 9])
    # Unused slots, unused blocks and other layers stay untouched.
    assert not k1[3, 2:].any() and not k1[[0, 2, 4]].any()
    assert not cache.storage[[0, 2]].any()
    # Reads are copies.
    read_key.zero_()
    assert torch.equal(cache.read_layer(1, 10, block_ids)[0], key)
    # A prefix read only needs the blocks it covers.
    assert torch.equal(cache.read_layer(1, 5, block_ids[:2])[1], value[:, :, :5])


def test_write_layer_rejects_bad_block_ids() -> None:
    cache = PagedKVCache(SPEC, num_blocks=4, block_size=4)
    kv = torch.zeros(1, SPEC.num_kv_heads, 9, SPEC.head_dim)
    with pytest.raises(ValueError, match="need 3 blocks"):
        cache.write_layer(0, kv, kv, [0, 1])
    with pytest.raises(ValueError, match="block ids"):
        cache.write_layer(0, kv, kv, [0, 1, -1])
    with pytest.raises(ValueError, match="block ids"):
        cache.read_layer(0, 9, [0, 4, 1])


def test_layer_tensors_are_views_into_given_storage() -> None:
    storage = torch.zeros(SPEC.num_layers, 2, 3, 4, SPEC.num_kv_heads, SPEC.head_dim)
    cache = PagedKVCache(SPEC, num_blocks=3, block_size=4, storage=storage)
    assert cache.storage is storage
    tensors = cache.layer_tensors()
    assert len(tensors) == 2 * SPEC.num_layers
    assert all(t.shape == (3, 4, SPEC.num_kv_heads, SPEC.head_dim) for t in tensors)
    tensors[3].fill_(1.0)  # V of layer 1
    assert storage[1, 1].eq(1.0).all() and storage.sum() == tensors[3].numel()
    assert cache.blocks_for(0) == 0 and cache.blocks_for(4) == 1 and cache.blocks_for(5) == 2


@pytest.mark.parametrize(
    "storage",
    [
        torch.zeros(1, 2, 3),
        torch.zeros(SPEC.num_layers, 2, 3, 4, SPEC.num_kv_heads, SPEC.head_dim, dtype=torch.float16),
        torch.zeros(SPEC.num_layers, 2, 4, 3, SPEC.num_kv_heads, SPEC.head_dim).transpose(2, 3),
    ],
)
def test_rejects_mismatched_storage(storage) -> None:
    with pytest.raises(ValueError, match="storage"):
        PagedKVCache(SPEC, num_blocks=3, block_size=4, storage=storage)


def test_build_model_and_prompt_are_deterministic() -> None:
    state = torch.random.get_rng_state()
    a, b = build_model(SPEC), build_model(SPEC)
    assert torch.equal(torch.random.get_rng_state(), state)  # caller's RNG untouched
    other = build_model(replace(SPEC, seed=1))
    weight = "model.layers.0.self_attn.k_proj.weight"
    assert torch.equal(a.state_dict()[weight], b.state_dict()[weight])
    assert not torch.equal(a.state_dict()[weight], other.state_dict()[weight])
    assert all(p.dtype == torch.float32 for p in a.parameters()) and not a.training
    assert a.config._attn_implementation == "eager"

    prompt = make_prompt(SPEC, 20, seed=4)
    assert prompt == make_prompt(SPEC, 20, seed=4) != make_prompt(SPEC, 20, seed=5)
    assert len(prompt) == 20 and all(0 <= t < SPEC.vocab_size for t in prompt)


def test_model_spec_validation() -> None:
    assert ModelSpec().head_dim == 32
    with pytest.raises(ValueError):
        ModelSpec(hidden_size=100, num_heads=8)
    with pytest.raises(ValueError):
        ModelSpec(num_heads=8, num_kv_heads=3)
