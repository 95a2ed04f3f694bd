"""A thin wrapper over one NIXL agent (UCX backend, progress thread off).

NIXL is built with thread sync NONE: after construction every call must come from one thread,
the owner's poller thread. The wrapper registers the whole pool once and turns NIXL's
exceptions into kv_transfer errors.
"""

from __future__ import annotations

import logging
import os

from kv_transfer.blocks import descriptor_rows, merge_runs
from kv_transfer.config import PoolSpec
from kv_transfer.errors import KVTransferError, PeerGoneError

try:  # the meta package "nixl" and the bare wheel name the module differently
    from nixl._api import nixl_agent, nixl_agent_config
    from nixl._bindings import nixlRemoteDisconnectError
except ImportError:
    from nixl_cu12._api import nixl_agent, nixl_agent_config
    from nixl_cu12._bindings import nixlRemoteDisconnectError

logger = logging.getLogger(__name__)


def apply_ucx_env(env: dict[str, str]) -> None:
    """UCX reads its environment once per process, when the first agent starts."""
    for key, value in env.items():
        os.environ[key] = value
    # NIXL's INFO start-up lines are noise in every engine's log.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


def wrap_nixl_error(exc: Exception, what: str) -> KVTransferError:
    if isinstance(exc, nixlRemoteDisconnectError):
        return PeerGoneError(f"{what}: peer disconnected ({exc})")
    return KVTransferError(f"{what}: {type(exc).__name__}: {exc}")


class NixlAgent:
    """One NIXL agent with one registered block-major pool."""

    def __init__(self, name: str, pool: PoolSpec, ucx_env: dict[str, str]) -> None:
        apply_ucx_env(ucx_env)
        self.name = name
        self.pool = pool
        cfg = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                                backends=["UCX"])
        self._agent = nixl_agent(name, cfg)
        self._reg = self._agent.register_memory([(pool.address, pool.nbytes, pool.device_id, "")],
                                            pool.mem_type)
        self.metadata: bytes = self._agent.get_agent_metadata()
        logger.debug("NIXL agent %s registered %d blocks of %d bytes (%s %d)", name,
                     pool.num_blocks, pool.block_bytes, pool.mem_type, pool.device_id)

    def add_peer(self, metadata: bytes) -> str:
        try:
            name = self._agent.add_remote_agent(metadata)
        except Exception as exc:  # noqa: BLE001 - any NIXL failure means a bad peer
            raise wrap_nixl_error(exc, "add_remote_agent") from exc
        return name.decode() if isinstance(name, bytes) else name

    def remove_peer(self, name: str) -> None:
        try:
            self._agent.remove_remote_agent(name)
        except Exception as exc:  # noqa: BLE001 - best effort on a peer we drop anyway
            logger.debug("remove_remote_agent(%s) failed: %s", name, exc)

    def post(self, op: str, peer: str, remote: PoolSpec, local_ids: list[int],
             remote_ids: list[int], notif: bytes) -> tuple[object, int, str]:
        """Start one transfer of whole blocks; returns (handle, num_descs, first state).
        transfer() may copy everything before it returns (same-host CMA)."""
        runs = merge_runs(local_ids, remote_ids)
        loc_rows, rem_rows = descriptor_rows(runs, self.pool, remote)
        handle = None
        try:
            loc = self._agent.get_xfer_descs(loc_rows, self.pool.mem_type)
            rem = self._agent.get_xfer_descs(rem_rows, remote.mem_type)
            handle = self._agent.initialize_xfer(op, loc, rem, peer, notif)
            state = self._agent.transfer(handle)
        except Exception as exc:  # noqa: BLE001
            if handle is not None:
                self.release(handle)
            raise wrap_nixl_error(exc, f"{op} from {peer}") from exc
        if state == "ERR":
            self.release(handle)
            raise KVTransferError(f"{op} from {peer}: NIXL state ERR")
        return handle, len(runs), state

    def check(self, handle: object) -> str:
        try:
            state = self._agent.check_xfer_state(handle)
        except Exception as exc:  # noqa: BLE001
            raise wrap_nixl_error(exc, "check_xfer_state") from exc
        if state == "ERR":
            raise KVTransferError("NIXL transfer state ERR")
        return state

    def release(self, handle: object) -> bool:
        """Release (and, if still posted, cancel) a transfer; False if NIXL refused."""
        try:
            self._agent.release_xfer_handle(handle)
            return True
        except Exception as exc:  # noqa: BLE001
            logger.debug("release_xfer_handle failed: %s", exc)
            return False

    def notifs(self) -> dict[str, list[bytes]]:
        """New notifications by peer name; also drives UCX progress (no progress thread)."""
        return self._agent.get_new_notifs()

    def send_notif(self, peer: str, msg: bytes) -> None:
        try:
            self._agent.send_notif(peer, msg)
        except Exception as exc:  # noqa: BLE001
            raise wrap_nixl_error(exc, f"send_notif to {peer}") from exc

    def close(self) -> None:
        try:
            self._agent.deregister_memory(self._reg)
        except Exception as exc:  # noqa: BLE001
            logger.debug("deregister_memory failed: %s", exc)
        del self._agent
