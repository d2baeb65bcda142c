"""The runtime every actor stands on: the typed NATS bus, the embedded server or cluster, the actor
base, the supervisor, the task runner and the staleness manager."""
