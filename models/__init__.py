"""Pure-PyTorch BERT and GPT (Llama-style) models, task heads and Hugging Face interop."""

from models.bert import (
    BertForPreTraining,
    BertModel,
    BertModelOutput,
    BertPreTrainingLoss,
    BertPreTrainingOutput,
    masked_positions_from_labels,
    pretraining_loss,
)
from models.config import BertConfig, GPTConfig
from models.flops import flops_per_token, param_count
from models.gpt import GPT, GPTModel, GPTOutput, KVCache
from models.heads import SequenceClassifier, sequence_loss
from models.hf import UnsupportedCheckpointError, export_hf, load_hf, load_hf_bert, load_hf_gpt

__all__ = [
    "GPT",
    "BertConfig",
    "BertForPreTraining",
    "BertModel",
    "BertModelOutput",
    "BertPreTrainingLoss",
    "BertPreTrainingOutput",
    "GPTConfig",
    "GPTModel",
    "GPTOutput",
    "KVCache",
    "SequenceClassifier",
    "UnsupportedCheckpointError",
    "export_hf",
    "flops_per_token",
    "load_hf",
    "load_hf_bert",
    "load_hf_gpt",
    "masked_positions_from_labels",
    "param_count",
    "pretraining_loss",
    "sequence_loss",
]
