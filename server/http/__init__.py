"""HTTP: the app factory, routes, request mapping, streaming, errors, auth, metrics."""
