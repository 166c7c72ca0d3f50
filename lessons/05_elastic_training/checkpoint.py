"""Checkpoints that survive a crash: the full training state, written atomically.

Used by train_resumable.py; the notebook reads the files it writes.

- rng_state() / set_rng_state(): every random number generator a training step
  touches (torch, numpy, Python's random), as tensors and plain values, so the
  checkpoint loads with torch.load(weights_only=True).
- write_checkpoint(): serialise, then write a temporary file next to the target,
  flush, fsync and os.replace() it over the target. os.replace is atomic on POSIX: a
  reader (or a restarted run) sees the old file or the new one, never half of one.
  writer="naive" writes straight into the target instead, the way torch.save(obj,
  path) does, to show what a crash in the middle does to it.
- read_checkpoint(): torch.load on every rank, with map_location so a checkpoint
  written from cuda:0 lands on this rank's own device.
"""

from __future__ import annotations

import io
import os
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

LATEST = "latest.pt"


def rng_state() -> dict:
    """This process's RNG states as tensors and plain values (weights_only-safe)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, python_state, gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        # np.random.get_state() holds a numpy array, which weights_only=True refuses
        # to unpickle: keep its numbers as a tensor and plain ints instead.
        "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": {"version": version, "state": list(python_state), "gauss": gauss},
    }


def set_rng_state(state: dict) -> None:
    """Restore what rng_state() captured."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))


def write_checkpoint(state: dict, path: str | os.PathLike, *, writer: str = "atomic",
                     halfway: Callable[[], None] | None = None) -> None:
    """Write state to path; call halfway() when half of the bytes are on disk.

    Args:
        state: what torch.save should store.
        path: the checkpoint file (e.g. ckpt_dir/latest.pt).
        writer: "atomic" (temporary file, fsync, os.replace) or "naive" (write into
            path directly, as torch.save(state, path) does).
        halfway: called in the middle of the write; the lesson reports a step there,
            so a fault can kill the rank while the file is half written.
    """
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    path = Path(path)
    target = path.with_name(path.name + ".tmp") if writer == "atomic" else path
    with open(target, "wb") as f:
        f.write(data[: len(data) // 2])
        f.flush()
        if halfway is not None:
            halfway()
        f.write(data[len(data) // 2:])
        f.flush()
        os.fsync(f.fileno())  # the bytes are on disk before the rename makes them "latest"
    if writer == "atomic":
        os.replace(target, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)  # make the rename itself durable
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def read_checkpoint(path: str | os.PathLike, device: torch.device) -> dict | None:
    """The checkpoint at path on this rank's device, or None when there is none yet."""
    if not Path(path).exists():
        return None
    # weights_only=True (torch's default since 2.6) unpickles tensors, numbers, strings,
    # lists, tuples and dicts only: a checkpoint cannot run code when it is loaded.
    return torch.load(path, map_location=device, weights_only=True)
