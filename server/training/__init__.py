"""Train and evaluate the bundled demo target/draft pair (`models/demo`) on the stdlib corpus.

    python -m server.training --config server/training/demo.yaml
    python -m server.training.evaluate
"""
