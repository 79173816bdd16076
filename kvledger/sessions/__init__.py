"""Server-side conversations: the state store, memory policies, retrieval and the turn service.

A conversation is a chain of stored responses linked by ``previous_response_id`` (the OpenAI
Responses API). Each stored response keeps the exact token ids of its whole conversation
(prompt + generated), so a continuation appends only the new turn's template tokens and the
prefix cache covers everything before it.
"""
