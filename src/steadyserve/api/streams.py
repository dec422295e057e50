"""The server's open request channels: what a drain cuts, what the backlog gauge sums, where cuts are counted.

Every stream ends honestly: a finish reason, or an explicit error saying why (client_disconnect, stall,
deadline, drain_timeout, engine_error; engine/channel.py decides which). The channels a transport holds
are kept here, so that a drain can end them all, and each channel reports to this registry as its owner:
the streams it ended early (counted by reason) and its close (the request's trace notes its end).
"""

from __future__ import annotations

from ..engine.channel import END_MESSAGES, RequestChannel
from .tracing import note_end

__all__ = ["END_MESSAGES", "OpenChannels"]


class OpenChannels:
    def __init__(self, metrics=None) -> None:
        self.metrics = metrics
        self.open: dict[int, RequestChannel] = {}

    def add(self, channel: RequestChannel) -> RequestChannel:
        """Hold `channel` until its transport closes it; it reports here."""
        channel.owner = self
        self.open[id(channel)] = channel
        return channel

    def counted(self, reason: str, n: int) -> None:
        if self.metrics is not None:
            self.metrics.aborted.labels(reason).inc(n)

    def closed(self, channel: RequestChannel) -> None:
        note_end(channel.error)  # the request's trace, when tracing is on, ends in this error
        self.open.pop(id(channel), None)

    def cut_all(self, reason: str) -> int:
        """Cut every open channel for `reason`; the number of streams (choices) they held."""
        channels = list(self.open.values())
        for c in channels:
            c.cut(reason)
        return sum(len(c.request_ids) for c in channels)

    def backlog_bytes(self) -> int:
        return sum(c.backlog_bytes for c in list(self.open.values()))
