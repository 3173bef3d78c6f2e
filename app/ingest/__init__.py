"""The large-body ingest path: a request body read whole at the edge, within its size
limit and deadline (`edge`), parsed strictly a piece at a time (`jsontext`), and what it
was parsed into freed without stopping the event loop (`freeing`)."""
