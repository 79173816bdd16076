"""The OpenAI Agents SDK's default Runner (Responses model, no previous_response_id, parallel
tool calls allowed) completes a tool loop against kvledger, whole and streamed.

Usage: python agents_sdk.py BASE_URL MODEL (exit status 0 when every check holds)."""

import asyncio
import sys

from agents import (
    Agent,
    ModelSettings,
    Runner,
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


# tool_choice "required": the 135M model seldom calls a tool unasked; the SDK resets it after
# the call (reset_tool_choice), so the next turn answers. temperature 0: a repeatable test.
agent = Agent(name="weather", instructions="Call get_weather once, then answer in one sentence.",
              tools=[get_weather], model=model,
              model_settings=ModelSettings(tool_choice="required", temperature=0))


async def main() -> None:
    whole = await Runner.run(agent, "What is the weather in Paris?")
    streamed = Runner.run_streamed(agent, "What is the weather in Paris?")
    async for _ in streamed.stream_events():
        pass
    for result in (whole, streamed):
        kinds = [item.type for item in result.new_items]
        assert kinds[0] == "tool_call_item" and "tool_call_output_item" in kinds, kinds
        assert kinds[-1] == "message_output_item", kinds
        answer = str(result.final_output)
        assert answer.strip() and not answer.lstrip().startswith("<tool_"), answer
        print(kinds, repr(answer[:80]))


asyncio.run(main())
