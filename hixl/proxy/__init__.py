"""``hixl proxy``: an OpenAI-compatible front door for prefill/decode-disaggregated vLLM.

Each completion or chat-completion request goes first to a prefill instance
with ``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": true}``;
the ``kv_transfer_params`` that comes back is sent with the original request
to a decode instance, whose answer (streamed or not) is the client's answer
(``--kv-mode push``: to both at once, see ``push``).
Several of each are load-balanced (fewest outstanding requests), health-checked
and retried around (see ``app``); ``GET /metrics`` reports it in Prometheus's
text format. Clients are not trusted: each is held to deadlines for sending
and for reading (``server``), and its body checked before any upstream is
asked (``body``).
Needs ``aiohttp`` (installed with vLLM, or ``pip install 'hixl[vllm]'``).
"""

from .cli import add_parser

__all__ = ["add_parser"]
