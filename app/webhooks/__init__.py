"""Webhooks: endpoints registered through the API, an outbox written with every state
change they report, and the workers' sender (`outbox`, `sender`, `service`)."""
