"""Tools and structured output at the protocol level: the request fields
(``structured_protocol.py``), how templates write tool calls (``formats.py``), the reply parser
(``parser.py``) and what tools change in one request (``plan.py``)."""
