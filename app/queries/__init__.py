"""Queries of the control plane: plain functions taking `(session, ...)` keyword arguments.

They read and write through the session, flush when they need generated ids, and raise
`app.errors` exceptions; they never commit: the caller (a request handler, a CLI command or a
task) commits once, at its boundary.
"""
