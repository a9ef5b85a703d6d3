"""Whether one plugin is registered with the kubelet, as its registration strategy reports it.

The strategies (``_kubelet_sock``, ``_plugin_watcher``) say when a registration succeeds and
when it is lost; ``Link`` keeps the flag the status reads and passes both to the observer.
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
        self.registered = False
        # A device-plugin registration lives as long as the kubelet's ListAndWatch stream; a
        # plugin served only through DRA has no such stream (its DRA driver sets this False).
        self.stream_expected = True
        self._events = events

    def up(self, seconds: float, how: str) -> None:
        """A registration succeeded after ``seconds``; ``how`` says through what, for the log."""
        self.registered = True
        self._events.registered(self.resource, seconds)
        log.info("%s: registered %s", self.resource, how, extra={"resource": self.resource})

    def lost(self, reason: str) -> None:
        """The registration was lost; the strategy serves and registers again."""
        self.registered = False
        self._events.reregistering(self.resource, reason)
        log.info(
            "%s: %s; serving and registering again",
            self.resource,
            reason,
            extra={"resource": self.resource},
        )

    def down(self) -> None:
        """Serving ended (shutdown, reload)."""
        self.registered = False
