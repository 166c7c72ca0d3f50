"""The launcher: a checked request becomes torchrun agents, followed to their end.

options (one table of launch()'s options, from which the CLI, %%torchrun and node
commands are built), checks and spec (inputs checked, the torchrun command), launcher
(launch() and prepare()), follow (the follow loop), attempts (events folded into
attempts), backends (local agents or a SLURM job), nodes (the run-folder protocol
between nodes), outcome (how a run and each attempt ended), diagnosis (failures and
hangs), streams (per-rank output and events), result (RunResult and its JSON
summary), cli (`labutils`). docs/architecture.md follows one run through them.
"""
