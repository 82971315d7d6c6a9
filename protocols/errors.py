"""Errors raised while reading or checking peer input; each carries a short machine-readable code."""


class ProtocolError(Exception):
    """A peer sent something we refuse: the message says what, the code says which kind."""

    code = "protocol"

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class FrameTooLarge(ProtocolError):
    code = "too_large"


class MalformedMessage(ProtocolError):
    code = "malformed"


class UnsupportedVersion(ProtocolError):
    code = "version"


class SchemaError(ProtocolError):
    code = "schema"


class PeerClosed(ProtocolError):
    """The stream ended (EOF or reset) before a whole frame arrived."""

    code = "closed"


class RemoteError(Exception):
    """The remote peer answered a request with an error reply."""

    def __init__(self, code: str, message: str, retry_after: float | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.retry_after = retry_after  # set when the peer asked us to slow down (code "rate_limited")
