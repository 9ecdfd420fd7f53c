"""Administration: models (list, load, unload, switch), the prefix cache, health, Prometheus
metrics, the playground page."""
