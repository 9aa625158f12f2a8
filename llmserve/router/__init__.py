"""Data-parallel serving: a router in front of several llmserve replicas.

`policy` picks a replica per request (prefix-cache affinity, bounded by load), `proxy`
forwards to it, `replicas` tracks which are up, `metrics` joins their /metrics, `app` is
the router's HTTP server and `launcher` starts replicas for `serve --data-parallel-size`.
"""
