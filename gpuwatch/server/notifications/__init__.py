"""Delivering alert notifications: what a notification is (``model``), the receivers'
configuration (``config``), one module per receiver type (``receivers/``), and the
delivery worker that sends pending notifications with retries (``delivery``)."""
