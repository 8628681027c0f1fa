"""BERT's and GPT's records in the model-family registry (`pipeline/run/families.py`), written
here, beside their LightningModules, so that each record holds its classes: the registry sits
below this package, which may import it, not the reverse.

Importing this module registers the two families; every command that asks the registry
imports it first (tests/pipeline/test_families.py checks that), and so do the modules of this
package that ask it. A family added later is one more `register(Family(...))` call, here or in
the module that defines its LightningModule.
"""

from __future__ import annotations

from datamodules.objectives.objective import CausalLMObjective, MaskedLMObjective
from models.bert import BertForPreTraining, BertLayer, BertModel
from models.config import BertConfig, GPTConfig
from models.gpt import GPT, GPTBlock, GPTModel
from pipeline.pretrain.modules import BertPretraining, GPTPretraining
from pipeline.run.families import Family, register
from tokenizer import BPE_TEMPLATE, WORDPIECE_TEMPLATE

__all__ = ["BERT", "GPT_FAMILY"]

BERT = register(
    Family(
        name="bert",
        config_class=BertConfig,
        model_class=BertForPreTraining,
        backbone_class=BertModel,
        block_class=BertLayer,
        tokenizer_kind="wordpiece",
        objective_class=MaskedLMObjective,
        module_class=BertPretraining,
        vocab_multiple=1,
        try_command=("fill-mask", "text=The capital of France is [MASK]."),
        hf_auto_class="AutoModelForPreTraining",
        output_bias=True,
        inference=frozenset({"fill-mask"}),
        input_template=WORDPIECE_TEMPLATE,
    )
)
GPT_FAMILY = register(
    Family(
        name="gpt",
        config_class=GPTConfig,
        model_class=GPT,
        backbone_class=GPTModel,
        block_class=GPTBlock,
        tokenizer_kind="bpe",
        objective_class=CausalLMObjective,
        module_class=GPTPretraining,
        vocab_multiple=64,
        try_command=("generate", "prompt=The history of"),
        hf_auto_class="AutoModelForCausalLM",
        inference=frozenset({"generate", "score"}),
        input_template=BPE_TEMPLATE,
    )
)
