"""LangChain's ChatOpenAI against kvledger: with_structured_output in its three methods, and a
tool round trip whose answer does not copy a wrapper.

Usage: python langchain_chat.py BASE_URL MODEL (exit status 0 when every check holds)."""

import json
import sys

from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

base_url, model = sys.argv[1], sys.argv[2]
llm = ChatOpenAI(base_url=base_url, api_key="none", model=model, temperature=0,
                 max_tokens=200)


class City(BaseModel):
    """A city and its country."""

    name: str
    country: str


ASK = "Name a city in France and its country."
# json_schema: the server constrains the reply to the schema (response_format json_schema)
city = llm.with_structured_output(City, method="json_schema").invoke(ASK)
assert isinstance(city, City) and city.name, city
# function_calling: a forced call of a tool named City, its arguments constrained
city = llm.with_structured_output(City, method="function_calling").invoke(ASK)
assert isinstance(city, City) and city.name, city
# json_mode: response_format json_object, a JSON object (any keys; the schema is not sent)
out = llm.with_structured_output(City, method="json_mode", include_raw=True).invoke(
    ASK + " Answer in JSON with keys name and country.")
assert isinstance(json.loads(out["raw"].content), dict), out
print("structured: json_schema, function_calling, json_mode", out["raw"].content[:60])


@tool
def get_weather(city: str) -> str:
    """Current weather of a city."""
    return f"The weather in {city} is sunny, 21 C."


ask = HumanMessage("What is the weather in Paris?")
first = llm.bind_tools([get_weather], tool_choice="get_weather").invoke([ask])
call = first.tool_calls[0]
result = ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])
# tool_choice "none" for the answer: the 135M model would otherwise call again
final = llm.bind_tools([get_weather], tool_choice="none").invoke([ask, first, result])
assert final.text.strip() and not final.text.lstrip().startswith("<tool_"), final.text
print("tool round trip:", repr(final.text[:80]))
