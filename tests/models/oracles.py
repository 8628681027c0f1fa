"""Builders of randomly initialized Hugging Face reference models (the test oracles).

The HF models are built from config objects (no downloads), in eval mode with SDPA attention;
`init_std` is raised above BERT/Llama's 0.02 so that outputs vary enough for comparisons
(and greedy generation) to be meaningful.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

# (layers, width, heads, ffn) of the BERT sizes used in parity tests; small vocab keeps them fast.
BERT_SIZES = {"tiny": (2, 128, 2, 512), "mini": (4, 256, 4, 1024)}
# (layers, width, heads, kv heads, ffn) for the Llama sizes: GQA tiny, GQA mini, MQA, MHA.
LLAMA_SIZES = {
    "tiny-gqa": (2, 64, 4, 2, 192),
    "mini-gqa": (4, 256, 8, 2, 688),
    "tiny-mqa": (2, 64, 4, 1, 192),
    "tiny-mha": (2, 64, 4, 4, 192),
}


def hf_bert(size: str = "tiny", *, vocab_size: int = 1000, init_std: float = 0.1, seed: int = 0):
    layers, width, heads, ffn = BERT_SIZES[size]
    torch.manual_seed(seed)
    config = transformers.BertConfig(
        vocab_size=vocab_size,
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=ffn,
        max_position_embeddings=64,
        initializer_range=init_std,
        attn_implementation="sdpa",
    )
    model = transformers.BertForPreTraining(config).eval()
    with torch.no_grad():  # HF zero-inits the MLM bias; a random one tests its mapping
        model.cls.predictions.bias.normal_(0.0, init_std)
    return model


def hf_llama(
    size: str = "tiny-gqa",
    *,
    vocab_size: int = 1000,
    tied: bool = True,
    init_std: float = 0.1,
    rope_theta: float = 10000.0,
    seed: int = 0,
):
    layers, width, heads, kv_heads, ffn = LLAMA_SIZES[size]
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=width,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        tie_word_embeddings=tied,
        initializer_range=init_std,
        attn_implementation="sdpa",
    )
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # RMSNorm gains start at 1; random ones test their mapping
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def padded_batch(B: int, T: int, vocab: int, lengths: list[int], seed: int = 0):
    """Random ids (B, T) and a right-padding mask (B, T) with the given real lengths."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).long()
    return ids, mask
