"""The commands: one thin entry point per `make` target (parse the config, call the library,
print the summary), run as `python -m pipeline.commands.<name>`. No module imports them.

    pretrain   pipeline.pretraining             make pretrain
    finetune   pipeline.finetuning.finetune     make finetune
    evaluate   pipeline.evaluation.evaluate     make evaluate
    predict    pipeline.evaluation.predict      make predict
    generate   pipeline.generation              make generate
    fill_mask  pipeline.mask_filling            make fill-mask
    prepare    datamodules.pretrain             make prepare
    tokenizer  tokenizer                        make tokenizer
    report     pipeline.report                  make report
"""
