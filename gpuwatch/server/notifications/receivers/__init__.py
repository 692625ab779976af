"""One module per receiver type, behind one protocol (``base``).

::

    base          Receiver (protocol), build_receiver(config, client=...), shared helpers
    slack         SlackReceiver: Block Kit message, 1 message a second
    webhook       WebhookReceiver: versioned JSON body, HMAC-SHA256 signature (sign, render)
    alertmanager  AlertmanagerReceiver: POST /api/v2/alerts
"""

from gpuwatch.server.notifications.receivers.base import Receiver, build_receiver

__all__ = ["Receiver", "build_receiver"]
