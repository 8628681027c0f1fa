"""The commands: one thin entry point per `make` target (parse the config, call the library,
print the summary), run as `python -m pipeline.commands.<name>`. No module imports them.

    pretrain   pipeline.pretrain.run             make pretrain
    finetune   pipeline.finetune.run.finetune     make finetune
    evaluate   pipeline.finetune.evaluation.evaluate     make evaluate
    predict    pipeline.finetune.evaluation.predict      make predict
    generate   pipeline.infer.generation              make generate
    fill_mask  pipeline.infer.mask_filling            make fill-mask
    prepare    datamodules.pretrain             make prepare
    tokenizer  tokenizer                        make tokenizer
    report     pipeline.report                  make report
    lm_eval_check  (reads config.json only)    make lm-eval, before lm-eval is installed
"""
