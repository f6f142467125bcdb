"""Agent loops that append tool output to a long, growing context (pure).

Each agent starts from a long system message of tool definitions (shared by every agent) and a task;
every step sends the whole context, then appends a short fake assistant action and a long tool
output. Prompts grow fast and each is an exact prefix of the agent's next one: the pattern of coding
and tool-use agents (Mooncake's "toolagent" trace is of this kind). Tool output is sent as a user
message opening with ``Tool output:`` rather than a ``tool`` role message, because some chat templates
drop roles they do not know. An agent stops before a step that would pass ``max_context_tokens``.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

from loadtests.workloads.base import PromptFormat, RequestSpec, check_format, check_positive
from loadtests.workloads.chat import ConversationShape, grow_conversations


@dataclass(frozen=True, slots=True)
class AgentWorkload:
    """``agents`` loops of up to ``steps`` requests over a growing tool-use context."""

    name: ClassVar[str] = "agent"

    agents: int = 8
    """Concurrent agent loops (sessions)."""

    steps: int = 8
    """Requests per loop, unless ``max_context_tokens`` ends it first."""

    tools_tokens: int = 2000
    """Tool definitions in the system message, shared by every agent, in tokens."""

    task_tokens: int = 300
    """The task (first user message) of each agent, in tokens."""

    action_tokens: int = 50
    """Each fake assistant action (tool call) appended to the context, in tokens."""

    tool_output_tokens: int = 1000
    """Each tool output appended to the context, in tokens."""

    max_context_tokens: int = 16_000
    """A loop ends before a step whose prompt would pass this many tokens."""

    max_tokens: int = 50
    """Completion tokens asked for per request (the next action)."""

    prompt_format: PromptFormat = "chat"
    """``chat`` (messages, text) or ``tokens`` (toy token ids to ``/v1/completions``)."""

    def __post_init__(self) -> None:
        check_positive(
            self.name,
            agents=self.agents,
            steps=self.steps,
            tools_tokens=self.tools_tokens,
            task_tokens=self.task_tokens,
            action_tokens=self.action_tokens,
            tool_output_tokens=self.tool_output_tokens,
            max_context_tokens=self.max_context_tokens,
            max_tokens=self.max_tokens,
        )
        check_format(self.name, self.prompt_format)

    def generate(self, rng: random.Random) -> Iterator[RequestSpec]:
        shape = ConversationShape(
            system_tokens=self.tools_tokens,
            opener_tokens=self.task_tokens,
            reply_tokens=self.action_tokens,
            followup_tokens=self.tool_output_tokens,
            followup_prefix="Tool output:",
            max_context_tokens=self.max_context_tokens,
        )
        return grow_conversations(
            rng,
            shape,
            workload=self.name,
            sessions=self.agents,
            turns=self.steps,
            prompt_format=self.prompt_format,
            max_tokens=self.max_tokens,
        )
