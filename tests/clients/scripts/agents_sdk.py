"""The OpenAI Agents SDK's default Runner (Responses model, no previous_response_id, parallel
tool calls allowed) completes a tool loop against kvledger, whole and streamed.

Usage: python agents_sdk.py BASE_URL MODEL (exit status 0 when every check holds)."""

import asyncio
import sys

from agents import (
    Agent,
    ModelSettings,
    Runner,
    ToolsToFinalOutputResult,
    function_tool,
    set_default_openai_client,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

base_url, model = sys.argv[1], sys.argv[2]
set_default_openai_client(AsyncOpenAI(base_url=base_url, api_key="none"))
set_tracing_disabled(True)  # no traces to OpenAI's platform


@function_tool
def get_weather(city: str) -> str:
    """Current weather of a city."""
    return f"The weather in {city} is sunny, 21 C."


AGAIN = "(the model called get_weather again)"


def second_call_ends(context, results) -> ToolsToFinalOutputResult:
    """Whether a round of tool results ends the run: the first goes back to the model (the
    request under test: the SDK resends function_call + function_call_output items), a second
    call ends it, since whether a 135M model calls again is the model's choice, not the
    server's."""
    context.context["calls"] = context.context.get("calls", 0) + 1
    return ToolsToFinalOutputResult(context.context["calls"] > 1, AGAIN)


# tool_choice "required": the 135M model seldom calls a tool unasked; the SDK resets it after
# the call (reset_tool_choice), so the next turn may answer. temperature 0: repeatable.
agent = Agent(name="weather", instructions="Call get_weather once, then answer in one sentence.",
              tools=[get_weather], model=model, tool_use_behavior=second_call_ends,
              model_settings=ModelSettings(tool_choice="required", temperature=0))


async def main() -> None:
    whole = await Runner.run(agent, "What is the weather in Paris?", context={})
    streamed = Runner.run_streamed(agent, "What is the weather in Paris?", context={})
    async for _ in streamed.stream_events():
        pass
    for result in (whole, streamed):
        kinds = [item.type for item in result.new_items]
        assert kinds[0] == "tool_call_item" and "tool_call_output_item" in kinds, kinds
        answer = str(result.final_output)
        if answer != AGAIN:  # the model answered after the tool's result
            assert kinds[-1] == "message_output_item", kinds
            assert answer.strip() and not answer.lstrip().startswith("<tool_"), answer
        print(kinds, repr(answer[:80]))


asyncio.run(main())
