"""What every kind of job shares: its lifecycle (`lifecycle`), the queue store that claims
and writes jobs (`store`), their events (`events`), stored specs (`payloads`), the reads
every job route makes (`service`), and the worker that runs them (`worker`, `supervise`).

Each kind of job lives in a folder of its own (`app.training`, `app.rollouts`,
`app.evaluations`) with its service (accept, show) and its runner (run, settle).
"""
