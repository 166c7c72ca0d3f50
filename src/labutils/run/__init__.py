"""The launcher: a checked request becomes torchrun agents, followed to their end.

spec (inputs and the torchrun command), launcher (starting, following and ending
a run), streams (per-rank output and events from the run folder), diagnosis
(failures and hangs), result (RunResult and its JSON summary), cli (`labutils`).
"""
