"""The displays of the notebook and the terminal, as the engine makes them by name.

launch(display=MODE) and %%torchrun --display come to labutils.run.display, which
resolves "auto" (choose_mode) and calls the function its DISPLAYS table names for the
mode: one of these. display.py holds the text display, widgets.py the live panes (and
imports display.py); this module is the one that knows both, so neither of them
imports the other.
"""

from __future__ import annotations

from labutils.notebook.display import TextDisplay
from labutils.run.display import DISPLAY_MODES, Display, choose_mode, make_display

__all__ = ["DISPLAY_MODES", "choose_mode", "make_display", "text_display",
           "terminal_display", "widget_display"]


def text_display() -> Display:
    """Plain "[rank N] line" text, bounded per rank: papermill, nbval, a saved notebook."""
    return TextDisplay()


def terminal_display() -> Display:
    """Plain text without a bound: a terminal keeps everything."""
    return TextDisplay(limit=None)


def widget_display() -> Display:
    """Live panes in JupyterLab. Imported here, not at the top: ipywidgets takes about
    150 ms to import and only a live JupyterLab shows widgets (the CLI and papermill
    never do)."""
    from labutils.notebook.widgets import WidgetDisplay

    return WidgetDisplay()
