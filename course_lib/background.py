"""Work that runs in a thread of its own while the notebook goes on; its output is shown when you wait for it.

    job = cl.launch(cfg, nproc=2, env=plan.env, wait=False)  # returns at once (chapter 11 on one GPU: CPU ranks
    ...                                                      # run while the GPU runs the cells in between)
    run = job.wait()    # prints the ranks' lines (those so far, then as they come); the Run, or its LaunchError

Why the work does not print itself: a line printed from another thread lands in whichever cell runs at that moment.
So the work hands its lines to `emit`, and `wait()` prints them in the cell that waits. Interrupting `wait()` sets
`stop`, which the work checks (a launch then kills every process of its run), and lets the interrupt through.
"""
from __future__ import annotations

import queue
import threading


class Background:
    """Runs `work(emit, stop)` in a daemon thread: `emit(line)` queues a line for `wait()` to print; `stop` is a
    `threading.Event` the work checks now and then and ends on."""

    def __init__(self, work):
        self.lines, self.stop = queue.Queue(), threading.Event()
        self._result, self._error = None, None
        self._thread = threading.Thread(target=self._run, args=(work,), daemon=True)
        self._thread.start()

    def _run(self, work) -> None:
        try:
            self._result = work(self.lines.put, self.stop)
        except BaseException as e:  # noqa: BLE001  handed to the caller by wait()
            self._error = e

    def done(self) -> bool:
        """Whether the work has ended (its lines may still wait to be printed)."""
        return not self._thread.is_alive()

    def wait(self):
        """Print the work's lines until it ends; return its result, or raise its error."""
        try:
            while not self.done() or not self.lines.empty():
                try:
                    print(self.lines.get(timeout=0.2), flush=True)
                except queue.Empty:
                    pass
        except BaseException:  # a kernel interrupt: stop the work (it cleans up after itself), then go on raising
            self.stop.set()
            self._thread.join(60)
            raise
        if self._error is not None:
            raise self._error
        return self._result
