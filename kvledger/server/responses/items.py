"""Output items of a Responses turn whose request has tools: text, then function calls.

A reply is parsed (:class:`~kvledger.server.tools.parser.ToolCallParser`) into an optional
``message`` item (the text before the first call) and one ``function_call`` item per complete
call: ``{"type": "function_call", "id", "call_id", "name", "arguments", "status"}``. Streamed,
each item is opened with ``response.output_item.added`` when its first piece arrives; a message
then gets ``response.content_part.added`` and ``response.output_text.delta`` events, a call
``response.function_call_arguments.delta`` events; it is closed (``.done`` events, then
``response.output_item.done``) when the next item starts or the reply ends. Item ids are fixed
by the response id and the call's index, so the streamed items equal the final response's.
"""

from __future__ import annotations

from typing import Any

from kvledger.server.tools.parser import ToolCallParser


def call_item(response_id: str, index: int, name: str, arguments: str, status: str) -> dict:
    """The ``function_call`` output item of a response's call ``index``."""
    base = response_id.removeprefix("resp_")
    return {"type": "function_call", "id": f"fc_{base}_{index}",
            "call_id": f"call_{base}_{index}", "name": name, "arguments": arguments,
            "status": status}


def output_items(builder: Any, parser: ToolCallParser, text: str, status: str) -> list[dict]:
    """The final output items of a whole reply (``parser`` fresh)."""
    parser.feed(text)
    parser.finish()
    calls = [c for c in parser.calls if c.complete]
    items = []
    if parser.content.strip() or not calls:
        items.append(builder.message_item(parser.content if calls else text, status))
    items += [call_item(builder.id, i, c.name, c.arguments, "completed")
              for i, c in enumerate(calls)]
    return items


class StreamedItems:
    """The stream events of a reply's items, fed the text deltas.

    Args:
        builder: the turn's ``ResponseBuilder`` (events with sequence numbers, the message).
        parser: a fresh parser for this reply.
    """

    def __init__(self, builder: Any, parser: ToolCallParser) -> None:
        self.builder = builder
        self.parser = parser
        self.count = 0  # items opened so far
        self.open: dict | None = None  # the open item, at output index ``index``
        self.index = 0
        self.text = ""  # the message's text

    def feed(self, delta: str, finished: bool = False) -> str:
        """Events of the next text delta (and of the end of the reply when ``finished``)."""
        events = self.parser.feed(delta) + (self.parser.finish() if finished else [])
        sse = []
        for kind, *rest in events:
            if kind == "content":
                sse.append(self._content(rest[0]))
            elif kind == "call":
                sse.append(self._close())
                sse.append(self._open(call_item(self.builder.id, rest[0], rest[1], "",
                                                "in_progress")))
            elif rest[1]:
                self.open["arguments"] += rest[1]
                sse.append(self._event("response.function_call_arguments.delta",
                                       item_id=self.open["id"], delta=rest[1]))
        if finished:
            sse.append(self._close())
        return "".join(sse)

    def _event(self, kind: str, **fields: Any) -> str:
        return self.builder.event(kind, output_index=self.index, **fields)

    def _open(self, item: dict) -> str:
        self.open, self.index = item, self.count
        self.count += 1
        return self._event("response.output_item.added", item=item)

    def _content(self, text: str) -> str:
        opening = ""
        if self.open is None:
            opening = self._open(self.builder.message_item("", "in_progress"))
            opening += self._event("response.content_part.added", item_id=self.open["id"],
                                   content_index=0, part={"type": "output_text", "text": "",
                                                          "annotations": []})
        self.text += text
        return opening + self._event("response.output_text.delta", item_id=self.open["id"],
                                     content_index=0, delta=text, logprobs=[])

    def _close(self) -> str:
        """The events that close the open item, if any."""
        item, self.open = self.open, None
        if item is None:
            return ""
        if item["type"] == "function_call":
            done = {**item, "status": "completed"}
            return (self._event("response.function_call_arguments.done", item_id=item["id"],
                                arguments=item["arguments"])
                    + self._event("response.output_item.done", item=done))
        part = {"type": "output_text", "text": self.text, "annotations": []}
        done = self.builder.message_item(self.text, "completed")
        return (self._event("response.output_text.done", item_id=item["id"], content_index=0,
                            text=self.text, logprobs=[])
                + self._event("response.content_part.done", item_id=item["id"],
                              content_index=0, part=part)
                + self._event("response.output_item.done", item=done))
