"""The optional imports of the HTTP test modules: the OpenAI client and the server's stack
(fastapi, uvicorn, pydantic, msgpack). Where one is missing (the GPU machine's image lacks most
of them) importing this skips the importing module instead of failing collection."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
for _name in ("fastapi", "uvicorn", "pydantic", "msgpack"):
    pytest.importorskip(_name)
