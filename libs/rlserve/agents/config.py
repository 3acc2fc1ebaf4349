"""`env.name: external_agent`: a run whose episodes an agent program plays through the endpoint.

Its `env.args` (checked when the spec is read):

    tool_format     hermes | llama3: how the model family writes tool calls (`environments.tools.calls`),
                    which the endpoint parses out of completions into OpenAI `tool_calls`
    declare_tools   auto | template | system | none: how a request's `tools` reach the model: the chat
                    template's own `tools=` (template), a system message in `tool_format`'s words, as
                    the built-in tool_use environment writes it (system), the template when it renders
                    tools and else the system message (auto), or not at all (none: a model taught the
                    calls by SFT demonstrations, whose context cannot hold the schemas); the calls and
                    the tools' answers are written in `tool_format` unless the template takes them
    tasks           run | agent: the run hands out its data's rows (`GET /v1/episodes/next`), or the
                    agent brings its own tasks (`POST /v1/episodes`; the run then validates nothing)
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

EXTERNAL_AGENT = "external_agent"


class ExternalAgentArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    tool_format: Literal["hermes", "llama3"] = "hermes"
    declare_tools: Literal["auto", "template", "system", "none"] = "auto"
    tasks: Literal["run", "agent"] = "run"

    @classmethod
    def parse(cls, args: dict[str, Any]) -> ExternalAgentArgs:
        """The args, or ValueError naming the first bad key."""
        try:
            return cls.model_validate(args)
        except ValidationError as err:
            first = err.errors()[0]
            key = ".".join(str(p) for p in first["loc"]) or "args"
            raise ValueError(f"{key}: {first['msg']}") from None
