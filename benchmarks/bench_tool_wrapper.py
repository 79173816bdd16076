"""Tool round trips through LangChain and the OpenAI Agents SDK against a live ``kvledger serve``,
counting final answers that begin with a tool wrapper tag (``<tool_response>``, ``<tool_call>``,
``</tool_call>``): the measurement behind docs/clients.md's "Tool results" table.

Runs in the clients venv (tests/clients/requirements.txt):
    .venv-clients/bin/python benchmarks/bench_tool_wrapper.py http://127.0.0.1:8000/v1 smollm2 \\
        --trials 10
Each trial forces one get_weather call for a city, returns its result, and lets the model
answer (default temperature, 128 tokens at most per reply). Prints one JSON line per library: trials,
answers counted (a trial whose forced call or answer did not come back whole is not), and
those that begin with a wrapper."""

import argparse
import asyncio
import json
import re

from agents import (
    Agent,
    ModelBehaviorError,
    ModelSettings,
    Runner,
    ToolsToFinalOutputResult,
    function_tool,
    set_default_openai_client,
    set_tracing_disabled,
)
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from openai import AsyncOpenAI

WRAPPER = re.compile(r"^\s*</?tool_\w+>")
CITIES = ["Paris", "Berlin", "Madrid", "Rome", "Lisbon", "Vienna", "Oslo", "Prague", "Dublin",
          "Athens", "Warsaw", "Helsinki"]
ANSWER_TOKENS = 128


def get_weather(city: str) -> str:
    """Current weather of a city."""
    return f"The weather in {city} is sunny, 21 C."


def langchain_answers(base_url: str, model: str, trials: int) -> list[str | None]:
    """Answers after a forced call (None: the forced call came back without a call)."""
    weather = tool(get_weather)
    llm = ChatOpenAI(base_url=base_url, api_key="none", model=model, max_tokens=ANSWER_TOKENS)
    answers = []
    for city in (CITIES * trials)[:trials]:
        ask = HumanMessage(f"What is the weather in {city}?")
        first = llm.bind_tools([weather], tool_choice="get_weather").invoke([ask])
        if not first.tool_calls:
            answers.append(None)
            continue
        call = first.tool_calls[0]
        result = ToolMessage(weather.invoke(call["args"]), tool_call_id=call["id"])
        final = llm.bind_tools([weather], tool_choice="none").invoke([ask, first, result])
        answers.append(final.text)
    return answers


def agents_answers(base_url: str, model: str, trials: int) -> list[str | None]:
    """The Agents SDK's default Runner; None: the model called the tool again instead, or a
    reply hit the token cap (the SDK raises on an incomplete response)."""
    set_default_openai_client(AsyncOpenAI(base_url=base_url, api_key="none"))
    set_tracing_disabled(True)

    def second_call_ends(context, results) -> ToolsToFinalOutputResult:
        context.context["calls"] = context.context.get("calls", 0) + 1
        return ToolsToFinalOutputResult(context.context["calls"] > 1, None)

    agent = Agent(name="weather", instructions="Call get_weather once, then answer in one "
                  "sentence.", tools=[function_tool(get_weather)],
                  model=model, tool_use_behavior=second_call_ends,
                  model_settings=ModelSettings(tool_choice="required",
                                               max_tokens=ANSWER_TOKENS))

    async def run() -> list[str | None]:
        answers = []
        for city in (CITIES * trials)[:trials]:
            try:
                result = await Runner.run(agent, f"What is the weather in {city}?", context={})
            except ModelBehaviorError:  # a reply cut at the cap: the SDK raises, no text
                answers.append(None)
                continue
            answers.append(result.final_output)
        return answers

    return asyncio.run(run())


LIBRARIES = {"langchain": langchain_answers, "agents_sdk": agents_answers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base_url")
    parser.add_argument("model")
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--library", choices=list(LIBRARIES), action="append",
                        help="only these (repeatable; default: both)")
    args = parser.parse_args()
    for name in args.library or LIBRARIES:
        collect = LIBRARIES[name]
        answers = collect(args.base_url, args.model, args.trials)
        counted = [a for a in answers if a is not None]
        wrapped = [a[:40] for a in counted if WRAPPER.match(a)]
        print(json.dumps({"library": name, "trials": len(answers), "answers": len(counted),
                          "begin_with_wrapper": len(wrapped), "wrapped": wrapped}), flush=True)


if __name__ == "__main__":
    main()
