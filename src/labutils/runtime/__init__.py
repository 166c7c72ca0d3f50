"""What runs inside the torchrun agent and the ranks (standard library only).

The run folder's layout and every LABUTILS_* variable (runfiles), process helpers
(procs), the agent wrapper (agent) and the worker bootstrap (worker). The launcher,
the display and the grader use these pieces too; nothing here imports them.
"""
