"""Refuse plain-TCP Dask comms in a process, and record every attempt.

Imported as a Dask preload (``distributed.worker.preload``), it guards the worker process
that imports it; :func:`install` guards any other process (the test's own, a script's).
Each attempt to connect or listen over ``tcp://`` appends a line to the file named by
``DLSPARK_TEST_TCP_LOG`` and raises. TLS (``tls://``) has a backend of its own and is
untouched.
"""

from __future__ import annotations

import os

from distributed.comm import registry
from distributed.comm.tcp import TCPBackend

LOG_VARIABLE = "DLSPARK_TEST_TCP_LOG"


class RefusingTCPBackend(TCPBackend):
    """Dask's TCP backend for address handling; connecting and listening are refused."""

    def _refuse(self, what, where):
        log = os.environ.get(LOG_VARIABLE)
        if log:
            with open(log, "a") as f:
                f.write(f"pid {os.getpid()}: {what} tcp://{where}\n")
        raise OSError(f"plain TCP refused in this process ({what} tcp://{where}): the cluster must use tls://")

    def get_connector(self):
        backend = self

        class Refused:
            async def connect(self, address, deserialize=True, **kwargs):
                backend._refuse("connect to", address)

        return Refused()

    def get_listener(self, loc, handle_comm, deserialize, **connection_args):
        self._refuse("listen on", loc)


def install():
    """Refuse plain TCP in this process."""
    registry.backends["tcp"] = RefusingTCPBackend()


def uninstall():
    """Plain TCP works again in this process (Dask's backend holds no state)."""
    registry.backends["tcp"] = TCPBackend()


def guarded() -> bool:
    """Whether this process refuses plain TCP (run on workers to check the preload took)."""
    return isinstance(registry.backends["tcp"], RefusingTCPBackend)


if os.environ.get(LOG_VARIABLE):  # imported as a preload by a worker of a guarded cluster
    install()
