"""Multi-agent workflows: the built-in four (the paper's three and the single-agent
control) and the small API for writing one's own.

    from marl.workflows import Workflow, prompts

    async def run(episode, problem):
        a = await episode.turn("solver", 0, prompts.generator(problem))
        ...
        return final_answer

    DEBATE = Workflow(name="debate", roles=("solver", "judge"), run=run)

and `workflow: my_package.my_module:DEBATE` in a run spec.
"""

from marl.workflows import prompts
from marl.workflows.base import Caps, Episode, EpisodeError, Workflow
from marl.workflows.registry import BUILTIN, resolve
from marl.workflows.routing import policy_of_role

__all__ = [
    "BUILTIN",
    "Caps",
    "Episode",
    "EpisodeError",
    "Workflow",
    "policy_of_role",
    "prompts",
    "resolve",
]
