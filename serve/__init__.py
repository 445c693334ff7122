"""specbatch serve: the continuous-batching engine (runtime.engine) behind an OpenAI-compatible HTTP server,
and the open-loop load test."""
