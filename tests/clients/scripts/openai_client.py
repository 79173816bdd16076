"""The official openai client against kvledger: Chat Completions and Responses, a tool round
trip on each (Responses: stateless, the whole conversation resent).

Usage: python openai_client.py BASE_URL MODEL (exit status 0 when every check holds)."""

import sys

from openai import OpenAI

base_url, model = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=base_url, api_key="none")
ask = "What is the weather in Paris?"
tool = {"type": "function", "name": "get_weather", "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}

chat_tool = {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
messages = [{"role": "user", "content": ask}]
r = client.chat.completions.create(model=model, messages=messages, tools=[chat_tool],
                                   tool_choice="required", temperature=0)
messages.append(r.choices[0].message.model_dump(exclude_none=True))
messages += [{"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}
             for call in r.choices[0].message.tool_calls]  # every call gets its result
# tool_choice "none" for the answer: the 135M model would otherwise call again
r = client.chat.completions.create(model=model, messages=messages, tools=[chat_tool],
                                   tool_choice="none", temperature=0, max_tokens=64)
assert r.choices[0].message.content, r
print("chat:", repr(r.choices[0].message.content[:80]))

items = [{"role": "user", "content": ask}]
r = client.responses.create(model=model, input=items, tools=[tool], tool_choice="required",
                            temperature=0)
items += [o.model_dump(exclude_none=True) for o in r.output]  # the whole turn, resent
items += [{"type": "function_call_output", "call_id": o.call_id, "output": "sunny, 21 C"}
          for o in r.output if o.type == "function_call"]
r = client.responses.create(model=model, input=items, tools=[tool], tool_choice="none",
                            temperature=0, max_output_tokens=64)
assert r.output_text, r
print("responses:", repr(r.output_text[:80]))
