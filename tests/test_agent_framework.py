"""A real agent framework against a live server: pydantic-ai's OpenAI chat model runs a two-tool agent loop.

The tiny random model has no idea what a tool is, so the test steers only what the model may choose: the
first token of a turn is pushed towards a call (logit_bias on "{", the generic format's first character),
and each tool is offered until it has been called (a pydantic-ai `prepare` hook). Everything else is the
framework's own loop over the server: it sends the tools, parses the calls the grammar made valid, runs
the Python functions, sends their results back as `tool` messages, and ends when the model answers in text.
"""

from __future__ import annotations

from typing import Literal

import httpx
import pytest

pytest.importorskip("pydantic_ai")

from pydantic_ai import Agent, RunContext  # noqa: E402
from pydantic_ai.messages import ToolCallPart, ToolReturnPart  # noqa: E402
from pydantic_ai.models.openai import OpenAIChatModel  # noqa: E402
from pydantic_ai.providers.openai import OpenAIProvider  # noqa: E402
from pydantic_ai.tools import ToolDefinition  # noqa: E402

from steadyserve.testing.server import ServerProcess  # noqa: E402


@pytest.fixture(scope="module")
def srv(long_model: str):
    with ServerProcess(long_model, "--grpc-port", "-1", "--served-model-name", "tiny") as s:
        yield s


def called(ctx: RunContext) -> set[str]:
    return {p.tool_name for m in ctx.messages for p in getattr(m, "parts", []) if isinstance(p, ToolCallPart)}


async def until_called(ctx: RunContext, tool: ToolDefinition) -> ToolDefinition | None:
    """A tool is offered until it has been called: two calls, then an answer."""
    return None if tool.name in called(ctx) else tool


def test_two_tool_agent_loop(srv) -> None:
    brace = httpx.post(srv.http_url + "/tokenize", json={"prompt": "{", "add_special_tokens": False}).json()["tokens"]
    model = OpenAIChatModel("tiny", provider=OpenAIProvider(base_url=srv.http_url + "/v1", api_key="unused"))
    agent = Agent(model, model_settings={
        "temperature": 0, "max_tokens": 200, "parallel_tool_calls": False, "logit_bias": {str(brace[0]): 100}})
    ran: list[tuple[str, str]] = []

    @agent.tool_plain(prepare=until_called)
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        ran.append(("get_weather", city))
        return f"sunny in {city}"

    @agent.tool_plain(prepare=until_called)
    def get_time(zone: Literal["UTC", "CET"]) -> str:
        """The time in a zone."""
        ran.append(("get_time", zone))
        return f"12:00 {zone}"

    result = agent.run_sync("What is the weather in Paris, and the time?")
    assert sorted(name for name, _ in ran) == ["get_time", "get_weather"]  # both tools ran, with valid arguments
    returns = [p for m in result.all_messages() for p in getattr(m, "parts", []) if isinstance(p, ToolReturnPart)]
    assert [r.content for r in returns] == [("sunny in " if n == "get_weather" else "12:00 ") + a for n, a in ran]
    assert isinstance(result.output, str) and result.output  # it read the results and answered in text
