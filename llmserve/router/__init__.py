"""The router: one endpoint in front of several llmserve servers.

Data-parallel serving: `policy` picks a replica per request (prefix-cache affinity, bounded
by load) and `launcher` starts replicas for `serve --data-parallel-size`. Disaggregated
prefill/decode: `disaggregated` splits a request into a prefill hop and a decode hop. Both
modes share `base` (backends, health, sending), `proxy` (forwarding one request),
`replicas` (which backends are up), `metrics` (joining their /metrics) and `app` (the
router's HTTP server).
"""
