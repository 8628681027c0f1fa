"""Architecture hyperparameters of the two model families, validated on construction; each also
says where its parameters run (`param_counts`, which `models.flops` counts FLOPs from).

Both dataclasses are what `conf/model/*.yaml` instantiates (`_target_: models.config.BertConfig`), so an
invalid value fails while the config is being checked, before any data or tokenizer work starts. Every
error names the field and says how to fix it.

Presets follow the published sizes (layers/width/heads): BERT from Turc et al. 2019 and Devlin et al.
2019, GPT shapes from nanoGPT / Llama.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from models.flops import ParamCounts


def _require_positive(config: object, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(
                f"model.{name} must be a positive integer, got {value!r}; "
                f"set model.{name}=<int > 0>"
            )


def require_probability(key: str, value: object) -> None:
    """A dropout-like rate: in [0, 1). `key` is the setting as the user types it."""
    try:
        valid = 0.0 <= float(value) < 1.0
    except (TypeError, ValueError):
        valid = False
    if not valid:
        raise ValueError(f"{key} must be a number in [0, 1), got {value!r}; for example {key}=0.1")


def _require_probability(config: object, *names: str) -> None:
    for name in names:
        require_probability(f"model.{name}", getattr(config, name))


def _require_divides(config: object, divisor: str, dividend: str) -> None:
    a, b = getattr(config, divisor), getattr(config, dividend)
    if b % a != 0:
        raise ValueError(
            f"model.{divisor}={a} does not divide model.{dividend}={b}; choose model.{divisor} "
            f"among the divisors of {b} (for example {_divisors_near(b, a)})"
        )


def _require_choice(config: object, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(config, name)
    if value not in choices:
        raise ValueError(
            f"model.{name}={value!r} is not one of {', '.join(choices)}; "
            f"for example model.{name}={choices[0]}"
        )


def _require_rotary(config: Any) -> None:
    """Rotary embeddings rotate pairs of a head's dimensions, at a positive base."""
    if config.head_dim % 2 != 0:
        raise ValueError(
            f"model.d_model / model.n_heads = {config.head_dim} must be even for rotary "
            "embeddings; change model.d_model or model.n_heads"
        )
    if config.rope_theta <= 0:
        raise ValueError(f"model.rope_theta must be > 0, got {config.rope_theta}")


def _divisors_near(n: int, target: int) -> str:
    divisors = sorted((d for d in range(1, n + 1) if n % d == 0), key=lambda d: abs(d - target))
    return ", ".join(str(d) for d in sorted(divisors[:3]))


class ModelConfig(Protocol):
    """What the pipeline reads from any family's architecture dataclass (`BertConfig`,
    `GPTConfig`, or a family added later)."""

    vocab_size: int
    d_model: int
    n_layers: int
    max_seq_len: int


