"""A rank's debugger in its pane: a text box for pdb commands, pdb's answers in the pane.

When a rank stops at breakpoint() or torch.distributed.breakpoint() (see
runtime/debugger.py), the widget display connects to the rank's debugger and puts a
text box under the rank's lines. A command typed there (Enter sends it) reaches pdb
while the cell is still running: like the Stop button, the box's messages are handed
to a kernel subshell (subshell.py), whose callback only queues the command; the
display sends it and shows pdb's answer from the main thread, at its next tick. The
box goes away when the session ends (``c``), the rank fails (``q``), or the run ends.
"""

from __future__ import annotations

import html
import queue

import ipywidgets as widgets

from labutils.notebook.subshell import route_clicks_to_subshell
from labutils.runtime.debugger import Console


class PaneConsole:
    """The pdb session of one rank, as its pane shows it.

    Args:
        rank: the rank being debugged.
        socket_path: its debugger's socket (the "waiting" debugger event's).
    """

    def __init__(self, rank: int, socket_path: str) -> None:
        self.rank = rank
        self.prompt = f"(Pdb rank {rank}) "
        self.console = Console(socket_path)
        self.typed: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.box = widgets.Text(placeholder=f"pdb command for rank {rank}, then Enter "
                                "(c continues, q ends the run)",
                                continuous_update=False,
                                layout=widgets.Layout(flex="1", width="auto"))
        self.box.add_class("labutils-debug-input")
        self.label = widgets.HTML(f"<code style='white-space:nowrap'>"
                                  f"{html.escape(self.prompt.strip())}</code>")
        self.widget = widgets.HBox([self.label, self.box],
                                   layout=widgets.Layout(align_items="center", grid_gap="6px"))
        self.widget.add_class("labutils-debug")
        self._partial = ""
        self._clear = False
        # observed in the subshell thread while the cell runs: queue, touch nothing else
        self.box.observe(self._typed, "value")
        self.live = route_clicks_to_subshell(self.box)

    def _typed(self, change) -> None:
        if change["new"]:
            self.typed.put(change["new"])

    @property
    def closed(self) -> bool:
        return self.console.closed.is_set()

    def exchange(self) -> list[str]:
        """Send the commands typed since the last call; the lines to add to the pane
        (each command echoed after the prompt, then pdb's answer)."""
        lines = []
        while True:
            try:
                command = self.typed.get_nowait()
            except queue.Empty:
                break
            lines.append(self.prompt + command)
            self.console.send(command)
            self._clear = True
        if self._clear:   # from this (the main) thread: the observer sees "" and ignores it
            self.box.value = ""
            self._clear = False
        text = self._partial + self.console.take().replace(self.prompt, "\n")
        *complete, self._partial = text.split("\n")
        lines += [line for line in complete if line.strip()]
        return lines

    def close(self) -> None:
        self.console.close()
        self.box.disabled = True
