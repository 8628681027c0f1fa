"""Wiring: Hydra entry points, config checks, LightningModules, optimizers and schedules."""
