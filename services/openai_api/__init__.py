"""`tokenwire api-server`: an OpenAI-compatible HTTP front (FastAPI on uvicorn) over the text
service's gRPC API. It holds no model: every generation is one or more text-service `Generate`
streams, so control tokens never reach content, usage is exact, and stop strings hold back only
what they must, as the text contract guarantees.

Files: `app` (routes, auth, lifecycle), `schemas` (request bodies, pydantic), `conversion`
(bodies -> GenerateRequests, results -> OpenAI JSON), `completions` (n choices collected or
streamed), `streaming` (SSE, merging choices, disconnects), `errors` (statuses and the error
body), `metrics` (Prometheus), `server` (uvicorn, TLS, shutdown).
"""
