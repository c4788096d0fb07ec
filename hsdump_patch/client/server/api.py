"""The server client: SGLang's HTTP API as hsdump uses it, with retries and its own errors.

Connection errors are retried with exponential backoff (``--retries``, ``--retry-wait``); a
server that stays unreachable raises :class:`ServerDown`, which ends a run (every following
request would fail too). Anything the server answers is returned or raised as is.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import requests

from hsdump_patch.client.rows.conversation import ConversationError, RenderCheckDown

MAX_BACKOFF = 30.0  # seconds: the longest pause between two retries


class ServerDown(RenderCheckDown):
    """The server stayed unreachable through every retry: the run cannot go on."""


class DuplicateRid(RuntimeError):
    """The server still runs a request with this rid (from a killed earlier run)."""


class Refused(RuntimeError):
    """The server answered ``/generate`` with an error status; the message says which."""


class ServerClient:
    """``/generate`` and ``/model_info`` with retries and backoff on connection errors."""

    def __init__(self, url: str, *, request_timeout: float, retries: int,
                 retry_wait: float) -> None:
        self.url = url.rstrip("/")
        self.request_timeout = request_timeout
        self.retries = retries
        self.retry_wait = retry_wait
        self._local = threading.local()

    def _session(self) -> requests.Session:
        if not hasattr(self._local, "session"):
            self._local.session = requests.Session()
        return self._local.session

    def _request(self, method: str, path: str, *,
                 before_attempt: Callable[[], None] | None = None,
                 **kw: Any) -> requests.Response:
        """Send, re-sending after connection errors; ``before_attempt`` runs before each try."""
        t0 = time.monotonic()
        for attempt in range(self.retries + 1):
            if before_attempt is not None:
                before_attempt()
            try:
                return self._session().request(method, self.url + path, **kw)
            except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError) as e:
                last = e
            if attempt < self.retries:
                time.sleep(min(self.retry_wait * 2**attempt, MAX_BACKOFF))
        raise ServerDown(
            f"the server at {self.url} is unreachable: {self.retries + 1} attempts over "
            f"{time.monotonic() - t0:.1f}s failed (last: {type(last).__name__}: {last}); check "
            "that it is running and that --server is right (raise --retries to wait longer)")

    def model_info(self) -> dict[str, Any]:
        """The server's ``/model_info`` (model and tokenizer paths)."""
        r = self._request("GET", "/model_info", timeout=30)
        r.raise_for_status()
        return r.json()

    def server_args(self) -> dict[str, Any]:
        """The server's resolved launch arguments (``/server_info``, older ``/get_server_info``);
        empty when neither answers."""
        for path in ("/server_info", "/get_server_info"):
            r = self._request("GET", path, timeout=30)
            if r.status_code == 200:
                return r.json()
        return {}

    def tokenize_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                      template_kwargs: dict[str, Any] | None) -> list[int]:
        """The prompt ids the server serves for a chat request of ``messages`` (SGLang's
        ``/v1/tokenize``: its chat rendering with the generation prompt, no forward)."""
        body: dict[str, Any] = {"messages": messages}
        if tools:
            body["tools"] = tools
        if template_kwargs:
            body["chat_template_kwargs"] = template_kwargs
        return self.post_json("/v1/tokenize", body, ConversationError, lambda r: (
            "the server could not render this row's chat request (/v1/tokenize answered HTTP "
            f"{r.status_code}: {r.text[:300]})"))["tokens"]

    def post_json(self, path: str, body: dict[str, Any], error: type[Exception],
                  refused: Callable[[requests.Response], str | None] | None = None) -> Any:
        """POST ``body`` (re-sent after connection errors) and return the JSON answer. No
        answer within --request-timeout, or an answer other than 200, raises ``error``: for
        the latter with ``refused(response)`` as the message when it gives one, else the
        status and text."""
        try:
            r = self._request("POST", path, json=body, timeout=self.request_timeout)
        except requests.Timeout:
            raise error(f"no answer from the server's {path} within --request-timeout "
                        f"{self.request_timeout:g}s") from None
        if r.status_code != 200:
            raise error((refused and refused(r))
                        or f"{path} answered HTTP {r.status_code}: {r.text[:500]}")
        return r.json()

    def generate(self, rid: str, input_ids: list[int], *,
                 before_attempt: Callable[[], None] | None = None) -> dict[str, Any]:
        """Run a prefill-only request; return its ``meta_info``. ``before_attempt`` runs before
        the first send and before every re-send after a connection error."""
        body = {"rid": rid, "input_ids": input_ids,
                "sampling_params": {"max_new_tokens": 0, "temperature": 0}}
        r = self._request("POST", "/generate", json=body, timeout=self.request_timeout,
                          before_attempt=before_attempt)
        if r.status_code != 200:
            text = r.text[:500]
            if "Duplicate request ID" in text:
                raise DuplicateRid(text)
            raise Refused(f"the server answered HTTP {r.status_code}: {text}")
        return r.json().get("meta_info", {})

    def abort(self, rid: str) -> bool:
        """Ask the server to abort ``rid`` (SGLang's ``/abort_request``; it aborts every rid
        that starts with this one); False when the server did not take it."""
        try:
            r = self._session().post(self.url + "/abort_request", json={"rid": rid}, timeout=30)
        except requests.RequestException:
            return False  # unreachable: a server that is down runs nothing
        return r.status_code == 200


def check_meta(meta: dict[str, Any], sent: int) -> str | None:
    """Return why a ``/generate`` answer shows the dump cannot be complete, or None."""
    finish = meta.get("finish_reason")
    if isinstance(finish, dict) and finish.get("type") == "abort":
        return f"the server aborted the request: {finish.get('message')}"
    if meta.get("prompt_tokens") != sent:
        return (f"the server counted prompt_tokens={meta.get('prompt_tokens')} but {sent} token "
                "ids were sent (was the prompt truncated? check the server's --context-length)")
    cached = meta.get("cached_tokens")
    if cached != 0:
        return (f"the server reused cached_tokens={cached} prompt tokens from its radix cache; "
                "those tokens were not recomputed, so they have no hidden states. Start the "
                "server with --disable-radix-cache (the capture patch refuses to run without it, "
                "so this server is probably not the one writing to --dump-dir)")
    return None
