"""Which display a run gets: the display modes and the choice between them.

display.py holds the Display interface and the text display, widgets.py the live
panes (and imports display.py). This module is the one that knows both, so
neither of them imports the other; launch(display=...) and %%torchrun --display
come here.
"""

from __future__ import annotations

import os

from labutils.errors import LaunchConfigError
from labutils.notebook.display import Display, TextDisplay
from labutils.runtime import runfiles

DISPLAY_MODES = ("auto", "widgets", "text", "terminal", "none")


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and hasattr(shell, "kernel")


def choose_mode(mode: str = "auto") -> str:
    """Resolve "auto": widgets in a live JupyterLab, text elsewhere.

    JupyterLab's server sets JPY_SESSION_NAME for the kernels it starts; papermill,
    nbval and nbconvert start kernels without it and render no widgets, so they get
    text that is saved in the notebook. LABUTILS_DISPLAY overrides the choice.

    Args:
        mode: one of DISPLAY_MODES; any mode but "auto" is returned as it is.
    """
    mode = os.environ.get(runfiles.ENV_DISPLAY, mode) if mode == "auto" else mode
    if mode != "auto":
        return mode
    if _in_kernel():
        return "widgets" if os.environ.get("JPY_SESSION_NAME") else "text"
    return "text"


def make_display(mode: str = "auto") -> Display:
    """A display for the mode ("auto", "widgets", "text", "terminal" or "none").

    Args:
        mode: one of DISPLAY_MODES; "auto" is resolved by choose_mode().
    """
    if mode not in DISPLAY_MODES:
        raise LaunchConfigError("display", expected=" | ".join(DISPLAY_MODES), given=mode,
                                fix="pass display='auto' to choose by where the code runs")
    mode = choose_mode(mode)
    if mode == "widgets":
        # Imported here, not at the top: ipywidgets takes about 150 ms to import and
        # only a live JupyterLab shows widgets (the CLI and papermill never do).
        from labutils.notebook.widgets import WidgetDisplay

        return WidgetDisplay()
    if mode == "terminal":
        return TextDisplay(limit=None)
    if mode == "none":
        return Display()
    return TextDisplay()
