"""What the sweep measures: the prompt kinds and the cells (kind x draft length)."""

from __future__ import annotations

from dataclasses import dataclass

STRUCTURED = (
    "Write a Python module with a function `binary_search(items, target)` that returns the "
    "index of `target` in the sorted list `items` or -1, and three small utility functions: "
    "`clamp(value, low, high)`, `chunked(items, size)` and `is_palindrome(text)`. Give each "
    "function a docstring and type hints."
)

OPEN_ENDED = (
    "Write a short reflection on what makes a day feel well spent. Speak from experience, in "
    "a few paragraphs of plain prose."
)

_REPEAT_EDIT_CODE = '''\
import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Task:
    name: str
    done: bool = False
    tags: list[str] = field(default_factory=list)


class TaskList:
    def __init__(self, path: Path):
        self.path = path
        self.tasks: list[Task] = []

    def load(self) -> None:
        if not self.path.exists():
            return
        data = json.loads(self.path.read_text())
        self.tasks = [Task(**item) for item in data]

    def save(self) -> None:
        data = [vars(task) for task in self.tasks]
        self.path.write_text(json.dumps(data, indent=2))

    def add(self, name: str, *tags: str) -> Task:
        task = Task(name, tags=list(tags))
        self.tasks.append(task)
        return task

    def complete(self, name: str) -> bool:
        for task in self.tasks:
            if task.name == name:
                task.done = True
                return True
        return False

    def pending(self) -> list[Task]:
        return [task for task in self.tasks if not task.done]

    def tagged(self, tag: str) -> list[Task]:
        return [task for task in self.tasks if tag in task.tags]
'''

REPEAT_EDIT = (
    "Repeat this code exactly, with one change: rename the method `pending` to "
    f"`open_tasks`.\n\n```python\n{_REPEAT_EDIT_CODE}```"
)

PROMPT_KINDS: dict[str, str] = {
    "structured": STRUCTURED,
    "open_ended": OPEN_ENDED,
    "repeat_edit": REPEAT_EDIT,
}
DEFAULT_PROMPT_KINDS = ("structured", "open_ended")
DEFAULT_DRAFT_TOKENS = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class Cell:
    """One point of the sweep: a prompt kind and a draft length (0 = the baseline)."""

    kind: str
    k: int

    @property
    def baseline(self) -> bool:
        return self.k == 0

    @property
    def prompt(self) -> str:
        return PROMPT_KINDS[self.kind]

    def label(self) -> str:
        return f"{self.kind} {'baseline' if self.baseline else f'k={self.k}'}"


def plan_cells(kinds: list[str], draft_tokens: list[int]) -> list[Cell]:
    """Per kind: the baseline first (speedups need it), then each k in the order given."""
    return [Cell(kind, k) for kind in kinds for k in (0, *draft_tokens)]
