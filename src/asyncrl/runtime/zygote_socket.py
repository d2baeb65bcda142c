"""The variable that names a fork-server zygote's socket (:mod:`asyncrl.entry.zygote`), in a
module of its own: the zygote's command client, which must start at once, reads it without
the runtime's imports (:mod:`asyncrl.runtime.forks` loads NATS)."""

ZYGOTE_ENV = "ASYNCRL_FORK_ZYGOTE"
"""The Unix socket of a zygote that ``up`` asks for the run's fork server, and that
:func:`asyncrl.entry.zygote.run_through` asks to run a command, where the environment
has it."""
