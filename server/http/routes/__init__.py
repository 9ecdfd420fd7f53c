"""HTTP routes: translate requests to engine calls and engine results to responses."""