def round_up(value: float, multiple: int) -> int:
    """Smallest multiple of `multiple` that is >= value."""
    return -(-round(value) // multiple) * multiple


class _Presets:
    """Mixin: named sizes, overridable field by field."""

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {}

    @classmethod
    def from_preset(cls, name: str, **overrides: Any):
        if name not in cls.PRESETS:
            raise ValueError(
                f"unknown {cls.__name__} preset {name!r}; choose one of {sorted(cls.PRESETS)}"
            )
        return cls(**{**cls.PRESETS[name], **overrides})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class BertConfig(_Presets):
    """BERT encoder (post-LN, GELU, learned absolute positions, token types), with two options
    the original does not have: rotary positions and pre-norm blocks.

    Attributes:
        vocab_size: word-piece vocabulary size; the pipeline sets it from the tokenizer.
        n_layers: transformer blocks.
        d_model: hidden width D.
        n_heads: attention heads H; head size E = D / H.
        d_ff: feed-forward width; defaults to 4 * D.
        max_seq_len: the longest sequence it reads: rows of the learned position table (512
            in the original), or, with rotary positions, only a limit.
        type_vocab_size: segment (token type) embeddings, 2 for sentence A/B.
        dropout: dropout on embeddings and residual branches.
        attn_dropout: dropout on attention probabilities.
        layer_norm_eps: LayerNorm epsilon (1e-12 in the original).
        init_std: std of the normal initialization.
        pad_token_id: id of [PAD].
        position_encoding: "absolute" (the original: a learned embedding per position, added
            to the word embedding) or "rotary" (RoPE on every block's queries and keys, no
            position table, as GPT; RoFormer, Su et al. 2021).
        rope_theta: RoPE base, for position_encoding=rotary.
        norm_placement: "post" (the original: x = LN(x + f(x))) or "pre" (x = x + f(LN(x)),
            with a final LayerNorm after the last block, as GPT and Cramming's encoder).
        Only the original (absolute, post) exports to Hugging Face `BertModel`.
    """

    vocab_size: int = 30522
    n_layers: int = 12
    d_model: int = 768
    n_heads: int = 12
    d_ff: int | None = None
    max_seq_len: int = 512
    type_vocab_size: int = 2
    dropout: float = 0.1
    attn_dropout: float = 0.1
    layer_norm_eps: float = 1e-12
    init_std: float = 0.02
    pad_token_id: int = 0
    position_encoding: str = "absolute"
    rope_theta: float = 10000.0
    norm_placement: str = "post"

    # each option's choices, the original's first
    POSITION_ENCODINGS: ClassVar[tuple[str, ...]] = ("absolute", "rotary")
    NORM_PLACEMENTS: ClassVar[tuple[str, ...]] = ("post", "pre")

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "tiny": dict(n_layers=2, d_model=128, n_heads=2),
        "mini": dict(n_layers=4, d_model=256, n_heads=4),
        "small": dict(n_layers=4, d_model=512, n_heads=8),
        "medium": dict(n_layers=8, d_model=512, n_heads=8),
        "base": dict(n_layers=12, d_model=768, n_heads=12),
        "large": dict(n_layers=24, d_model=1024, n_heads=16),
    }

    def __post_init__(self) -> None:
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model
        _require_positive(
            self,
            "vocab_size",
            "n_layers",
            "d_model",
            "n_heads",
            "d_ff",
            "max_seq_len",
            "type_vocab_size",
        )
        _require_divides(self, "n_heads", "d_model")
        _require_probability(self, "dropout", "attn_dropout")
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(
                f"model.pad_token_id={self.pad_token_id} is outside the vocabulary "
                f"[0, {self.vocab_size})"
            )
        _require_choice(self, "position_encoding", self.POSITION_ENCODINGS)
        _require_choice(self, "norm_placement", self.NORM_PLACEMENTS)
        if self.rotary:
            _require_rotary(self)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def rotary(self) -> bool:
        return self.position_encoding == "rotary"

    @property
    def pre_norm(self) -> bool:
        return self.norm_placement == "pre"

    def unlike_original(self) -> list[str]:
        """The options set away from the architecture of Devlin et al. (and of Hugging Face
        `BertModel`), as settings (`model.position_encoding=rotary`); empty for the original."""
        options = (
            ("position_encoding", self.POSITION_ENCODINGS),
            ("norm_placement", self.NORM_PLACEMENTS),
        )
        return [
            f"model.{name}={getattr(self, name)}"
            for name, choices in options
            if getattr(self, name) != choices[0]
        ]

    def param_counts(self) -> ParamCounts:
        """`BertForPreTraining`'s parameters by where they run (`models.flops`): the MLM head
        and its decoder (tied to the word embedding) at the masked positions, the pooler and
        NSP head once per sequence."""
        D, F, V = self.d_model, self.d_ff, self.vocab_size
        layer = (4 * D * D + 4 * D) + (2 * D * F + F + D) + 2 * 2 * D  # attn, ffn, 2 LayerNorms
        positions = 0 if self.rotary else self.max_seq_len
        final_norm = 2 * D if self.pre_norm else 0
        return ParamCounts(
            embedding=(V + positions + self.type_vocab_size) * D,
            body=2 * D + self.n_layers * layer + final_norm,  # + embedding LayerNorm
            head=(D * D + D) + 2 * D + V,  # transform dense, LayerNorm, output bias
            per_sequence=(D * D + D) + (2 * D + 2),  # pooler, NSP
            tied_output=V * D,
        )


