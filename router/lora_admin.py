"""vLLM's run-time LoRA endpoints: POST /v1/load_lora_adapter and /v1/unload_lora_adapter,
fanned out to every live engine (each loads the folder itself: the path must be readable on
every engine's host).

A load either lands on every live engine or on none: an engine that refuses (the adapter does
not fit the model, the folder is missing there) or does not answer makes the router unload it
from the engines that took it, and the client gets the first reason. Engines publish their
adapters in their registry records (`EngineRecord.lora_adapters`) before they answer, so once
the answer is sent, /v1/models lists the adapter and requests may name it.
"""

from __future__ import annotations

import asyncio
import logging

from router.engine_pool import EnginePool
from router.openai_protocol import APIError, LoadLoraAdapterRequest, UnloadLoraAdapterRequest

logger = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 60.0  # an engine reads and checks the adapter's weights before it answers
UNLOAD_TIMEOUT_S = 10.0


def _no_engine(pool: EnginePool) -> None:
    if not pool.live_engines():
        raise APIError(503, "No live engine to load or unload a LoRA adapter on",
                       "service_unavailable", code="no_engine")


async def load_adapter(pool: EnginePool, base_name: str, body: LoadLoraAdapterRequest) -> dict:
    """Load on every live engine; APIError 400 (refused, naming why), 503 (no engine, or one
    did not answer)."""
    name = body.lora_name
    if name == base_name:
        raise APIError(400, f"'{name}' is the base model's name; choose another lora_name",
                       param="lora_name", code="lora_name_taken")
    if name in pool.lora_adapters():
        raise APIError(400, f"The LoRA adapter '{name}' is already loaded; unload it first",
                       param="lora_name", code="lora_adapter_exists")
    _no_engine(pool)
    engines = pool.live_engines()
    replies = await asyncio.gather(*(client.load_lora_adapter(name, body.lora_path,
                                                              LOAD_TIMEOUT_S)
                                     for _, client in engines), return_exceptions=True)
    loaded = [(r, c) for (r, c), reply in zip(engines, replies, strict=True)
              if not isinstance(reply, BaseException) and reply.ok]
    if len(loaded) < len(engines):
        failed = [(record, reply) for (record, _), reply in zip(engines, replies, strict=True)
                  if isinstance(reply, BaseException) or not reply.ok]
        await asyncio.gather(*(client.unload_lora_adapter(name, UNLOAD_TIMEOUT_S)
                               for _, client in loaded), return_exceptions=True)
        record, reply = failed[0]
        if isinstance(reply, BaseException):
            raise APIError(503, f"Engine {record.engine_id} did not answer the load of LoRA "
                           f"adapter '{name}' within {LOAD_TIMEOUT_S:g} s; not loaded anywhere",
                           "service_unavailable", code="no_answer")
        raise APIError(400, f"Engine {record.engine_id} refused: {reply.message}",
                       param="lora_path", code="lora_adapter_refused")
    await pool.refresh_lora_adapters()  # the engines published their records before answering
    logger.info("LoRA adapter %s loaded from %s on %d engines", name, body.lora_path,
                len(engines))
    return {"status": "ok", "lora_name": name,
            "engines": {record.engine_id: True for record, _ in engines}}


async def unload_adapter(pool: EnginePool, body: UnloadLoraAdapterRequest) -> dict:
    """Unload from every live engine serving it; APIError 404 (no engine serves it), 400 (an
    engine refused: requests still run with it), 503 (one did not answer)."""
    name = body.lora_name
    engines = [(r, c) for r, c in pool.live_engines() if pool.serves_lora(r, name)]
    if not engines:
        _no_engine(pool)
        raise APIError(404, f"The LoRA adapter '{name}' is not loaded (loaded: "
                       f"{sorted(pool.lora_adapters()) or 'none'})", "not_found_error",
                       param="lora_name", code="lora_adapter_not_found")
    replies = await asyncio.gather(*(client.unload_lora_adapter(name, UNLOAD_TIMEOUT_S)
                                     for _, client in engines), return_exceptions=True)
    await pool.refresh_lora_adapters()
    for (record, _), reply in zip(engines, replies, strict=True):
        if isinstance(reply, BaseException):
            raise APIError(503, f"Engine {record.engine_id} did not answer the unload of LoRA "
                           f"adapter '{name}'", "service_unavailable", code="no_answer")
        if not reply.ok:
            raise APIError(400, f"Engine {record.engine_id} refused: {reply.message}",
                           param="lora_name", code="lora_adapter_refused")
    logger.info("LoRA adapter %s unloaded from %d engines", name, len(engines))
    return {"status": "ok", "lora_name": name,
            "engines": {record.engine_id: True for record, _ in engines}}
