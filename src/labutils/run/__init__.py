"""The launcher: a checked request becomes torchrun agents, followed to their end.

options (one table of launch()'s options, from which the CLI, %%torchrun and node
commands are built), checks and spec (inputs checked, the torchrun command), launcher
(launch() and prepare()), warm (warm or cold, and the warm servers), follow (the
follow loop), attempts (events folded into attempts), states (rank states and
endings), backends (the Backend interface and this machine's agents), nodes (the
run-folder protocol between nodes), network (a node's interface), outcome (how a run
and each attempt ended), diagnosis (failures), crash (fatal signals' dumps), hang (hang
reports), streams (per-rank output and events), display (the Display interface), result
(RunResult and its JSON summary), world (persistent ranks for a notebook). The command
line is labutils.cli, above every package. docs/architecture.md follows one run
through them.
"""
