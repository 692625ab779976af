"""Tables of the alert engine. Times are Unix epoch seconds.

* ``alerts``: one row per alert instance, from the moment its condition first holds
  (``pending``) through ``firing`` to ``resolved``; resolved rows are kept for
  ``resolved_retention`` (history, and the resolved notification).
* ``alert_groups``: per receiver and group, what was last notified and when: the
  notification log Alertmanager keeps in ``nflog``, here in the database so a restart
  or another replica neither forgets nor repeats it.
* ``notifications``: each notification as sent (its body), with its delivery state;
  unique per receiver, group and flush time, so two replicas cannot both send it.
* ``silences``: label matchers that mute alerts between two times.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, Double, Index, Integer, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from gpuwatch.server.database.core import Base, IdType


class AlertRow(Base):
    __tablename__ = "alerts"
    __table_args__ = (Index(None, "state", "fingerprint"),)

    id: Mapped[int] = mapped_column(IdType, primary_key=True)
    fingerprint: Mapped[str] = mapped_column(String(64))
    rule: Mapped[str] = mapped_column(String(64))
    labels: Mapped[dict[str, str]] = mapped_column(JSON)
    severity: Mapped[str] = mapped_column(String(16))
    state: Mapped[str] = mapped_column(String(16))  # pending, firing, resolved
    summary: Mapped[str] = mapped_column(String(1024))
    description: Mapped[str] = mapped_column(String(2048))
    culprits: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    active_since: Mapped[float] = mapped_column(Double)
    fired_at: Mapped[float | None] = mapped_column(Double)
    last_true_at: Mapped[float] = mapped_column(Double)
    resolved_at: Mapped[float | None] = mapped_column(Double)


class AlertGroupRow(Base):
    __tablename__ = "alert_groups"
    __table_args__ = (UniqueConstraint("receiver", "group_key"),)

    id: Mapped[int] = mapped_column(IdType, primary_key=True)
    receiver: Mapped[str] = mapped_column(String(64))
    group_key: Mapped[str] = mapped_column(String(512))
    group_labels: Mapped[dict[str, str]] = mapped_column(JSON)
    # When the group got its first alert since it was last empty: group_wait counts
    # from here.
    first_alert_at: Mapped[float | None] = mapped_column(Double)
    flushed_at: Mapped[float | None] = mapped_column(Double)
    notified_at: Mapped[float | None] = mapped_column(Double)
    # Fingerprints of the firing alerts the last notification carried (planned: it
    # may not have been delivered yet).
    notified_firing: Mapped[list[str]] = mapped_column(JSON)
    # Fingerprints the receiver was actually told fire: a delivered notification said
    # so and no delivered one has resolved them since. A notification given up at its
    # deadline falls back to this, so a resolution owed is planned again (Alertmanager's
    # nflog records a group only once a send succeeded).
    delivered_firing: Mapped[list[str]] = mapped_column(JSON, default=list, server_default="[]")


class NotificationRow(Base):
    __tablename__ = "notifications"
    __table_args__ = (
        UniqueConstraint("receiver", "group_key", "flush_at"),
        Index(None, "status", "next_attempt_at"),
        Index(None, "receiver", "id"),
    )

    id: Mapped[int] = mapped_column(IdType, primary_key=True)
    receiver: Mapped[str] = mapped_column(String(64))
    group_key: Mapped[str] = mapped_column(String(512))
    flush_at: Mapped[float] = mapped_column(Double)
    # pending, sent, failed, broken, superseded (a newer one of its group replaced it)
    status: Mapped[str] = mapped_column(String(16))
    body: Mapped[dict[str, Any]] = mapped_column(JSON)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    # Pending: when it may be attempted next. Failed or broken: when it was given up.
    next_attempt_at: Mapped[float] = mapped_column(Double)
    deadline_at: Mapped[float] = mapped_column(Double)
    sent_at: Mapped[float | None] = mapped_column(Double)
    last_error: Mapped[str | None] = mapped_column(String(512))
    # Its most severe alert: 0 critical, 1 warning, 2 info. A backlog is claimed by
    # this, then age, so a new critical page is not queued behind warnings.
    urgency: Mapped[int] = mapped_column(Integer, default=2, server_default="2")


class SilenceRow(Base):
    __tablename__ = "silences"

    id: Mapped[int] = mapped_column(IdType, primary_key=True)
    # [{"name": label, "value": v, "regex": bool}], all must match.
    matchers: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    starts_at: Mapped[float] = mapped_column(Double)
    ends_at: Mapped[float] = mapped_column(Double)
    created_by: Mapped[str] = mapped_column(String(256))
    comment: Mapped[str] = mapped_column(String(1024))
    created_at: Mapped[float] = mapped_column(Double)
