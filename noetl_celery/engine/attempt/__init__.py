"""The attempt: one task run on a worker (render, tool, sink, outcome); it decides nothing."""
