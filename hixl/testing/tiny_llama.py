"""A tiny random-weight Llama and a word-level tokenizer, built locally (no downloads).

vLLM loads it like any Hugging Face checkpoint: the vLLM tests serve it, and so
does ``hixl bench --scenario vllm`` unless given a model (building it needs
torch, transformers and tokenizers, which vLLM brings). Weights come from a fixed seed,
so every process that builds it gets the same model; ``initializer_range`` is
large so that greedy decoding has clear winners (near-tied logits would let
harmless float differences between batch shapes flip a token).
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 512
BLOCK_SIZE = 32  # the CPU backend wants a multiple of 32
LAYERS = 4
KV_HEADS = 2
HEAD_DIM = 64
SPECIALS = ["<unk>", "<s>", "</s>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant{% endif %}"
)


def words(n: int, offset: int = 0) -> str:
    """A prompt of ``n`` tokens (plus BOS) from the tokenizer's vocabulary."""
    return " ".join(f"w{(offset + 7 * i) % (VOCAB - 16)}" for i in range(n))


def build(path: Path, seed: int = 0) -> Path:
    """Write the model and tokenizer into ``path`` (once; reused if present).

    ``seed`` draws the weights: another seed is another model with the same layout and tokenizer.
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
        hidden_size=KV_HEADS * 2 * HEAD_DIM,
        intermediate_size=512,
        num_hidden_layers=LAYERS,
        num_attention_heads=KV_HEADS * 2,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=1024,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float()
    model.save_pretrained(str(path))
    return path
