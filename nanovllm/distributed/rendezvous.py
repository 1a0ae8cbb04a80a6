"""How the ranks find each other: a TCP store hosted by rank 0.

Rank 0 hosts the store either on a free port the OS picks (when it spawns its workers on
this machine, so two engines never collide) or at MASTER_ADDR:MASTER_PORT (when the ranks
are started independently, torchrun-style), listening on that address only: the store has no
authentication and the ranks unpickle what it hands them. Each other rank counts itself in
under `JOINED_KEY` once connected, so rank 0 can wait for them while watching for deaths.
"""

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

JOINED_KEY = "nanovllm/joined"
# How long ranks started by hand wait for each other (rank 0 for the workers, a worker for
# rank 0's store), as torchrun's rendezvous does.
RENDEZVOUS_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class LaunchEnv:
    """A rank started torchrun-style: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    local_rank: int  # which GPU of its machine this rank uses
    agent_store: bool  # torchrun's agent already hosts the store at MASTER_ADDR:MASTER_PORT


def launch_env() -> LaunchEnv | None:
    """The torchrun-style variables of this process, or None when RANK and WORLD_SIZE are unset."""
    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in env]
    if missing:
        raise ValueError(f"RANK and WORLD_SIZE are set but {' and '.join(missing)} not; "
                         "a rank started torchrun-style needs all four")
    try:
        return LaunchEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), env["MASTER_ADDR"], int(env["MASTER_PORT"]),
                         int(env.get("LOCAL_RANK", "0")), env.get("TORCHELASTIC_USE_AGENT_STORE") == "True")
    except ValueError as e:
        raise ValueError(f"RANK, WORLD_SIZE, MASTER_PORT and LOCAL_RANK must be integers: {e}") from e


def open_store(host: str, port: int, world_size: int, is_master: bool) -> dist.TCPStore:
    """Rank 0 hosts the store on `host` (port 0: any free port, read back as `store.port`); others connect."""
    listen_fd = None
    if is_master:
        # TCPStore's own server listens on every interface whatever `host` is; handed a listening
        # socket, it serves that one. It takes the descriptor over (and closes it): detach().
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        listener = socket.create_server(address, family=family)
        port, listen_fd = listener.getsockname()[1], listener.detach()
    return dist.TCPStore(host, port, world_size, is_master=is_master, timeout=RENDEZVOUS_TIMEOUT,
                         wait_for_workers=False, master_listen_fd=listen_fd)
