"""The limits of ``kvledger serve`` a user can set, with their defaults (README "Limits").

Each limit, when hit, is answered with a clear status in the OpenAI error shape:

=========================  =========  ======================================================
limit                      default    when hit
=========================  =========  ======================================================
``max_body_bytes``         4 MiB      413, connection closed (the body is drained at most
                                      ``max_body_bytes`` more bytes / ``body_timeout_s``)
``body_timeout_s``         30 s       408: the body did not arrive in time (half-sent body)
``header_timeout_s``       10 s       connection closed: headers not complete in time
                                      (slowloris), counted from the connection or the
                                      previous response
``max_header_bytes``       64 KiB     431, connection closed
``max_input_chars``        1,000,000  400 ``input_too_large``: characters of the input fields
                                      (prompt, messages, input, instructions), counted
                                      before validation or tokenizing
``max_input_items``        4,096      400 ``input_too_large``: messages, content parts,
                                      prompts and input items of one request
``max_stop_strings``       16         400 naming ``stop``
``max_stop_chars``         256        400 naming ``stop`` (characters of one stop string)
``max_tools``              128        400 naming ``tools`` (tools of one request)
``max_prompt_logprob_entries``
                           1,000,000  400 naming ``prompt_logprobs``: a request's prompt
                                      tokens x (``prompt_logprobs`` + 1), the entries its
                                      answer would hold (``echo`` with ``logprobs`` N
                                      counts N)
``max_concurrent_streams`` none       429 with Retry-After (streamed requests in flight)
``request_timeout_s``      none       the request is aborted: 504 ``request_timeout`` (no
                                      Retry-After: it would time out again), or
                                      one SSE error event when the stream has started
``send_timeout_s``         30 s       a client that stops reading its stream for this long
                                      is dropped and its request aborted (slow reader)
``drain_timeout_s``        30 s       on SIGTERM, in-flight requests get this long to finish
=========================  =========  ======================================================
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from kvledger.errors import InvalidParameterError


@dataclass(frozen=True)
class ServerLimits:
    """Server limits (see the module table). ``None`` means no limit.

    Raises:
        InvalidParameterError: on construction, for a limit that is not positive.
    """

    max_body_bytes: int = 4 << 20
    body_timeout_s: float = 30.0
    header_timeout_s: float = 10.0
    max_header_bytes: int = 64 << 10
    max_input_chars: int = 1_000_000
    max_input_items: int = 4096
    max_stop_strings: int = 16
    max_stop_chars: int = 256
    max_tools: int = 128
    max_prompt_logprob_entries: int = 1_000_000
    max_concurrent_streams: int | None = None
    request_timeout_s: float | None = None
    send_timeout_s: float = 30.0
    drain_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and not value > 0:  # also refuses NaN
                option = "--" + f.name.replace("_", "-")
                raise InvalidParameterError(f"{option} must be > 0, got {value}")
