"""The Files API's store: uploaded files (a batch's input) and the files batches write (their
output), by id, in memory until deleted (and a restart, without `server.state_dir`; with it,
written through and read back at start), within a byte budget (`server.files_max_gb`): an
upload beyond it is a 413, never an eviction of a client's file."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

from api_schemas.batches import FileObject
from server.http.common.errors import APIError
from server.http.jobs.state_db import StateDB

log = logging.getLogger(__name__)
KIND = "files"


@dataclass
class StoredFile:
    info: FileObject
    data: bytes
    uploaded: bool  # counts against the budget (a batch's output does not)


class FileStore:
    def __init__(self, max_bytes: int, db: StateDB | None = None):
        self.max_bytes = max_bytes
        self._db = db
        self._files: dict[str, StoredFile] = {}
        if db is not None:
            self._restore(db)

    def _restore(self, db: StateDB) -> None:
        for file_id, value in db.load(KIND):
            data = db.read_blob(file_id)
            if data is None:
                log.warning("server.state_dir: the bytes of file %s are missing; dropped",
                            file_id)
                db.delete(KIND, file_id)
                continue
            self._files[file_id] = StoredFile(FileObject.model_validate(value["info"]), data,
                                              value["uploaded"])

    @property
    def nbytes(self) -> int:
        """The uploads' bytes, what the budget bounds."""
        return sum(len(f.data) for f in self._files.values() if f.uploaded)

    def add(self, filename: str, purpose: str, data: bytes, *, uploaded: bool = True
            ) -> FileObject:
        """Store `data`; an upload that does not fit what is left is a 413. A batch's own
        output is stored beside the budget: its requests already ran."""
        if uploaded:
            self.check_room(len(data))
        info = FileObject(id=f"file-{uuid.uuid4().hex}", bytes=len(data),
                          created_at=int(time.time()), filename=filename, purpose=purpose)
        self._files[info.id] = StoredFile(info, data, uploaded)
        if self._db is not None:
            self._db.write_blob(info.id, data)
            self._db.put(KIND, info.id, {"info": info.model_dump(mode="json"),
                                         "uploaded": uploaded})
        return info

    def check_room(self, size: int) -> None:
        """A 413 when `size` more bytes do not fit in the budget."""
        if self.nbytes + size > self.max_bytes:
            raise APIError(413, f"the file ({size:,} bytes) does not fit in the"
                           f" {self.max_bytes:,} bytes the server keeps for files"
                           f" ({self.nbytes:,} in use; server.files_max_gb): delete files"
                           " first", param="file", code="file_store_full")

    def find(self, file_id: str) -> StoredFile | None:
        return self._files.get(file_id)

    def get(self, file_id: str, *, param: str | None = None) -> StoredFile:
        """404 in OpenAI's shape for an id never stored or deleted."""
        stored = self._files.get(file_id)
        if stored is None:
            kept = ("until deleted" if self._db is not None
                    else "in memory until deleted or a restart")
            raise APIError(404, f"No file with id {file_id!r} (files are kept {kept})",
                           param=param, code="file_not_found", redact=False)
        return stored

    def delete(self, file_id: str) -> None:
        self.get(file_id)
        del self._files[file_id]
        if self._db is not None:
            self._db.delete(KIND, file_id)
            self._db.delete_blob(file_id)

    def listed(self, purpose: str | None, order: str) -> list[FileObject]:
        """Every file of `purpose` (None: all), by creation, oldest first for `asc`."""
        files = [f.info for f in self._files.values()
                 if purpose is None or f.info.purpose == purpose]
        return files if order == "asc" else files[::-1]
