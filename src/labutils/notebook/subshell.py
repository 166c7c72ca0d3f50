"""A widget's clicks handled while the cell is busy, on a kernel subshell.

launch() blocks the kernel's main thread until the run ends, and a kernel handles
widget messages on that thread, so a click on the widget display's Stop button
would wait in the queue until the cell has finished, when there is nothing left
to stop. route_clicks_to_subshell() has the kernel hand that button's messages to
a thread of their own.
"""

from __future__ import annotations

import concurrent.futures

import ipywidgets as widgets

_subshells: dict[int, str] = {}  # id(kernel) -> the subshell that takes Stop clicks


def route_clicks_to_subshell(button: widgets.Button) -> bool:
    """Make ``button``'s clicks run while the cell is busy; False where this kernel cannot.

    How (ipykernel >= 7.4): the kernel reads the shell socket on its own "shell
    channel" thread and hands each message to the main thread or to a *subshell*
    (a thread with its own event loop, created by a create_subshell_request).
    For a comm_msg it asks the target comm, ``comm._reply_subshell_for(data,
    default)``, which subshell gets the message. We create one subshell per
    kernel (in the shell channel thread, as a create_subshell_request would) and
    make the button's comm answer with it, so the click's on_click runs in the
    subshell thread while the main thread is still in launch(). The callback must
    only set a threading.Event that the launcher polls; no widget may be touched
    from that thread.

    Relies on ipykernel internals (shell_channel_thread.manager._create_subshell,
    BaseComm._reply_subshell_for). Outside a kernel, on older kernels or if those
    names change, it returns False and the display points at Jupyter's
    interrupt button, which launch() turns into a clean stop.

    Args:
        button: a widget shown in this kernel whose on_click callbacks are thread-safe.
    """
    try:
        from IPython import get_ipython

        kernel = getattr(get_ipython(), "kernel", None)
        channel = getattr(kernel, "shell_channel_thread", None)
        comm = getattr(button, "comm", None)
        if channel is None or comm is None or not hasattr(comm, "_reply_subshell_for"):
            return False
        manager = channel.manager  # created lazily, and only from this (the main) thread
        subshell_id = _subshells.get(id(kernel))
        if subshell_id not in manager.list_subshell():  # none yet, or a client deleted it
            created: concurrent.futures.Future[str] = concurrent.futures.Future()

            def create() -> None:  # runs in the shell channel thread
                try:
                    created.set_result(manager._create_subshell())
                except BaseException as exc:  # noqa: BLE001 - handed back to the caller
                    created.set_exception(exc)

            channel.io_loop.add_callback(create)
            subshell_id = _subshells[id(kernel)] = created.result(timeout=5)
    except Exception:  # noqa: BLE001 - any mismatch means: fall back to the interrupt button
        return False
    comm._reply_subshell_for = lambda data, default: subshell_id
    return True
