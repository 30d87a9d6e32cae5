"""How a run ends early: cancelled by its user, or failed with a message for them."""

from __future__ import annotations


class RunCancelled(Exception):
    pass


class RunStopped(Exception):
    """The learner is stopping (SIGTERM): the run was checkpointed at the step it was on and
    is left, unfinished, to the next learner that takes it."""


class RunFailed(Exception):
    """A run cannot go on; the message is for the user."""


class ReplicaUnreachable(RunFailed):
    """A replica could not be reached (it died or is restarting): the step goes on as long
    as another replica took the adapter."""