@dataclass
class GPTConfig(_Presets):
    """Llama-style decoder (pre-norm RMSNorm, RoPE, GQA, SwiGLU, no biases).

    Attributes:
        vocab_size: BPE vocabulary size; the pipeline sets it from the tokenizer (padded to a
            multiple of 64 for matmul speed).
        n_layers: transformer blocks.
        d_model: hidden width D.
        n_heads: query heads H; head size E = D / H.
        n_kv_heads: key/value heads K (GQA); must divide H. None means K = H (MHA); 1 is MQA.
        d_ff: SwiGLU hidden width; defaults to 8/3 * D rounded up to `ffn_multiple_of`.
        ffn_multiple_of: rounding of the default d_ff.
        max_seq_len: context length T the model is trained for.
        rope_theta: RoPE base (10,000 as in Llama 2; 500,000 in Llama 3).
        norm_eps: RMSNorm epsilon.
        tie_embeddings: share the token embedding with the output head.
        dropout: residual/attention dropout (0 for pretraining as in Llama).
        init_std: std of the normal initialization; residual output projections get
            init_std / sqrt(2 * n_layers).
    """

    vocab_size: int = 50304
    n_layers: int = 12
    d_model: int = 768
    n_heads: int = 12
    n_kv_heads: int | None = None
    d_ff: int | None = None
    ffn_multiple_of: int = 64
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    dropout: float = 0.0
    init_std: float = 0.02

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "tiny": dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, max_seq_len=128),
        "mini": dict(n_layers=4, d_model=256, n_heads=8, n_kv_heads=2, d_ff=688, max_seq_len=256),
        "small": dict(n_layers=6, d_model=512, n_heads=8, n_kv_heads=4, max_seq_len=512),
        "124m": dict(n_layers=12, d_model=768, n_heads=12, n_kv_heads=12, max_seq_len=1024),
        "1b": dict(
            n_layers=16,
            d_model=2048,
            n_heads=32,
            n_kv_heads=8,
            d_ff=8192,
            max_seq_len=2048,
            rope_theta=500000.0,
            vocab_size=32000,
        ),
    }

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        _require_positive(self, "ffn_multiple_of")
        if self.d_ff is None:
            self.d_ff = round_up(8 * self.d_model / 3, self.ffn_multiple_of)
        _require_positive(
            self,
            "vocab_size",
            "n_layers",
            "d_model",
            "n_heads",
            "n_kv_heads",
            "d_ff",
            "max_seq_len",
        )
        _require_divides(self, "n_heads", "d_model")
        _require_divides(self, "n_kv_heads", "n_heads")
        _require_rotary(self)
        _require_probability(self, "dropout")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def param_counts(self) -> ParamCounts:
        """`GPT`'s parameters by where they run (`models.flops`): the output layer, tied to
        the token embedding or not, on every position."""
        D, E, output = self.d_model, self.head_dim, self.vocab_size * self.d_model
        attn = D * (self.n_heads + 2 * self.n_kv_heads) * E + self.n_heads * E * D
        mlp = 3 * D * self.d_ff
        return ParamCounts(
            embedding=output,
            body=self.n_layers * (attn + mlp + 2 * D) + D,  # + RMSNorm gains
            head=0 if self.tie_embeddings else output,
            tied_output=output if self.tie_embeddings else 0,
        )
