"""llama.cpp's `/infill` prompt: the repository-level fill-in-the-middle layout of Qwen2.5-Coder
(arXiv 2409.12186), as llama.cpp's server builds it (`format_infill`):

    [FIM_REP]myproject\n [FIM_SEP]filename0\n chunk 0 ... [FIM_SEP]filename\n
    [FIM_PRE]prefix prompt [FIM_SUF]suffix [FIM_MID]

The repository markers only where the vocabulary has them; without them each extra chunk
follows a "--- snippet ---" line. Like llama.cpp, it keeps the last 1,536 tokens of the prefix
and the first 512 (less the prompt's) of the suffix, and as much of the end of the extra
context as the window leaves (`N_BATCH`: llama.cpp's default batch).
"""

from __future__ import annotations

from api_schemas.llama_cpp import InfillRequest
from server.engine import FimFormat

N_BATCH = 2048
REPO_MARKERS = ("<|repo_name|>", "<repo_name>", "<reponame>")
FILE_MARKERS = ("<|file_sep|>", "<file_sep>")
SNIPPET = "\n\n--- snippet ---\n\n"


def infill_tokens(body: InfillRequest, fim: FimFormat, tokenizer, context: int) -> list[int]:
    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False)) if text else []

    vocab = tokenizer.get_vocab()
    repo = next((vocab[m] for m in REPO_MARKERS if m in vocab), None)
    file_sep = next((vocab[m] for m in FILE_MARKERS if m in vocab), None)
    extra = [repo, *encode("myproject\n")] if repo is not None else []
    for chunk in body.input_extra:
        extra += ([file_sep, *encode(chunk.filename + "\n")] if file_sep is not None
                  else encode(SNIPPET))
        extra += encode(chunk.text)
    if file_sep is not None:
        extra += [file_sep, *encode("filename\n")]

    prompt = encode(body.prompt)
    prefix, suffix = encode(body.input_prefix), encode(body.input_suffix)
    prefix = prefix[len(prefix) - min(len(prefix), 3 * (N_BATCH // 4)):]
    suffix = suffix[:min(len(suffix), max(0, N_BATCH // 4 - (2 + len(prompt))))]
    take_extra = min(max(0, context - N_BATCH - 2 * body.n_predict), len(extra))
    body_tokens = fim.prompt([*prefix, *prompt], suffix)  # BOS first, if the model has one
    return [*extra[len(extra) - take_extra:], *body_tokens]
