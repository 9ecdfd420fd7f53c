"""The shipped draft's recipe (`models/smollm2-draft`): the target's answers, distillation,
evaluation and model card, run by `python -m server.model_files.training draft`."""
