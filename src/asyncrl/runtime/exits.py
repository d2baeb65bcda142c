"""How an actor says that starting it again would not help.

Most deaths of a running actor are bad luck (a killed process, a lost node), and the
supervisor starts a replacement within ``run.max_restarts``. Some are a setup the run
refuses, found only once it is up: the version-0 mismatch gate is one. A replacement
would fail the same way after its back-off, ``max_restarts`` times over, and bury the one
message that matters under restarts. An actor that raises :class:`FatalError` exits with
:data:`FATAL_EXIT` and says ``fatal`` in its :class:`~asyncrl.wire.messages.ActorExit`;
the supervisor then ends the run with its reason instead of replacing it.
"""

from __future__ import annotations

FATAL_EXIT = 3
"""The exit code of an actor that failed with a :class:`FatalError`."""


class FatalError(Exception):
    """An error that restarting the actor cannot mend; the run ends with its message."""
