"""What a run looks like in a notebook or a terminal.

display (the Display interface and the [rank N] text display), widgets (live
per-rank panes in JupyterLab, built from panes, with Stop clicks on a kernel
subshell), modes (which of them a run gets; the only module that knows both),
magics (%%torchrun).
"""
