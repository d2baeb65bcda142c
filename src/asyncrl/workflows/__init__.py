"""Rollout workflows: RLVR (:mod:`.rlvr`), multi-turn (:mod:`.multi_turn`), agents with
tools (:mod:`.agent`), a user's own code (:mod:`.code`), and the recipe's
``rollout.workflow``, one config per kind that builds its workflow (:mod:`.config`). The
contract they implement is :mod:`asyncrl.api.workflow`; agent code and ``verifiers``
environments run through the endpoint (:mod:`asyncrl.endpoint`)."""
