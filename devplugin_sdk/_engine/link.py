"""Whether one plugin is registered with the kubelet, as its registration strategy reports it.

The strategies (``kubelet_sock``, ``plugin_watcher``, DRA's) say when a registration succeeds
and when it is lost, through ``Link``'s methods alone; ``Link`` keeps the flags the status reads
and passes registrations and losses to the observer.
"""

from __future__ import annotations

import logging

from devplugin_sdk._engine.events import Events

log = logging.getLogger("devplugin_sdk")

__all__ = ["Link"]


class Link:
    """One plugin's registration state.

    Args:
        resource: The resource name.
        events: Where registrations and losses are reported.
    """

    def __init__(self, resource: str, events: Events) -> None:
        self.resource = resource
        self._registered = False
        # A device-plugin registration lives as long as the kubelet's ListAndWatch stream; a
        # plugin served only through DRA has no such stream (``without_stream``).
        self._stream_expected = True
        self._events = events

    @property
    def registered(self) -> bool:
        """Whether the plugin is registered now."""
        return self._registered

    @property
    def stream_expected(self) -> bool:
        """Whether the registration comes with the kubelet's ListAndWatch stream."""
        return self._stream_expected

    def without_stream(self) -> None:
        """This plugin's registration has no ListAndWatch stream (served only through DRA)."""
        self._stream_expected = False

    def up(self, seconds: float, how: str) -> None:
        """A registration succeeded after ``seconds``; ``how`` says through what, for the log."""
        self._registered = True
        self._events.registered(self.resource, seconds)
        log.info("%s: registered %s", self.resource, how, extra={"resource": self.resource})

    def lost(self, reason: str) -> None:
        """The registration was lost; the strategy serves and registers again."""
        self._registered = False
        self._events.reregistering(self.resource, reason)
        log.info(
            "%s: %s; serving and registering again",
            self.resource,
            reason,
            extra={"resource": self.resource},
        )

    def down(self) -> None:
        """Not registered, and no loss to report: serving ended (shutdown, reload), or the
        kubelet refused the registration (the loss is reported when serving starts again)."""
        self._registered = False
