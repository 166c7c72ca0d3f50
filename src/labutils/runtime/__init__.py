"""What runs inside the torchrun agent and the ranks (standard library only).

The run folder's layout and every LABUTILS_* variable (runfiles), process helpers
(procs), whose code a stack frame is (frames), the keeper and torchrun agent, which
also records how each rank it reaps ended (agent), the worker bootstrap (worker), the
warm server that warm runs fork from (server), and a rank's debugger over a socket
(debugger). The launcher, the display and the grader use these pieces too; nothing
here imports them.
"""
