"""Small building blocks with no knowledge of the protocol, shared by the layers above.

Nothing here imports another part of acp-once: SQLite connection set-up and migrations, the
context manager that opens a resource on a worker thread, retry back-off, and the assertion
helpers of the contract suites.
"""
