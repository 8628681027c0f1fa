"""The wiring of the pipeline, in sub-packages by job, each importing only those before it:

run/         errors, config keys, how the process was launched, CLI plumbing, run folders
             and locks, the model-family registry
training/    optimizers (Muon), schedules, precision, strategies, loggers, callbacks, the
             Lightning adapter
checkpoint/  resolving ckpt= / resume=, loading, saving, the record, interrupts
finetune/    the fine-tuning run, evaluation and prediction, task module, metrics, baselines
pretrain/    the pretraining run and its checks, LightningModules, budget, probes
suites/      make glue, suite summaries, sweeps, seed statistics
infer/       generation, mask filling, LM scoring (imports run/ and checkpoint/ only)
report/      plots and tables of run folders (reads records only)
commands/    one thin entry point per make target; nothing imports them
"""
