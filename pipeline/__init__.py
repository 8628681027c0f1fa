"""The wiring of the pipeline, in sub-packages by job, each importing only those before it:

run/         errors, config keys, how the process was launched, CLI plumbing, run folders
             and locks, the model-family registry
training/    optimizers (Muon), schedules, precision, strategies, loggers, callbacks, the
             Lightning adapter
checkpoint/  resolving ckpt= / resume=, loading, saving, the record, interrupts
finetune/    the fine-tuning run, evaluation and prediction, task module, metrics, baselines
infer/       generation, mask filling, LM scoring, sentence scores, BLiMP's pairs, the n-gram
             model (imports run/ and checkpoint/ only)
pretrain/    the pretraining run and its checks, LightningModules, budget, probes
suites/      make glue, BLiMP against its twin and n-gram, suite summaries, sweeps, seed
             statistics
report/      plots and tables of run folders (reads records only)
commands/    one thin entry point per make target; nothing imports them
"""
