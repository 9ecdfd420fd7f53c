"""Work that outlives one request: batch lines run through the app itself, and the state kept
across restarts (SQLite)."""
