"""A persistent worker's snapshot is copied while the request is handed over.

Scheduling a save on a persistent worker holds the trainer for two things: the snapshot's
copy (bound by memory bandwidth) and the hand-over (the request
pickled, sent, unpickled by the worker, its preload step run; upstream's ``preload_q.join()``
waits for that). Neither needs the other: the request holds views of the staging segment
whatever the segment holds yet. So the copy runs on a thread of the trainer while the request
is handed over, and the worker's preload step first waits for the copy's end, read from a pipe
(a system call each side, so the copied bytes are visible to the worker on any CPU).

The trainer returns from scheduling only once the copy is over (:meth:`PendingCopy.wait`):
no tensor of the trainer can change before it is copied, whether or not the worker's
preload step ran. A copy that fails is raised on the trainer, and the worker's preload step
raises instead of writing (the worker ends, as on any error in its preload step).
"""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

#: What the trainer sends the worker once the copy is over: the copy's outcome.
COPIED, FAILED = b"copied", b"failed"


class SnapshotCopyError(RuntimeError):
    """The snapshot's copy failed on the trainer: the worker must not write its buffers."""


class PendingCopy:
    """A snapshot's copy running on a thread, and the pipe its worker waits on."""

    def __init__(self, copy: Callable[[], None]) -> None:
        #: the end the request carries to the worker (pickled as a descriptor)
        self.reader, self._writer = multiprocessing.Pipe(duplex=False)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(copy,),
                                        name="mcf-snapshot-copy", daemon=True)
        self._thread.start()

    def _run(self, copy: Callable[[], None]) -> None:
        try:
            copy()
        except BaseException as exc:  # the trainer raises it from wait()
            self._error = exc
        finally:
            try:
                self._writer.send_bytes(FAILED if self._error else COPIED)
            except OSError:  # every reader is closed: no worker waits for this copy
                pass
            finally:
                self._writer.close()

    def wait(self) -> None:
        """Return once the copy is over; raise what it raised."""
        self._thread.join()
        if self._error is not None:
            raise self._error


def wait_for_copy(ready: Connection) -> None:
    """In the worker, before anything reads the staging: the trainer's copy is over.

    Raises :class:`SnapshotCopyError` if the copy failed or the trainer closed the pipe
    without an outcome (it died), so the worker never writes a partly copied segment."""
    try:
        outcome = ready.recv_bytes()
    except EOFError:
        outcome = b""
    finally:
        ready.close()
    if outcome != COPIED:
        raise SnapshotCopyError("the trainer's snapshot copy did not complete "
                                f"({outcome.decode() or 'no outcome'}): nothing is written")
