"""Tiny random models and a character-level tokenizer, built in code (no download).

Used by the quickstart (`model: tiny-qwen2`) and by every CPU test. The tokenizer is made with
`tokenizers` (one token per printable ASCII character plus Qwen-style chat specials) and carries a
ChatML chat template, so the whole prompt pipeline (system prompt, `apply_chat_template`,
`\\boxed{}` answers) runs exactly as with a real Qwen model.
"""

from __future__ import annotations

import string

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TINY_MODEL_NAMES = ("tiny-qwen2", "tiny-llama")


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer: specials first, then every printable ASCII character."""
    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Split into single characters (specials are matched before the pre-tokenizer runs).
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.padding_side = "left"
    return fast


def tiny_config(
    arch: str = "qwen2",
    vocab_size: int = 128,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
):
    """A Qwen2 or Llama config small enough for CPU tests (every linear dim a multiple of 16)."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=SPECIAL_TOKENS.index("<|im_end|>"),
        pad_token_id=SPECIAL_TOKENS.index("<|endoftext|>"),
    )
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "llama":
        return LlamaConfig(**common)
    raise ValueError(f"unknown tiny architecture {arch!r}; use 'qwen2' or 'llama'")


def build_tiny_model(arch: str = "qwen2", seed: int = 0, dtype: torch.dtype = torch.float32, **config_kw) -> PreTrainedModel:
    """A randomly initialised tiny causal LM (seeded, so tests are reproducible)."""
    config = tiny_config(arch, **config_kw)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        # A slightly larger init than HF's 0.02 makes the tiny model's outputs less uniform,
        # so sampling, entropy and KL tests have something to measure.
        for name, p in model.named_parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=0.1)
    return model.eval()
