"""What a run looks like in a notebook or a terminal: displays, widgets, %%torchrun."""
