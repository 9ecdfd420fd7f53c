"""llama.cpp server's native routes: /completion and /infill."""
