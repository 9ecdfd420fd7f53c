"""Train and evaluate the bundled demo target/draft pair (`models/demo`) on the stdlib corpus.

    python -m server.model_files.training --config server/model_files/training/tiny_pair.yaml
    python -m server.model_files.training.evaluate
"""
