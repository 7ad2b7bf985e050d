"""POST /v1/documents/files: multipart upload of PDF, HTML, DOCX, Markdown, text and JSONL files."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, File, Form, UploadFile, status

from app.auth.principal import Role
from app.deps import PrincipalDep, ScopesDep, UploadsDep
from app.errors import ERROR_RESPONSES
from app.uploads.protocol import UploadResponse
from configs.enums import ChunkingMode
from retrieval.store_types import COLLECTION_NAME_PATTERN

router = APIRouter(prefix="/v1/documents", tags=["documents"], responses=ERROR_RESPONSES)


@router.post("/files", status_code=status.HTTP_201_CREATED)
async def upload_files(
    files: Annotated[list[UploadFile], File(description="One or more files; the format comes from the extension.")],
    uploads: UploadsDep,
    scopes: ScopesDep,
    principal: PrincipalDep,
    collection: Annotated[str | None, Form(
        pattern=COLLECTION_NAME_PATTERN, description="The collection they go into; default: `default` (a key bound "
        "to one collection: that one).")] = None,
    chunking: Annotated[ChunkingMode | None, Form()] = None,
    precompute: Annotated[bool, Form()] = True,
    ids: Annotated[list[str] | None, Form(
        description="One document id per file, in order (default: from each file's name); "
                    "`ragblend ingest` sends the file's path under its argument."
    )] = None,
) -> UploadResponse:
    target = await scopes.one(principal, collection, Role.WRITE)
    return await uploads.upload(files, chunking, precompute, ids, target)
