"""TorchX components for torchft_lite jobs (shaped like torchft's ``torchft/torchx.py``).

:func:`hsdp` makes one role per replica group, each a ``torchrun`` of ``workers_per_replica``
ranks (through :mod:`torchft_lite.launch`, so the role's exit code is the failed worker's)
whose agent restarts the group's workers, and a lighthouse role (:func:`lighthouse_role`)
unless it is given one's address::

    TORCHFT_LITE_TOKEN_FILE=~/job-token torchx run -s local_cwd torchft_lite/torchx.py:hsdp \\
        --replicas 2 --workers_per_replica 2 -- --steps 1000

The job token reaches every role as the path of its file, never the token
(:func:`_token_env`; docs/cluster.md). Importing this module needs ``torchx`` but never torch.
"""

import os
from typing import Dict, Optional

import torchx.specs as specs

from torchft_lite.rpc.access import TOKEN_ENV, TOKEN_FILE_ENV

__all__ = ["hsdp", "lighthouse_role"]

LIGHTHOUSE_ROLE = "lighthouse"


def _token_env(env: Dict[str, str], token_file: Optional[str]) -> Dict[str, str]:
    """The job token's setting for every role: the path of its file, never the token.

    The token is a secret: it never goes on a command line or into the job's spec (which ``ps``, the
    scheduler's UI and its logs show). Every role reads the file at start; on a cluster that path is a mounted
    secret. A token given in ``env`` is refused."""
    if TOKEN_ENV in env:
        raise ValueError(f"{TOKEN_ENV} in env would put the job token in the job's spec and on the submitting "
                         f"command line; write it to a file only you can read and pass token_file (or set "
                         f"${TOKEN_FILE_ENV})")
    path = token_file or env.get(TOKEN_FILE_ENV) or os.environ.get(TOKEN_FILE_ENV)
    if not path:
        return {}
    if not os.path.isabs(path):
        raise ValueError(f"token_file must be an absolute path (every role reads it from its own working "
                         f"directory), got {path!r}")
    return {TOKEN_FILE_ENV: path}


def lighthouse_role(
    *,
    min_replicas: int,
    port: int = 29510,
    dashboard_port: int = 29511,
    exit_when_idle: float = 60.0,
    state_dir: Optional[str] = None,
    join_timeout_ms: int = 60000,
    env: Optional[Dict[str, str]] = None,
    image: str = "",
) -> specs.Role:
    """The lighthouse as one role of a job: gRPC on ``port``, the dashboard on ``dashboard_port`` (``-1``:
    off), ending (exit code 0) once no replica group was seen for ``exit_when_idle`` seconds after its first
    quorum. ``state_dir``: a directory that outlives the role (shared storage or a volume)."""
    args = ["-m", "lighthouse", "--bind", f"[::]:{port}", "--min_replicas", str(min_replicas),
            "--join_timeout_ms", str(join_timeout_ms),
            "--http-bind", "off" if dashboard_port < 0 else f"[::]:{dashboard_port}",
            "--exit-when-idle", str(exit_when_idle)]
    if state_dir:
        args += ["--state-dir", state_dir]
    return specs.Role(
        name=LIGHTHOUSE_ROLE,
        image=image,
        entrypoint="python",
        args=args,
        num_replicas=1,
        resource=specs.resource(cpu=1, gpu=0, memMB=512),
        env=dict(env or {}),
        max_retries=0,
    )


def hsdp(
    *script_args: str,
    replicas: int = 2,
    workers_per_replica: int = 1,
    max_restarts: int = 10,
    script: str = "examples/train_ddp.py",
    env: Optional[Dict[str, str]] = None,
    image: str = "",
    h: Optional[str] = None,
    cpu: int = 2,
    gpu: int = 0,
    memMB: int = 1024,
    lighthouse: Optional[str] = None,
    lighthouse_host: str = "localhost",
    lighthouse_port: int = 29510,
    dashboard_port: int = 29511,
    min_replicas: int = 1,
    join_timeout_ms: int = 60000,
    exit_when_idle: float = 60.0,
    state_dir: Optional[str] = None,
    token_file: Optional[str] = None,
) -> specs.AppDef:
    """A fault-tolerant job: ``replicas`` replica groups of ``script``, and a lighthouse unless one is given.

    Args:
        script_args: arguments of the training script
        replicas: number of replica groups
        workers_per_replica: ranks per replica group (torchrun's --nproc_per_node)
        max_restarts: how many times torchrun restarts a group's workers after a failure
        script: the training script, relative to the working directory
        env: environment for every role (the job token is refused here: see token_file)
        image: the image every role runs in (ignored by local_cwd)
        h: a named resource for each replica group (torchx's hardware names)
        cpu: CPUs per replica group
        gpu: GPUs per replica group (0: CUDA_VISIBLE_DEVICES is set empty)
        memMB: memory per replica group, in MB
        lighthouse: address of a lighthouse to use (http://host:port); None runs one as a role of the job
        lighthouse_host: where the groups reach the lighthouse role (localhost for local_cwd)
        lighthouse_port: the lighthouse role's gRPC port
        dashboard_port: the lighthouse role's HTTP port (dashboard, /metrics, probes); -1 turns it off
        min_replicas: fewest replica groups a quorum may have (the lighthouse role's --min_replicas)
        join_timeout_ms: how long a quorum waits for healthy groups that have not joined
        exit_when_idle: the lighthouse role ends this many seconds after the last group left
        state_dir: the lighthouse role's --state-dir, on storage that outlives it
        token_file: absolute path of the job token's file on every host (default: $TORCHFT_LITE_TOKEN_FILE)
    """
    if replicas < 1 or workers_per_replica < 1:
        raise ValueError(f"replicas and workers_per_replica must be >= 1, got {replicas} and {workers_per_replica}")
    if max_restarts < 0:
        raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
    env = dict(env or {})
    shared = _token_env(env, token_file)
    env.update(shared)
    if gpu == 0:
        env.setdefault("CUDA_VISIBLE_DEVICES", "")
    roles = []
    if lighthouse is None:
        roles.append(lighthouse_role(min_replicas=min_replicas, port=lighthouse_port, dashboard_port=dashboard_port,
                                     exit_when_idle=exit_when_idle, state_dir=state_dir,
                                     join_timeout_ms=join_timeout_ms, env=env, image=image))
        lighthouse = f"http://{lighthouse_host}:{lighthouse_port}"
    env.setdefault("TORCHFT_LIGHTHOUSE", lighthouse)
    for group in range(replicas):
        roles.append(specs.Role(
            name=f"replica_{group}",
            image=image,
            entrypoint="python",  # torchrun that exits with its failed worker's code (torchft_lite.cluster.exit_codes)
            args=["-m", "torchft_lite.launch", "--standalone", "--nnodes=1", f"--nproc_per_node={workers_per_replica}",
                  f"--max_restarts={max_restarts}", script, *script_args],
            num_replicas=1,
            resource=specs.resource(cpu=cpu, gpu=gpu, memMB=memMB, h=h),
            env={"REPLICA_GROUP_ID": str(group), "NUM_REPLICA_GROUPS": str(replicas), **env},
            max_retries=0,
        ))
    return specs.AppDef(name="torchft_lite", roles=roles)
